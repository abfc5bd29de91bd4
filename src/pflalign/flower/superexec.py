"""A SuperExec that forks each ClientApp (and ServerApp) process from one that has already
imported torch, transformers and Flower: ``pflalign-superexec``.

Flower runs every message a SuperNode receives in a new ``flwr-clientapp`` process (it serves
one task and exits), so each message pays again for starting Python and importing torch,
transformers and Flower: about 5 of the 7 CPU seconds a heavy message costs on the 2-core test
machine (docs/distributed.md, "Start-up cost and speed"); a SuperLink does the same with one
``flwr-serverapp`` process per run. A SuperNode or SuperLink started with ``--isolation
process`` launches no SuperExec of its own; this one takes its place. It is Flower's own
SuperExec (`flower-superexec`, same arguments, same Runtime API, same task loop) with one
change: a ClientApp or ServerApp task is run by Flower's own `run_clientapp` / `run_serverapp`,
unchanged, in a child forked from this process instead of in a new ``flwr-clientapp`` /
``flwr-serverapp`` process. Each task still gets a process of its own, which exits when the
task ends, so nothing a task computes reaches another; only the imports are shared. Other task
types are launched as Flower launches them.

    flower-supernode --isolation process --port 9094 ...
    pflalign-superexec --insecure --runtime-api-address 127.0.0.1:9094

Why forking is safe here: this process imports modules and computes nothing, so no torch thread
pool exists yet when it forks (the children start theirs with the SuperNode's environment,
OMP_NUM_THREADS included); the child drops the exit handlers Flower registered for this process
(they would close this process's Runtime API connection) and leaves with ``os._exit``, so
nothing of the parent's is run or closed twice.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time

# What a ClientApp of pflalign imports on its first train or evaluate message, third-party only:
# pflalign itself is loaded by the task as Flower loads any app. Importing more only costs memory.
WARM_MODULES = (
    "torch",
    "numpy",
    "safetensors.torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation",
    "transformers.models.llama.modeling_llama",
    "transformers.models.opt.modeling_opt",
    "peft",
    "tokenizers",
    "flwr.clientapp",
    "flwr.client.mod",
    "flwr.supernode.runtime.run_clientapp",
    "flwr.serverapp",
    "flwr.superlink.runtime.run_serverapp",
)


def warm_imports(modules=WARM_MODULES) -> list[str]:
    """Import `modules` (those that fail are skipped: a missing optional one only costs speed);
    the names of the ones that failed."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - any import error: the task imports it itself, or fails as it would
            failed.append(name)
    return failed


def _run_clientapp(spec, certificates) -> None:
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    run_clientapp(runtime_api_address=spec.runtime_api_address, token=spec.token, insecure=spec.insecure,
                  certificates=certificates, parent_pid=spec.parent_pid,
                  runtime_dependency_install=spec.runtime_dependency_install)


def _run_serverapp(spec, certificates) -> None:
    """As `flwr-serverapp` does: the process's output mirrored to the run's log stream."""
    from queue import Queue

    from flwr.supercore.logger import mirror_output_to_queue, restore_output
    from flwr.superlink.runtime import run_serverapp

    log_queue = Queue()
    mirror_output_to_queue(log_queue)
    run_serverapp(runtime_api_address=spec.runtime_api_address, log_queue=log_queue, token=spec.token,
                  insecure=spec.insecure, certificates=certificates, parent_pid=spec.parent_pid,
                  runtime_dependency_install=spec.runtime_dependency_install)
    restore_output()


def run_task_in_child(spec) -> None:
    """The child's side of a fork: Flower's `run_clientapp` or `run_serverapp` for `spec`, then
    exit. Never returns."""
    code = 1
    try:
        from flwr.supercore.constant import TaskType
        from flwr.supercore.exit import exit_handler
        from flwr.supercore.tls import validate_and_resolve_root_certificates

        exit_handler.registered_exit_handlers.clear()  # the parent's: its client and executor, not ours
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)  # the task registers its own
        if spec.suppress_output:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        run = _run_clientapp if spec.task_type == TaskType.CLIENT_APP else _run_serverapp
        run(spec, validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure))
        code = 0
    except SystemExit as done:  # flwr_exit ends every task with sys.exit
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - report it and exit with 1, as an uncaught error in flwr-clientapp would
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


class ForkExecutor:
    """Flower's executor interface (`flwr.supercore.superexec.executor.types.Executor`): ClientApp
    and ServerApp tasks run in forked children; every other task type goes to Flower's
    `SubprocessExecutor`."""

    def __init__(self):
        from flwr.supercore.superexec.executor import SubprocessExecutor

        self.subprocess = SubprocessExecutor()
        self.children: set[int] = set()
        self.pid = os.getpid()

    def get_eligible_capacity(self, supported_task_types, **kwargs):
        return self.subprocess.get_eligible_capacity(supported_task_types, **kwargs)

    def wait_for_capacity(self, task_type=None, **kwargs) -> None:
        self.subprocess.wait_for_capacity(task_type, **kwargs)

    def launch(self, spec):
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor import LaunchResult

        if spec.task_type not in (TaskType.CLIENT_APP, TaskType.SERVER_APP):
            return self.subprocess.launch(spec)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_task_in_child(spec)
        self.children.add(pid)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Reap the children that have ended (called on every turn of the task loop)."""
        for pid in list(self.children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.children.discard(pid)

    def close(self) -> None:
        """At shutdown: SIGTERM to the tasks still running, as Flower's own stop would reach them."""
        if os.getpid() != self.pid:
            return
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while self.children and time.monotonic() < deadline:
            self.reconcile()
            time.sleep(0.05)
        self.subprocess.close()


def main() -> None:
    """``pflalign-superexec``: `flower-superexec` (same arguments) with ClientApps forked."""
    warm_imports()
    from flwr.supercore.cli.flower_superexec import flower_superexec
    from flwr.supercore.superexec import run_superexec

    run_superexec.get_executor = lambda *args, **kwargs: ForkExecutor()
    flower_superexec()


if __name__ == "__main__":
    main()
