"""No lost work: the two-generation checkpoint with its manifest, a run killed with
SIGKILL or stopped with Ctrl-C (SIGINT) in round 3 and resumed, a corrupt checkpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.checkpoint import run_checkpoint
from pflalign.run.client_store import client_records
from pflalign.cli import main
from pflalign.config import build_config
from pflalign.run.engine import run
from pflalign.errors import UserError
from pflalign.methods.base import clone
from pflalign.run.jobs import ScoreJob

from test_engine import TINY

REPO = Path(__file__).resolve().parents[1]
# 4 rounds, long enough (about a second each) to be caught in the middle of round 3
CRASH_CONFIG = {**TINY, "method": "pflalign", "rounds": 4, "local_steps": 40}


# ---- the checkpoint files ----------------------------------------------------------------
def _payload(rounds_done: int) -> dict:
    return {"rounds_done": rounds_done, "global": {"w": torch.full((3,), float(rounds_done))}, "metrics_offset": 0}


def _files(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()}


def test_two_checkpoints_and_a_manifest(tmp_path):
    for r in (1, 2, 3):
        ckpt.save_run_checkpoint(tmp_path, _payload(r))
    assert _files(tmp_path) == {ckpt.CHECKPOINT, ckpt.PREVIOUS, ckpt.MANIFEST}  # at most two, no temporaries
    manifest = json.loads((tmp_path / ckpt.MANIFEST).read_text())["checkpoints"]
    assert [(e["file"], e["rounds_done"]) for e in manifest] == [(ckpt.CHECKPOINT, 3), (ckpt.PREVIOUS, 2)]
    for e in manifest:  # the checksum hashed while writing is the file's own
        data = (tmp_path / e["file"]).read_bytes()
        assert (e["sha256"], e["size"]) == (hashlib.sha256(data).hexdigest(), len(data))
    assert ckpt.load_run_checkpoint(tmp_path)["rounds_done"] == 3


def test_adapter_dicts_are_stored_as_one_record_each_and_come_back_equal(tmp_path):
    """Dicts of tensors are written as one flat tensor each (the checkpoint is ~7,000
    tensors otherwise) and load back with the same names, order, shapes and values;
    a dict that shares memory with another part of the payload, or mixes dtypes, is
    stored as it is, so sharing survives a save and load as torch.save keeps it."""
    gen = torch.Generator().manual_seed(0)
    adapter = {"b": torch.randn(3, 2, generator=gen), "a": torch.randn(4, generator=gen), "c": torch.randn(1, 5, generator=gen)}
    flat = torch.arange(10.0)
    views = {"x": flat[:4].view(2, 2), "y": flat[4:]}  # a dict rebuilt by a previous load: views of one buffer
    common = torch.ones(2)
    payload = {
        "rounds_done": 1, "metrics_offset": 0, "torch_rng": torch.get_rng_state(),
        "global": adapter, "clients": [{"state": {"v": views}, "steps_taken": 3}],
        "mixed": {"f": torch.zeros(2), "d": torch.zeros(2, dtype=torch.float64)},
        "shared_1": {"p": common, "q": torch.zeros(2)}, "shared_2": {"p": common, "r": torch.zeros(2)},
    }
    packed = ckpt.pack_tensors(payload)
    assert set(packed["global"]) == {ckpt.PACKED, "names", "shapes"}
    assert set(packed["clients"][0]["state"]["v"]) == {ckpt.PACKED, "names", "shapes"}
    assert ckpt.PACKED not in packed["mixed"] and ckpt.PACKED not in packed["shared_1"]
    ckpt.save_run_checkpoint(tmp_path, payload)
    back = ckpt.load_run_checkpoint(tmp_path)
    assert list(back["global"]) == ["b", "a", "c"]
    for name, t in adapter.items():
        assert torch.equal(back["global"][name], t) and back["global"][name].shape == t.shape
    assert torch.equal(back["clients"][0]["state"]["v"]["x"], views["x"])
    assert torch.equal(back["clients"][0]["state"]["v"]["y"], views["y"])
    assert back["clients"][0]["steps_taken"] == 3 and torch.equal(back["torch_rng"], payload["torch_rng"])
    assert back["mixed"]["d"].dtype == torch.float64
    back["shared_1"]["p"].add_(1.0)  # still one tensor in two places, as it was saved
    assert torch.equal(back["shared_2"]["p"], torch.full((2,), 2.0))
    flat_backed = clone(adapter)  # views filling one buffer in order: packed without a copy
    assert ckpt.pack_tensors({"a": flat_backed})["a"][ckpt.PACKED].data_ptr() == flat_backed["b"].data_ptr()
    assert ckpt.pack_tensors({"a": adapter})["a"][ckpt.PACKED].data_ptr() != adapter["b"].data_ptr()
    ckpt.save_run_checkpoint(tmp_path, back)  # loaded views pack again
    assert torch.equal(ckpt.load_run_checkpoint(tmp_path)["global"]["c"], adapter["c"])


def test_loading_hashes_from_disk_even_a_file_this_process_wrote(tmp_path, caplog):
    """Saving trusts the checksums of files it wrote itself (same inode, size, mtime);
    loading never does: a byte flipped behind its back, size and mtime put back, is caught."""
    for r in (1, 2):
        ckpt.save_run_checkpoint(tmp_path, _payload(r))
    path = tmp_path / ckpt.CHECKPOINT
    st = path.stat()
    with open(path, "r+b") as f:  # in place: same inode
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert run_checkpoint._stat_key(path) in run_checkpoint._written  # a save would take it for the file it wrote
    with caplog.at_level(logging.WARNING):
        assert ckpt.load_run_checkpoint(tmp_path)["rounds_done"] == 1
    assert "does not match its checksum" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, damage):
    for r in (1, 2):
        ckpt.save_run_checkpoint(tmp_path, _payload(r))
    path = tmp_path / ckpt.CHECKPOINT
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":  # same size, one byte changed: only the checksum sees it
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        path.unlink()
    with caplog.at_level(logging.WARNING):
        assert ckpt.load_run_checkpoint(tmp_path)["rounds_done"] == 1
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "checkpoint.pt" in warning and "resuming from checkpoint.prev.pt (after round 1)" in warning
    assert ("missing" if damage == "missing" else "does not match its checksum") in warning


def test_no_good_checkpoint_is_a_user_error(tmp_path):
    for r in (1, 2):
        ckpt.save_run_checkpoint(tmp_path, _payload(r))
    for name in (ckpt.CHECKPOINT, ckpt.PREVIOUS):
        (tmp_path / name).write_bytes(b"garbage")
    with pytest.raises(UserError, match=r"no usable checkpoint in .*checkpoint\.pt does not match.*"
                                        r"checkpoint\.prev\.pt does not match.*--overwrite"):
        ckpt.load_run_checkpoint(tmp_path)
    (tmp_path / ckpt.MANIFEST).unlink()  # unverified (no manifest): loading itself fails
    with pytest.raises(UserError, match=r"checkpoint\.pt cannot be read"):
        ckpt.load_run_checkpoint(tmp_path)


class Killed(BaseException):
    pass


@pytest.mark.parametrize("crash_at", [0, 1, 2])  # the manifest write, the rename to .prev, the final rename
def test_a_crash_anywhere_in_a_save_leaves_a_good_checkpoint(tmp_path, monkeypatch, crash_at):
    for r in (1, 2):
        ckpt.save_run_checkpoint(tmp_path, _payload(r))
    calls, real_replace = [], os.replace

    def replace(src, dst):
        if len(calls) == crash_at:
            raise Killed
        calls.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed):
        ckpt.save_run_checkpoint(tmp_path, _payload(3))
    monkeypatch.undo()
    assert ckpt.load_run_checkpoint(tmp_path)["rounds_done"] == 2  # the newest one the crash left intact
    ckpt.save_run_checkpoint(tmp_path, _payload(3))
    assert _files(tmp_path) == {ckpt.CHECKPOINT, ckpt.PREVIOUS, ckpt.MANIFEST}
    (tmp_path / ckpt.CHECKPOINT).write_bytes(b"garbage")
    assert ckpt.load_run_checkpoint(tmp_path)["rounds_done"] == 2  # and the fallback still holds


def test_metrics_log_rolls_back_and_refuses_a_short_file(tmp_path):
    log = ckpt.MetricsLog(tmp_path / ckpt.METRICS)
    log.write(round=0)
    offset = log.commit()
    log.write(round=1)
    log.rollback(offset)
    log.close()
    assert (tmp_path / ckpt.METRICS).read_text() == '{"round": 0}\n'
    with pytest.raises(UserError, match="fewer than the 1000 its checkpoint records"):
        ckpt.MetricsLog(tmp_path / ckpt.METRICS, resume_offset=1000)


# ---- whole runs -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "crash.json"
    path.write_text(json.dumps(CRASH_CONFIG))
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, config_file) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    run(build_config(str(config_file)), out, progress=False)
    return out


def _without_seconds(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("seconds")}


def assert_same_run(out: Path, ref: Path) -> None:
    """Adapters, client states, results.json and metrics.jsonl equal, timings aside."""
    mine, theirs = ckpt.load_run_checkpoint(out), ckpt.load_run_checkpoint(ref)
    assert mine["rounds_done"] == theirs["rounds_done"] == CRASH_CONFIG["rounds"]

    def same(a: dict, b: dict, what: str) -> None:
        assert a.keys() == b.keys(), what
        for n in a:
            assert torch.equal(a[n], b[n]), f"{what}: {n}"

    same(mine["global"], theirs["global"], "global adapter")
    for k, (a, b) in enumerate(zip(client_records(out, mine), client_records(ref, theirs), strict=True)):
        same(a["personalized"], b["personalized"], f"client {k} personalized adapter")
        assert a["state"].keys() == b["state"].keys() and a["steps_taken"] == b["steps_taken"]
        for group in a["state"]:
            same(a["state"][group], b["state"][group], f"client {k} state {group}")
    results = [_without_seconds(json.loads((d / ckpt.RESULTS).read_text())) for d in (out, ref)]
    assert results[0] == results[1]
    rows = [[_without_seconds(json.loads(line)) for line in (d / ckpt.METRICS).read_text().splitlines()]
            for d in (out, ref)]
    assert rows[0] == rows[1]  # every round once, in order


def _start(config_file: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
           # the thread count of this process, which runs the reference and the resumed part: another
           # count changes the order of float sums, and the comparison is exact
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    # SIGINT at its default in the run (Python then raises KeyboardInterrupt): a test suite started
    # in the background by a non-interactive shell (nohup, `cmd &`) inherits SIGINT ignored, and the
    # run rightly keeps ignoring it, which the Ctrl-C test would take for a bug
    return subprocess.Popen([sys.executable, "-m", "pflalign", "run", "--config", str(config_file),
                             "--out", str(out), "--no-progress"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _in_round_3(proc: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    """Return once round 2 is checkpointed and round 3 has begun."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if json.loads((out / ckpt.MANIFEST).read_text())["checkpoints"][0]["rounds_done"] == 2:
                time.sleep(0.2)  # past the renames, well inside round 3 (about a second)
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.01)
    raise TimeoutError("round 2 was not checkpointed in time")


