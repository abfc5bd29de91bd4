"""Clients side by side (`--workers`): a one-thread run's results bit for bit, errors and
interruptions that leave nothing running and nothing half-written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.config import build_config
from pflalign.run.engine import Federation, run
from pflalign.errors import TrainingDiverged, UserError
from pflalign.run.lifecycle import Recorder
from pflalign.run.server import RoundPlan
from pflalign.run.workers import Processes, WorkerFailed, check_workers

from test_engine import TINY
from test_pinned_results import run_hashes

# three clients for two workers: a reply can come back before the one ahead of it
THREE = {**TINY, "data": {**TINY["data"], "clients": ["arithmetic", "sorting", "key_value"]},
         "eval": {**TINY["eval"], "every": 1, "every_max_test": 2}}


def config(method: str, **over):
    return build_config(None, {**json.loads(json.dumps(THREE)), "method": method, **over})


def one_thread_run(cfg, out: Path, **kwargs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(cfg, out, progress=False, **kwargs)
    finally:
        torch.set_num_threads(threads)


def worker_processes() -> list[int]:
    """This process's `python -m pflalign.run.workers` children still alive."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"pflalign.run.workers" in cmdline and " Z " not in stat[stat.rindex(")"):][:4]:
            pids.append(int(entry.name))
    return pids


# a pFLAlign step is stateful and personal, SCAFFOLD's messages carry two groups, FedSA-LoRA's
# personalized model is made after aggregation: each in its own way depends on what the worker got
@pytest.mark.parametrize("method", ["pflalign", "scaffold", "fedsa-lora"])
def test_two_workers_give_a_one_thread_run_bit_for_bit(tmp_path, method):
    one = one_thread_run(config(method), tmp_path / "one")
    two = run(config(method), tmp_path / "two", progress=False, workers=2)
    assert run_hashes(tmp_path / "two") == run_hashes(tmp_path / "one")  # tensors, metrics, predictions
    assert (two["workers"], two["threads_per_worker"]) == (2, 1)
    assert (one["workers"], one["threads_per_worker"]) == (1, 1)
    assert set(two["seconds_eval_by_model"]) == {"personalized", "global", "base"}
    lines = [json.loads(x) for x in (tmp_path / "two" / ckpt.METRICS).read_text().splitlines()]
    assert all(x["seconds"] > 0 for x in lines if x["event"] == "client_round")  # each client's own time
    assert worker_processes() == []  # stopped with the run


def test_sampled_clients_and_a_resume_across_worker_counts(tmp_path):
    """participation < 1 (each round's own sample); stopped after a round with two workers and
    resumed in this process: the uninterrupted one-thread run's results."""
    cfg = config("pflalign", participation=0.67, rounds=3)
    one_thread_run(cfg, tmp_path / "one")
    assert run(cfg, tmp_path / "split", progress=False, workers=2, stop_after=1) is None
    one_thread_run(None, tmp_path / "split", resume=True)
    assert run_hashes(tmp_path / "split") == run_hashes(tmp_path / "one")


def test_a_diverging_client_stops_the_run_in_one_line_and_the_workers(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"^client \d \((arithmetic|sorting|key_value)\): non-finite"):
        run(config("fedavg", lr=1e30), tmp_path, progress=False, workers=2)
    assert not (tmp_path / ckpt.RESULTS).exists()
    assert worker_processes() == []


def test_an_interrupt_while_a_worker_is_busy_then_resume(tmp_path, monkeypatch):
    """Ctrl-C after the first reply of round 2 (the other worker mid-job): the run stops at its
    last checkpoint, no worker is left, and a resume gives the uninterrupted results."""
    cfg = config("scaffold")
    one_thread_run(cfg, tmp_path / "one")
    original = RoundPlan.add

    def interrupt(self, i, message):  # the first reply of round 2 joins the server's sums
        if self.ctx.round == 1:
            raise KeyboardInterrupt
        original(self, i, message)

    monkeypatch.setattr(RoundPlan, "add", interrupt)
    with pytest.raises(KeyboardInterrupt, match="resume with"):
        run(cfg, tmp_path / "split", progress=False, workers=2)
    assert worker_processes() == []
    monkeypatch.setattr(RoundPlan, "add", original)
    run(None, tmp_path / "split", resume=True, progress=False, workers=2)
    assert run_hashes(tmp_path / "split") == run_hashes(tmp_path / "one")


def test_a_worker_that_dies_is_reported_not_waited_for(tmp_path):
    cfg = config("fedavg")
    fed = Federation(cfg, progress=False, out=tmp_path, workers=2)
    rec = Recorder(tmp_path, resume=False, overwrite=False)
    rec.open(cfg)
    try:
        fed.train(rec, 0, 1)
        fed.runner.procs[0].kill()
        with pytest.raises(WorkerFailed, match=r"exited unexpectedly \(exit code -9\)"):
            fed.train(rec, 1, 2)
    finally:
        fed.close()
        rec.close()
    assert worker_processes() == []


def test_jobs_come_back_in_their_order_whichever_finishes_first(tmp_path):
    """The costliest job starts first; the results are yielded in job order all the same."""
    cfg = config("fedavg")
    fed = Federation(cfg, progress=False, out=tmp_path, workers=2)
    try:
        jobs = [fed._train_job(0, k) for k in range(3)]
        shared = {"global": fed.global_params, "received": {}}
        events, done = [], []  # each result's arrival (on_result), then its handing back, as they happen
        for i, d in enumerate(fed.runner.map(jobs, shared, costs=[1.0, 3.0, 2.0],
                                             on_result=lambda j, r: events.append(("arrived", j, r.k)))):
            events.append(("handed back", i, d.k))
            done.append(d)
        assert [d.k for d in done] == [0, 1, 2]
        assert [d.record.file for d in done] == [f"{k}.r1.safetensors" for k in range(3)]
        # each result is told of as it arrives (the final scoring keeps it then), never after it is handed back
        arrived = [(j, k) for what, j, k in events if what == "arrived"]
        assert sorted(arrived) == [(0, 0), (1, 1), (2, 2)]
        assert all(events.index(("arrived", i, i)) < events.index(("handed back", i, i)) for i in range(3))
    finally:
        fed.close()


