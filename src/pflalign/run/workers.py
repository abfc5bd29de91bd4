"""A round's clients trained, and the final evaluation's clients scored, side by side.

Why: a round's clients are independent until the server aggregates them. On a
CPU, two single-threaded processes each training its own client finish a
FLAN round of SmolLM2 1.22× sooner than one process whose two threads split
every operation (29.0 against 35.4 s for the 4 clients; benchmarks/README.md,
"Clients side by side"). So with ``workers = N`` the engine hands its clients
to N worker processes of one thread each.

What stays the same: the numbers. A job is a pure function of what it is given:
the minibatches (drawn by the engine, `client.draw_batches`), the client's state
file (`client_store`: the worker reads it and writes the next one), w^r and
the broadcast, through the same client rule (`client.local_round`) and the same
scoring (`client.score_client`). The engine adds the replies to the aggregation in
client order, whichever finishes first. So ``workers = 2`` gives a one-thread
run's results bit for bit (test_workers.py); what changes results is the thread
count (floating-point sums split across threads differently), not the workers.

Two runners with one interface, `map(jobs, shared, costs)` → the jobs' results in
job order: `Inline` runs them in the engine's own process on its model (workers = 1,
the engine's threads); `Processes` spawns the workers once and keeps them for the run.
A worker holds its own copy of the model (the base weights are memory-mapped from
the same file, model/model_cache.py), and at most 2 × ``workers`` finished replies wait
for their turn in the engine (memory still flat in the number of clients per round).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Callable, Iterator

import torch

from .client_store import ClientStore
from .jobs import ClientSide, run_job
from ..errors import UserError
from ..methods.base import Params

log = logging.getLogger(__name__)


# ---- the runners ----------------------------------------------------------------
class Inline:
    """Jobs one after another in the engine's own process, on its model (workers = 1)."""

    workers = 1

    def __init__(self, side: ClientSide, progress: bool):
        self.side, self.progress = side, progress

    def threads(self) -> int:
        return torch.get_num_threads()

    def map(self, jobs: list, shared: dict, costs: list[float] | None = None,
            on_step: Callable[[int, int, float], None] | None = None,
            on_result: Callable[[int, object], None] | None = None) -> Iterator:
        """Each job's result, in order; `on_result(i, result)` as job i's comes back (here: just
        before it is yielded)."""
        for i, job in enumerate(jobs):
            step = None if on_step is None else (lambda t, loss, i=i: on_step(i, t, loss))
            result = run_job(self.side, job, shared, self.progress, step)
            if on_result is not None:
                on_result(i, result)
            yield result

    def close(self) -> None:
        pass


class WorkerFailed(RuntimeError):
    """A worker process raised an error that is not one of ours, or died."""