def _check_stopped_in_round_3(out: Path) -> None:
    assert not (out / ckpt.RESULTS).exists()
    assert ckpt.load_run_checkpoint(out)["rounds_done"] == 2


def test_sigkill_in_round_3_then_resume_equals_an_uninterrupted_run(tmp_path, config_file, uninterrupted, capsys):
    out = tmp_path / "run"
    proc = _start(config_file, out)
    _in_round_3(proc, out)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    _check_stopped_in_round_3(out)
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert_same_run(out, uninterrupted)
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_ctrl_c_in_round_3_saves_says_how_to_resume_exit_130(tmp_path, config_file, uninterrupted):
    out = tmp_path / "run"
    proc = _start(config_file, out)
    _in_round_3(proc, out)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == (f"pflalign: interrupted during round 3 of 4; the last finished round (2) "
                                            f"is saved; resume with: pflalign run --out {out} --resume")
    _check_stopped_in_round_3(out)
    # nothing half-written: no temporaries, and metrics.jsonl ends with round 2 (0-based 1)
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    rows = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
    assert max(r["round"] for r in rows) == 1 and rows[-1]["event"] == "round"
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert_same_run(out, uninterrupted)


@pytest.mark.parametrize("in_round, saved, said", [
    (2, 2, "during round 3 of 4"),  # in round 3 (0-based 2), round 2 saved
    (1, 2, "during round 3 of 4"),  # round 2's checkpoint written, round 3 not begun: not "round 2"
    (3, 4, "during the final evaluation"),  # the last round saved, the evaluation not begun
    (None, 4, "during the final evaluation"),
])
def test_ctrl_c_message_names_the_round_after_the_saved_one(in_round, saved, said):
    """An interrupt between a round's checkpoint and the next round's start (a race the Ctrl-C
    test above can hit on a busy machine) names the next round, never the saved one."""
    from types import SimpleNamespace

    from pflalign.run.lifecycle import interrupted

    rec = SimpleNamespace(saved=(saved,), rollback=lambda: None, out=Path("run"))
    message = str(interrupted(rec, SimpleNamespace(rounds=4), in_round))
    assert message.startswith(f"interrupted {said}; the last finished round ({saved}) is saved")


