"""What a Flower app process pays before it works: a ClientApp answering a ``query`` imports
neither torch nor transformers (client_app.py), and the ServerApp finds replies every
`grid.PULL_INTERVAL` seconds through the grid's own push/pull (grid.py). And which pflalign
the processes of a local cluster import (cluster.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr")

from flwr.serverapp import Grid  # noqa: E402

from pflalign.flower import grid as grid_mod  # noqa: E402
from pflalign.flower.grid import PromptGrid, prompt  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"

QUERY = r"""
import json, sys
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from pflalign.flower import client_app
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # as Flower sets them in a ClientApp
msg = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=1, message_type="query")
ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 2, "num-partitions": 4}, state=RecordDict(),
              run_config={})
reply = client_app.app(msg, ctx)
heavy = ("torch", "transformers", "peft", "pflalign.model")
print(json.dumps({"info": dict(reply.content["info"]), "loaded": sorted(m for m in heavy if m in sys.modules)}))
"""


def test_query_loads_neither_torch_nor_transformers():
    """A fresh process, as Flower starts one per message: importing the ClientApp and answering
    a query must not import torch or transformers (7-9 CPU seconds per process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", QUERY], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["info"] == {"partition-id": 2, "num-partitions": 4}
    assert out["loaded"] == []


class FakeGrid(Grid):
    """Replies that reach the SuperLink after some pulls: `ready[i]` is the pull (0-based) from
    which the reply to message i is there (None: never). A reply carries only what a grid's
    caller reads to match it: ``metadata.reply_to_message_id``."""

    def __init__(self, ready: list[int | None]):
        self.ready, self.pulls = ready, 0

    def set_run(self, run):
        pass

    @property
    def run(self):
        return None

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        raise NotImplementedError

    def get_node_ids(self):
        return [1, 2, 3]

    def push_messages(self, messages):
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids):
        now, self.pulls = self.pulls, self.pulls + 1
        return [SimpleNamespace(i=int(mid[1:]), metadata=SimpleNamespace(reply_to_message_id=mid))
                for mid in message_ids if self.ready[int(mid[1:])] is not None and self.ready[int(mid[1:])] <= now]

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("PromptGrid must not call the wrapped grid's send_and_receive")


def test_prompt_grid_collects_every_reply_as_it_arrives():
    fake = FakeGrid([0, 3, 5])
    replies = PromptGrid(fake, interval=0).send_and_receive([object()] * 3, timeout=None)
    assert sorted(r.i for r in replies) == [0, 1, 2]
    assert fake.pulls == 6  # pulls 0..5: the last reply is there at pull 5, then it stops


def test_prompt_grid_stops_at_the_timeout_with_the_replies_it_has():
    fake = FakeGrid([0, None])
    replies = PromptGrid(fake, interval=0.01).send_and_receive([object()] * 2, timeout=0.1)
    assert [r.i for r in replies] == [0]
    assert 5 <= fake.pulls <= 12  # about timeout / interval pulls, then it gives up


def test_prompt_wraps_only_the_deployment_engines_grid():
    from flwr.superlink.grid import HttpGrid

    fake = FakeGrid([0])
    assert prompt(fake) is fake  # e.g. the Simulation Engine's InMemoryGrid, which pulls every 0.1 s
    wrapped = prompt(HttpGrid(token="t"))
    assert isinstance(wrapped, PromptGrid) and wrapped.interval == grid_mod.PULL_INTERVAL < 3


def test_cluster_processes_import_the_callers_pflalign(tmp_path, monkeypatch):
    """`PYTHONPATH=src` names the caller's src; the cluster's processes run in their own folder,
    where it would name another (or none, and the installed pflalign would run unnoticed)."""
    from pflalign.flower.cluster import Processes

    monkeypatch.chdir(tmp_path)
    procs = Processes(tmp_path / "run", env={"PYTHONPATH": os.pathsep.join(["src", "", "/abs/lib"])})
    assert procs.env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "src"), "", "/abs/lib"]
    out = subprocess.run([sys.executable, "-c", "import sys; print(sys.path[1])"], env=procs.env, cwd=procs.root,
                         capture_output=True, text=True).stdout.strip()
    assert out == str(tmp_path / "src")


def test_one_command_stops_the_local_superlink_flwr_left_running(tmp_path, capsys):
    """Issue 42: `flwr run . local` leaves a simulation SuperLink listening on 127.0.0.1;
    `python -m pflalign.flower.cluster stop-local` stops it (only the one of that FLWR_HOME).
    Started here as `flwr` starts it (its --log-file under FLWR_HOME), on a free port."""
    import psutil

    from pflalign.flower import cluster as cl

    home, other = tmp_path / "flwr-home", tmp_path / "other-home"
    port = cl.free_port()
    with cl.Processes(tmp_path / "procs") as procs:
        args = [str(cl.BIN / "flower-superlink"), "--insecure", "--simulation", "--host", "127.0.0.1", "--port",
                str(port), "--disable-runtime-dependency-installation", "--log-file",
                str(home.joinpath(*cl.LOCAL_LOG))]
        home.joinpath(cl.LOCAL_LOG[0]).mkdir(parents=True)
        link = procs.start("superlink", args, port)
        assert [p.pid for p in cl.local_superlinks(home)] == [link.pid]
        assert cl.main(["stop-local", str(other)]) == 0 and link.poll() is None  # another home: left alone
        assert "no local SuperLink" in capsys.readouterr().out
        assert cl.main(["stop-local", str(home)]) == 0
        assert f"pids {link.pid}" in capsys.readouterr().out
        assert link.wait(timeout=30) is not None
        assert not [c for c in psutil.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert procs.leftovers() == []