def test_the_costliest_start_first_within_a_window_of_the_next_2n(tmp_path, monkeypatch):
    """Costs rising with the job index: unbounded, the last job would start first and every
    result before it would wait in the engine. Within the window only jobs fewer than 2 x workers
    ahead of the next one handed back start, so at most that many results are ever held."""
    from pflalign.run.jobs import ScoreJob

    cfg = config("fedavg")
    fed = Federation(cfg, progress=False, out=tmp_path, workers=2)
    handed_back, started = [0], []
    original = Processes._send

    def spy(self, conn, message):
        if message[0] == "job":
            started.append((jobs.index(message[1]), handed_back[0]))
        original(self, conn, message)

    monkeypatch.setattr(Processes, "_send", spy)
    try:
        jobs = [ScoreJob(k, model, fed.store.records[k], fed.clients[k].data.test[:1], "test")
                for model in ("global", "base") for k in range(3)] + \
               [ScoreJob(0, "global", fed.store.records[0], fed.clients[0].data.test[1:2], "test")]
        for i, done in enumerate(fed.runner.map(jobs, {"global": fed.global_params}, costs=list(range(len(jobs))))):
            assert done.k == jobs[i].k
            handed_back[0] += 1
    finally:
        fed.close()
    assert [j for j, _ in started[:2]] == [3, 2]  # the costliest of jobs 0-3, not job 6
    assert sorted(j for j, _ in started) == list(range(len(jobs)))
    # the next window opens as a result is handed over (workers busy while the engine adds it)
    assert all(j < back + 1 + 4 for j, back in started)


def test_bad_worker_counts_are_refused():
    with pytest.raises(UserError, match="--workers must be >= 1"):
        check_workers(0, "cpu")
    with pytest.raises(UserError, match="on cuda use --workers 1"):
        check_workers(2, "cuda")
    check_workers(4, "cpu")


@pytest.mark.parametrize("command", ["run --config demo", "sweep --config table1-flan"])
def test_cli_refuses_zero_workers_in_one_line(tmp_path, command):
    done = subprocess.run([sys.executable, "-m", "pflalign", *command.split(), "--out", str(tmp_path / "r"),
                           "--workers", "0"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == "pflalign: error: --workers must be >= 1, got 0"
    assert not (tmp_path / "r").exists()


def test_processes_import_this_package(tmp_path):
    """A worker imports the pflalign its engine runs (a test of a worktree must not test another
    checkout's installed copy)."""
    import pflalign

    pool = Processes(1, json.loads(json.dumps(THREE)), tmp_path, [], {})
    try:
        assert pool.procs[0].args[1:3] == ["-m", "pflalign.run.workers"]
        assert Path(pflalign.__file__).resolve().parents[1].as_posix() in pool.env["PYTHONPATH"].split(os.pathsep)[0]
    finally:
        pool.close()


# ---- issue 41, item 5: --workers 99 for a few clients; workers outliving a killed engine ----------
def test_workers_are_bounded_by_the_clients_and_the_cores(tmp_path, monkeypatch, caplog):
    from pflalign.run.workers import bound_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert bound_workers(99, 4, 4) == 4 and bound_workers(3, 4, 4) == 3
    assert bound_workers(99, 2, 5) == 5  # the final scoring may use more than a round
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level("WARNING", logger="pflalign.run.workers"):
        assert bound_workers(99, 4, 4) == 2
    assert "--workers 99 lowered to 2: a round trains 4 clients, 4 are scored at the end, and this machine has " \
           "2 cores" in caplog.text
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    fed = Federation(config("fedavg"), progress=False, out=tmp_path, workers=99)  # three clients
    try:
        assert fed.workers == 3
    finally:
        fed.close()


ORPHAN_PARENT = r"""
import json, subprocess, sys, time
from pflalign.config import build_config
from pflalign.model import build_model
from pflalign.run.workers import Processes
cfg = json.loads(sys.argv[1])
pool = Processes(2, cfg, sys.argv[2], [], build_model(build_config(None, cfg)).get_lora())
# the engine's ends of the pipes held open elsewhere: as when a worker is mid-job and does not read
keeper = subprocess.Popen(["sleep", "300"], pass_fds=[c.writer.fileno() for c in pool.conns])
print(json.dumps({"workers": [p.pid for p in pool.procs], "keeper": keeper.pid}), flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has ended


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_an_engine_killed_by_sigkill(tmp_path):
    """Before: a worker busy (or blocked) when the engine was killed never saw its pipe close and
    lived on (95 of 99 did). Now the kernel kills it with its parent (prctl PR_SET_PDEATHSIG)."""
    import signal
    import time

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_PARENT, json.dumps(THREE), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env=env)
    pids = json.loads(parent.stdout.readline())
    try:
        assert all(_alive(p) for p in pids["workers"])
        time.sleep(2)
        parent.kill()  # kill -9
        parent.wait()
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in pids["workers"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(_alive(p) for p in pids["workers"])
    finally:
        for pid in [*pids["workers"], pids["keeper"]]:  # only what this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.stdout.close()