def test_resume_after_a_corrupt_checkpoint_uses_the_previous_one(tmp_path, config_file, uninterrupted, caplog):
    out = tmp_path / "run"
    assert run(build_config(str(config_file)), out, stop_after=3, progress=False) is None
    path = out / ckpt.CHECKPOINT
    path.write_bytes(path.read_bytes()[:-1000])  # a torn write (disk full, a copy cut short)
    with caplog.at_level(logging.WARNING):
        run(None, out, resume=True, progress=False)
    assert any("resuming from checkpoint.prev.pt (after round 2)" in r.getMessage() for r in caplog.records)
    assert_same_run(out, uninterrupted)


# ---- the final scoring, kept job by job (checkpoint/scoring.py) ------------------------------
def _trained_not_scored(ref: Path, out: Path) -> None:
    """`out`: `ref`'s run as it was when its last round was saved (its scoring not begun)."""
    shutil.copytree(ref, out)
    for name in (ckpt.RESULTS, ckpt.PREDICTIONS):
        (out / name).unlink()
    shutil.rmtree(out / "adapters")


def test_a_run_stopped_while_it_scores_resumes_with_the_jobs_it_finished(tmp_path, uninterrupted, monkeypatch, capsys):
    """Ctrl-C in the third scoring job: the two finished are kept (and said), the resume scores
    only the others, and the run is the uninterrupted one: scores, predictions, metrics, files."""
    from pflalign.run import workers

    out = tmp_path / "run"
    _trained_not_scored(uninterrupted, out)
    scored = []
    real = workers.run_job

    def counting(side, job, *args, **kwargs):
        if isinstance(job, ScoreJob):
            if stop_at and len(scored) == stop_at:
                raise KeyboardInterrupt
            scored.append((job.k, job.model))
        return real(side, job, *args, **kwargs)

    monkeypatch.setattr(workers, "run_job", counting)
    stop_at = 2
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "pflalign: interrupted during the final evaluation; the last finished round (4) is saved, as are the final "
        f"scoring's 2 finished jobs (the rest are scored on resume); resume with: pflalign run --out {out} --resume")
    assert not (out / ckpt.RESULTS).exists() and ckpt.kept_jobs(out) == 2
    first = list(scored)
    # a copy whose kept jobs say something no model generates: the resume must take them as kept
    marked = tmp_path / "marked"
    shutil.copytree(out, marked)
    lines = (marked / ckpt.SCORING).read_text().splitlines()
    rows = [json.loads(line) for line in lines[1:]]
    for row in rows:
        row.update(score=0.5, predictions=[f"kept {row['client']} {row['model']} {i}" for i in range(len(row["predictions"]))])
    (marked / ckpt.SCORING).write_text("\n".join([lines[0], *map(json.dumps, rows)]) + "\n")

    scored.clear()
    stop_at = None
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 0
    results = json.loads((out / ckpt.RESULTS).read_text())
    every = [(row["id"], model) for model in ("personalized", "global", "base") for row in results["clients"]]
    assert len(every) == 6 and sorted(first + scored) == sorted(every) and not set(first) & set(scored)
    assert_same_run(out, uninterrupted)
    assert (out / ckpt.PREDICTIONS).read_text() == (uninterrupted / ckpt.PREDICTIONS).read_text()
    assert _files(out) == _files(uninterrupted)  # the kept jobs' file is gone with results.json written

    assert main(["run", "--out", str(marked), "--resume", "--no-progress"]) == 0
    results = {row["id"]: row for row in json.loads((marked / ckpt.RESULTS).read_text())["clients"]}
    predictions = [json.loads(line) for line in (marked / ckpt.PREDICTIONS).read_text().splitlines()]
    for row in rows:  # each kept job where its client's and model's scores and predictions go
        k, model = row["client"], row["model"]
        assert results[k][f"rouge_l_{model}"] == 0.5
        assert [p[model] for p in predictions if p["client"] == k] == row["predictions"]


