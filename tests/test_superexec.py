"""pflalign-superexec (`pflalign.flower.superexec`) without a cluster: what it forks, what the
child drops, how it exits and is reaped. The end-to-end checks (runs on real SuperNodes, equal
to the in-process engine) are in test_flower.py and test_flower_privacy.py, whose clusters use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pflalign.flower import superexec

pytest.importorskip("flwr")
from flwr.supercore.constant import TaskType  # noqa: E402
from flwr.supercore.superexec.executor import ExecutionSpec  # noqa: E402


def spec(task_type=TaskType.CLIENT_APP, **over) -> ExecutionSpec:
    fields = dict(task_type=task_type, runtime_api_address="127.0.0.1:9", token="t0ken", insecure=True,
                  root_certificates_path=None, runtime_dependency_install=False, parent_pid=None,
                  suppress_output=False, task_id=1)
    return ExecutionSpec(**{**fields, **over})


def reap(executor: superexec.ForkExecutor, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while executor.children and time.monotonic() < deadline:
        executor.reconcile()
        time.sleep(0.02)
    assert not executor.children, "a forked task did not end"


def test_client_and_server_apps_are_forked_other_tasks_go_to_flowers_executor(tmp_path, monkeypatch):
    seen = tmp_path / "seen"

    def fake_child(s):  # runs in the forked child
        (seen / f"{s.task_type}-{s.task_id}").write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid()}))
        os._exit(0)

    launched = []
    seen.mkdir()
    monkeypatch.setattr(superexec, "run_task_in_child", fake_child)
    executor = superexec.ForkExecutor()
    monkeypatch.setattr(executor.subprocess, "launch", lambda s: launched.append(s.task_type) or "subprocess")
    executor.launch(spec(TaskType.CLIENT_APP, task_id=1))
    executor.launch(spec(TaskType.SERVER_APP, task_id=2))
    assert executor.launch(spec(TaskType.CONNECTOR, task_id=3)) == "subprocess"
    reap(executor)
    assert launched == [TaskType.CONNECTOR]
    files = sorted(p.name for p in seen.iterdir())
    assert files == sorted([f"{TaskType.CLIENT_APP}-1", f"{TaskType.SERVER_APP}-2"])
    for f in seen.iterdir():
        ids = json.loads(f.read_text())
        assert ids["ppid"] == os.getpid() and ids["pid"] != os.getpid()  # a child of this process


CHILD = r"""
import json, os, sys
from flwr.supercore.constant import TaskType
from flwr.supercore.exit import exit_handler
from flwr.supercore.superexec.executor import ExecutionSpec
from pflalign.flower import superexec

out, exit_with, task_type = sys.argv[1], sys.argv[2], sys.argv[3]
exit_handler.add_exit_handler(lambda: open(out + ".parent-handler-ran", "w").close())  # the parent's, as run_superexec's

def fake_run(spec, certificates):
    json.dump({"handlers": len(exit_handler.registered_exit_handlers), "certificates": certificates,
               "token": spec.token}, open(out, "w"))
    if exit_with == "raise":
        raise RuntimeError("the app failed")
    if exit_with != "return":
        sys.exit(int(exit_with))  # as flwr_exit ends a task

superexec._run_clientapp = superexec._run_serverapp = fake_run
spec = ExecutionSpec(task_type=TaskType(task_type), runtime_api_address="127.0.0.1:9", token="abc", insecure=True,
                     root_certificates_path=None, runtime_dependency_install=False, parent_pid=None,
                     suppress_output=False, task_id=1)
superexec.run_task_in_child(spec)
print("not reached")
"""


@pytest.mark.parametrize("exit_with, code", [("return", 0), ("0", 0), ("7", 7), ("raise", 1)])
@pytest.mark.parametrize("task_type", [TaskType.CLIENT_APP, TaskType.SERVER_APP])
def test_the_child_drops_the_parents_exit_handlers_and_exits_with_the_tasks_status(tmp_path, exit_with, code,
                                                                                   task_type):
    """run_task_in_child in a process of its own (it ends the process): Flower's exit handlers
    that the SuperExec registered (its Runtime API client, its executor) are dropped before the
    task runs and never run in the child; the process ends with the task's status, 1 for an
    uncaught error (with its traceback), and never returns."""
    out = tmp_path / "child.json"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out), exit_with, str(task_type)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "not reached" not in proc.stdout
    seen = json.loads(out.read_text())
    assert seen == {"handlers": 0, "certificates": None, "token": "abc"}
    assert not Path(str(out) + ".parent-handler-ran").exists()
    assert ("RuntimeError: the app failed" in proc.stderr) == (exit_with == "raise")


def test_close_stops_the_tasks_still_running(monkeypatch):
    def sleeper(s):
        time.sleep(60)
        os._exit(0)

    monkeypatch.setattr(superexec, "run_task_in_child", sleeper)
    executor = superexec.ForkExecutor()
    executor.launch(spec())
    (pid,) = executor.children
    tic = time.monotonic()
    executor.close()
    assert not executor.children and time.monotonic() - tic < 10
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped


def test_warm_imports_skip_what_is_missing():
    assert superexec.warm_imports(("json", "no_such_module_here")) == ["no_such_module_here"]
    assert superexec.warm_imports() == []  # everything a pflalign app imports is installed


def test_the_command_is_flowers_superexec_with_the_fork_executor(monkeypatch):
    """`pflalign-superexec` runs Flower's own `flower-superexec` entry point, arguments and all,
    with `run_superexec` building a ForkExecutor."""
    import importlib

    from flwr.supercore.superexec import run_superexec

    cli = importlib.import_module("flwr.supercore.cli.flower_superexec")  # the module; the package exports the function

    called = {}

    def fake_cli():
        called["executor"] = run_superexec.get_executor("subprocess")

    monkeypatch.setattr(cli, "flower_superexec", fake_cli)
    monkeypatch.setattr(superexec, "warm_imports", lambda: [])
    monkeypatch.setattr(run_superexec, "get_executor", run_superexec.get_executor)  # restored afterwards
    superexec.main()
    assert isinstance(called["executor"], superexec.ForkExecutor)