class Processes:
    """`workers` spawned processes of one thread each, kept for the run; jobs go to whichever is
    free, the costliest of the next 2 × workers first (`costs`: a round's tokens), and come back
    in job order."""

    def __init__(self, workers: int, cfg_dict: dict, out: Path, names: list[str], initial_params: Params):
        self.workers = workers
        self.conns, self.procs = [], []
        self.broken = False
        # a fresh interpreter each (`python -m pflalign.run.workers`), not multiprocessing's spawn, which
        # re-runs the caller's main script in the child: a script without a __main__ guard would
        # start its run again there. Never fork: this process has run torch's thread pools.
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        package_root = str(Path(__file__).resolve().parents[2])  # this pflalign, not another one installed
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])
        self.env = env
        for _ in range(workers):
            child_reads, parent_writes = os.pipe()
            parent_reads, child_writes = os.pipe()
            proc = subprocess.Popen([sys.executable, "-m", "pflalign.run.workers", str(child_reads), str(child_writes),
                                     str(os.getpid())],
                                    pass_fds=(child_reads, child_writes), env=env, stdin=subprocess.DEVNULL)
            os.close(child_reads), os.close(child_writes)
            self.conns.append(_Pipes(parent_writes, parent_reads))
            self.procs.append(proc)
        for conn in self.conns:
            self._send(conn, ("start", (cfg_dict, str(out), names, initial_params)))

    def threads(self) -> int:
        return 1

    def map(self, jobs: list, shared: dict, costs: list[float] | None = None, on_step=None,
            on_result: Callable[[int, object], None] | None = None) -> Iterator:
        """Each job's result, in job order; `on_result(i, result)` as soon as job i's comes back,
        which may be before jobs ahead of it are (the final scoring keeps each job so)."""
        if self.broken:
            raise WorkerFailed("the worker processes were stopped after an earlier error")
        if not jobs:
            return
        self.broken = True  # until every job is back: an abandoned map leaves the workers mid-job
        for conn in self.conns:
            self._send(conn, ("shared", shared))
        # the costliest first (a round ends with its slowest worker), but only among the next
        # `window` jobs to hand back: a result waits here until those before it are back, so the
        # window bounds how many replies this process holds (memory flat in |S|)
        window = 2 * self.workers
        pending = set(range(len(jobs)))
        busy: dict = {}  # conn → index of its job
        finished: dict[int, object] = {}
        next_out = 0

        def submit_to_idle() -> None:
            """Each idle worker takes the costliest pending job within the window."""
            for conn in self.conns:
                open_ = [j for j in pending if j < next_out + window]
                if conn in busy or not open_:
                    continue
                j = max(open_, key=lambda j: ((costs[j] if costs else 0.0), -j))  # ties: job order
                pending.discard(j)
                self._send(conn, ("job", jobs[j]))
                busy[conn] = j

        submit_to_idle()
        for i in range(len(jobs)):
            while i not in finished:
                for conn in wait(list(busy)):
                    j = busy.pop(conn)
                    finished[j] = self._receive(conn)
                    if on_result is not None:
                        on_result(j, finished[j])
                submit_to_idle()
            if not busy and not pending:  # every job is back: the workers are idle, whatever comes next
                self.broken = False
            next_out = i + 1
            result = finished.pop(i)
            submit_to_idle()  # the window moved on by one
            yield result

    def _send(self, conn, message) -> None:
        try:
            conn.send(message)
        except OSError:  # BrokenPipeError among them: the worker is gone
            raise self._died(conn) from None

    def _receive(self, conn):
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            raise self._died(conn) from None
        if status == "error":
            raise payload
        return payload

    def _died(self, conn) -> WorkerFailed:
        self.broken = True
        proc = self.procs[self.conns.index(conn)]
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        why = " (killed: out of memory?)" if code is not None and code < 0 else ""
        return WorkerFailed(f"a client worker process exited unexpectedly (exit code {code}){why}")

    def close(self) -> None:
        for conn in self.conns:
            try:
                if not self.broken:
                    conn.send(("stop", None))
                conn.close()
            except OSError:
                pass
        for proc in self.procs:
            if self.broken:
                proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class _TensorPickler(pickle.Pickler):
    """Each tensor as its own elements' bytes. torch pickles a tensor with its whole storage, and
    an adapter's tensors are views of one flat buffer (params.empty_like): 420 of them would be
    420 copies of the whole adapter (8 GB for SmolLM2's 19.5 MB)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return _tensor_from_bytes, (data, t.dtype, tuple(t.shape))
        return NotImplemented


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class _Pipes:
    """One worker's two pipes as one connection: messages framed by `Connection`, pickled with
    the plain pickler (tensors as bytes; multiprocessing's would hand torch tensors over as shared
    memory, which only its own child processes can open); `fileno` is the reading end, for `wait`."""

    def __init__(self, write_fd: int, read_fd: int):
        self.writer = Connection(write_fd, readable=False)
        self.reader = Connection(read_fd, writable=False)

    def send(self, obj) -> None:
        buffer = io.BytesIO()
        _TensorPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        self.writer.send_bytes(buffer.getbuffer())

    def recv(self):
        return pickle.loads(self.reader.recv_bytes())

    def fileno(self) -> int:
        return self.reader.fileno()

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


def _worker_main(read_fd: int, write_fd: int) -> None:
    """A worker: build the model once (one thread), then run jobs until told to stop or until the
    engine's end of the pipe closes (the engine died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it stops us
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from transformers.utils import logging as hf_logging

    from ..config import build_config, make_method
    from ..model import build_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    conn = _Pipes(write_fd, read_fd)
    try:
        kind, (cfg_dict, out, names, initial_params) = conn.recv()
    except (EOFError, ConnectionError):
        return
    cfg = build_config(None, cfg_dict)
    side = ClientSide(build_model(cfg), make_method(cfg), cfg, ClientStore(out, names), initial_params)
    shared: dict = {}
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, ConnectionError):
            return
        if kind == "stop":
            return
        if kind == "shared":
            shared = payload
            continue
        try:
            reply = ("done", run_job(side, payload, shared))
        except UserError as exc:  # ours (TrainingDiverged, a damaged client file ...): said as they are
            reply = ("error", exc)
        except Exception as exc:  # noqa: BLE001 - anything else, with the worker's traceback
            reply = ("error", WorkerFailed(f"in a client worker: {exc!r}\n{traceback.format_exc()}"))
        conn.send(reply)


def bound_workers(workers: int, per_round: int, scored: int) -> int:
    """`workers`, lowered (with a warning) to the clients a round trains or the clients scored at
    the end, whichever is more, and to this machine's cores: a worker more does nothing but hold
    another copy of the model (--workers 99 for 4 clients had the engine killed for memory)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    bound = max(1, min(max(per_round, scored), cores))
    if workers > bound:
        log.warning("--workers %d lowered to %d: a round trains %d clients, %d are scored at the end, and this "
                    "machine has %d cores (each worker holds its own copy of the model)", workers, bound, per_round,
                    scored, cores)
    return min(workers, bound)


def _die_with_parent(parent: int) -> None:
    """End this worker when the engine process `parent` ends, however it ends (kill -9 too), even
    mid-job, where it would not read the closed pipe. Linux: the kernel's parent-death signal
    (prctl PR_SET_PDEATHSIG, SIGKILL; a worker's files are written under names no checkpoint
    knows yet, so killing it loses nothing). Elsewhere: a thread that sees this process given
    to another parent."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:
        import threading

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # it ended before the line above took effect
        os._exit(1)


def check_workers(workers: int, device: str) -> None:
    """Refuse what cannot work: fewer than one worker, or several processes on one GPU."""
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    if workers > 1 and torch.device(device).type != "cpu":
        raise UserError(f"--workers {workers} runs clients in CPU processes; on {device} use --workers 1")


if __name__ == "__main__":  # a worker process (`Processes` starts it): python -m pflalign.run.workers READ WRITE PARENT
    _die_with_parent(int(sys.argv[3]))
    # through the module's own name: the jobs are unpickled as pflalign.run.workers' classes, not __main__'s
    from pflalign.run.workers import _worker_main as main

    main(int(sys.argv[1]), int(sys.argv[2]))