def test_a_resume_scoring_the_clients_in_one_loop_takes_the_kept_jobs_too(tmp_path, uninterrupted):
    """--batch clients scores the jobs left in one decoding loop: a kept job comes back as kept,
    the others as the uninterrupted run scored them."""
    from pflalign.run.engine import scoring_log

    out = tmp_path / "run"
    _trained_not_scored(uninterrupted, out)
    kept = scoring_log(out, build_config(str(out / ckpt.CONFIG)))
    kept.add(1, "global", 0.5, ["kept 0", "kept 1", "kept 2"], 1.0)
    kept.close()
    assert main(["run", "--out", str(out), "--resume", "--no-progress", "--batch", "clients"]) == 0
    mine, theirs = ([json.loads(line) for line in (d / ckpt.PREDICTIONS).read_text().splitlines()]
                    for d in (out, uninterrupted))
    assert [p["global"] for p in mine if p["client"] == 1] == ["kept 0", "kept 1", "kept 2"]
    for p, q in zip(mine, theirs, strict=True):
        assert p["personalized"] == q["personalized"] and p["base"] == q["base"]
        assert p["client"] == 1 or p["global"] == q["global"]
    assert not (out / ckpt.SCORING).exists()


def test_kept_jobs_are_scored_again_when_their_key_differs_or_their_line_was_cut(tmp_path):
    """What the jobs were scored from is the first line's key: another key (another checkpoint,
    config or code) starts afresh; a line a kill cut short is skipped, the lines after it kept."""
    log = ckpt.ScoringLog.open(tmp_path, "key-1")
    log.add(0, "global", 0.5, ["a", "b"], 1.0)
    log.add(1, "global", 0.25, ["c"], 2.0)
    log.close()
    path = tmp_path / ckpt.SCORING
    path.write_bytes(path.read_bytes()[:-9])  # the second line cut short
    again = ckpt.ScoringLog.open(tmp_path, "key-1")
    assert again.done == {(0, "global"): {"score": 0.5, "predictions": ["a", "b"], "seconds": 1.0}}
    again.add(1, "personalized", 0.75, ["d"], 3.0)  # after the cut line, on a line of its own
    again.close()
    assert set(ckpt.ScoringLog.open(tmp_path, "key-1").done) == {(0, "global"), (1, "personalized")}
    assert ckpt.kept_jobs(tmp_path) == 2
    assert ckpt.ScoringLog.open(tmp_path, "key-2").done == {} and not path.exists()
    ckpt.ScoringLog.open(tmp_path, "key-1").remove()


def test_a_fresh_run_and_its_resume_key_their_scoring_alike(tmp_path, monkeypatch):
    """The common stop: a fresh run stopped in its final scoring, then resumed from config.json.
    The resumed run's key must be the fresh run's, or the kept jobs would be scored again."""
    from pflalign.run import engine

    keys, real = [], engine.scoring_log
    monkeypatch.setattr(engine, "scoring_log", lambda out, cfg: keys.append(real(out, cfg).key) or real(out, cfg))
    out = tmp_path / "run"
    run(build_config(None, {**CRASH_CONFIG, "rounds": 2, "local_steps": 2}), out, progress=False)
    _trained_not_scored(out, tmp_path / "again")
    run(None, tmp_path / "again", resume=True, progress=False)
    assert len(keys) == 2 and keys[0] == keys[1]


def test_the_key_of_kept_jobs_follows_the_checkpoint_and_the_config(tmp_path, uninterrupted):
    from pflalign.run.engine import scoring_log

    cfg = build_config(str(uninterrupted / ckpt.CONFIG))
    key = scoring_log(uninterrupted, cfg).key
    assert scoring_log(uninterrupted, cfg).key == key
    other = build_config(None, {**CRASH_CONFIG, "eval": {**CRASH_CONFIG.get("eval", {}), "max_new_tokens": 5}})
    assert scoring_log(uninterrupted, other).key != key
    out = tmp_path / "run"
    _trained_not_scored(uninterrupted, out)
    manifest = json.loads((out / ckpt.MANIFEST).read_text())
    manifest["checkpoints"][0]["sha256"] = "0" * 64  # another checkpoint.pt
    (out / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert scoring_log(out, cfg).key != key
    (out / ckpt.MANIFEST).unlink()
    assert scoring_log(out, cfg) is None  # an older pflalign's folder: nothing is kept


# ---- checkpoints every N seconds (--checkpoint-every; CUDA's default) ------------------------
def test_checkpoints_every_n_seconds_keep_the_records_in_memory_and_train_the_same_run(tmp_path, config_file,
                                                                                      uninterrupted, monkeypatch):
    """With a checkpoint due only every hour: no client file and no checkpoint is written until the
    run's last round (the clients' records wait in memory, each client's older record dropped
    unwritten), and the run is the every-round run bit for bit, files included."""
    from pflalign.run import client_store, engine

    writes, saves = [], []
    write = client_store.ClientStore._write
    monkeypatch.setattr(client_store.ClientStore, "_write",
                        lambda self, k, name, *a: writes.append(name) or write(self, k, name, *a))
    save = engine.Recorder.save
    monkeypatch.setattr(engine.Recorder, "save", lambda self, r, payload: saves.append(r) or save(self, r, payload))
    out = tmp_path / "run"
    run(build_config(str(config_file)), out, progress=False, checkpoint_every=3600)
    rounds = CRASH_CONFIG["rounds"]
    assert saves == [rounds]
    named = sorted(r["file"] for r in ckpt.load_run_checkpoint(out)["client_records"])
    assert sorted(writes) == named and all(name.endswith(f".r{rounds}.safetensors") for name in named)
    assert_same_run(out, uninterrupted)


def test_a_session_stopped_between_checkpoints_saves_its_last_round_and_resumes_to_the_same_run(
        tmp_path, config_file, uninterrupted):
    """`--stop-after-rounds` ends a session with a checkpoint though none was due; the resumed run is
    the uninterrupted one."""
    out = tmp_path / "run"
    assert run(build_config(str(config_file)), out, progress=False, stop_after=2, checkpoint_every=3600) is None
    assert ckpt.load_run_checkpoint(out)["rounds_done"] == 2
    run(None, out, resume=True, progress=False, checkpoint_every=3600)
    assert_same_run(out, uninterrupted)


def test_ctrl_c_after_rounds_not_yet_saved_names_the_saved_round_and_the_lost_ones(tmp_path, config_file,
                                                                                 uninterrupted, monkeypatch):
    """An interrupt in round 4 when only round 1 was saved: the folder is as after round 1 (its
    metrics lines, no client file of a later round named), the message says which rounds train again,
    and the resumed run is the uninterrupted one."""
    from pflalign.errors import RunInterrupted
    from pflalign.run import engine

    train_round = engine.Federation.train_round

    def stop_in_round_4(self, r):
        if r == 3:
            raise KeyboardInterrupt
        return train_round(self, r)

    monkeypatch.setattr(engine.Federation, "checkpoint_due", lambda self, r, last: last or r == 0)
    monkeypatch.setattr(engine.Federation, "train_round", stop_in_round_4)
    out = tmp_path / "run"
    with pytest.raises(RunInterrupted) as info:
        run(build_config(str(config_file)), out, progress=False, checkpoint_every=50)
    assert str(info.value).startswith("interrupted during round 4 of 4; round 1 is the last saved (rounds 2-3 "
                                      "finished since its checkpoint, --checkpoint-every, and are trained again)")
    assert ckpt.load_run_checkpoint(out)["rounds_done"] == 1
    rows = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
    assert max(r["round"] for r in rows) == 0
    monkeypatch.undo()
    run(None, out, resume=True, progress=False)
    assert_same_run(out, uninterrupted)


def test_records_held_in_memory_come_back_as_copies_and_go_to_their_files_when_flushed(tmp_path):
    from pflalign import params as P
    from pflalign.run.client_store import ClientStore

    adapter = P.clone({"x.lora_A": torch.ones(2, 3), "x.lora_B": torch.zeros(3, 2)})
    state = {"v": P.clone(adapter)}
    size = 2 * sum(t.numel() * 4 for t in adapter.values())  # one client's state and personalized adapter
    store = ClientStore(tmp_path, ["a", "b", "c"], memory_bytes=2 * size)
    (tmp_path / "clients").mkdir()
    for k in range(3):  # the third goes over the bound: to its file at once
        store.save(k, 1, {"v": P.clone(adapter)}, P.clone(adapter))
    assert sorted(p.name for p in (tmp_path / "clients").iterdir()) == ["2.r1.safetensors"]
    with pytest.raises(RuntimeError):
        store.table()  # a checkpoint may not name files not yet written
    loaded, personalized = store.load(0, "cpu", list(adapter))
    loaded["v"]["x.lora_A"].add_(1.0)  # the round changes its copy in place ...
    again, _ = store.load(0, "cpu", list(adapter))
    assert torch.equal(again["v"]["x.lora_A"], state["v"]["x.lora_A"])  # ... not the record
    assert P.flat_buffer(again["v"]) is not None and torch.equal(personalized["x.lora_B"], adapter["x.lora_B"])
    store.save(0, 2, loaded, personalized)  # client 0's round 2 replaces its unwritten round 1
    store.flush()
    assert sorted(p.name for p in (tmp_path / "clients").iterdir()) == ["0.r2.safetensors", "1.r1.safetensors",
                                                                       "2.r1.safetensors"]
    table = store.table()
    for row in table:
        data = (tmp_path / "clients" / row["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == row["sha256"]
    fresh = ClientStore(tmp_path, ["a", "b", "c"])
    fresh.restore(table)
    state0, _ = fresh.load(0, "cpu", list(adapter))
    assert torch.equal(state0["v"]["x.lora_A"], loaded["v"]["x.lora_A"])


def test_checkpoint_interval_defaults_by_device_and_refuses_a_negative_one():
    from pflalign.run.engine import checkpoint_interval

    assert checkpoint_interval(None, "cpu") == 0.0 and checkpoint_interval(None, "cuda:1") == 60.0
    assert checkpoint_interval(5, "cpu") == 5.0
    with pytest.raises(UserError, match="--checkpoint-every must be >= 0"):
        checkpoint_interval(-1, "cpu")


def test_the_stores_of_one_process_share_one_bound_and_a_discarded_store_frees_its_part(tmp_path):
    """Runs in lockstep (one process, one store each) hold at most `memory_bytes` of records
    together; a run that stops gives its part back."""
    from pflalign import params as P
    from pflalign.run.client_store import ClientStore

    adapter = P.clone({"x.lora_A": torch.ones(2, 3), "x.lora_B": torch.zeros(3, 2)})
    size = 2 * sum(t.numel() * 4 for t in adapter.values())
    first, second = (ClientStore(tmp_path / name, ["a"], memory_bytes=size) for name in ("one", "two"))
    for store in (first, second):
        store.folder.mkdir(parents=True)
    first.save(0, 1, {"v": P.clone(adapter)}, P.clone(adapter))
    second.save(0, 1, {"v": P.clone(adapter)}, P.clone(adapter))  # over the shared bound: to its file
    assert not list(first.folder.iterdir()) and [p.name for p in second.folder.iterdir()] == ["0.r1.safetensors"]
    first.discard()
    second.save(0, 2, {"v": P.clone(adapter)}, P.clone(adapter))  # room again: held
    assert [p.name for p in second.folder.iterdir()] == ["0.r1.safetensors"]
    second.discard()
