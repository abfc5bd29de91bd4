"""Issue 20, data loss: the run folder is checked and locked before anything loads, and an
--overwrite never loses the finished run it was asked to replace unless the new run saved something."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pflalign.run import run_dir
from pflalign.cli import main
from pflalign.errors import TrainingDiverged

from test_cli import TINY_SET, _error

SRC = Path(__file__).resolve().parents[1] / "src"


def snapshot(folder: Path) -> dict:
    """Every file under `folder` (hidden ones too) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["run", *TINY_SET, "--set", "method=fedavg", "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture
def finished(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


def test_resume_with_overwrite_is_refused_and_the_run_kept(capsys, finished):
    before = snapshot(finished)
    err = _error(capsys, ["run", "--out", str(finished), "--resume", "--overwrite"])
    assert "--resume and --overwrite exclude each other" in err
    assert snapshot(finished) == before


def test_overwrite_with_a_missing_model_leaves_the_finished_run_byte_identical(capsys, finished, tmp_path):
    before = snapshot(finished)
    err = _error(capsys, ["run", *TINY_SET, "--set", f"model={tmp_path / 'no-model'}", "--out", str(finished),
                          "--overwrite"])
    assert "no-model" in err
    assert snapshot(finished) == before


def test_overwrite_with_bad_data_leaves_the_finished_run_byte_identical(capsys, finished, tmp_path):
    before = snapshot(finished)
    _error(capsys, ["run", *TINY_SET, "--set", "data.clients=sortng", "--out", str(finished), "--overwrite"])
    assert snapshot(finished) == before


def test_overwrite_failing_in_round_1_restores_the_old_run(capsys, finished, monkeypatch):
    from pflalign.run.engine import Federation

    def diverge(self, *args, **kwargs):
        raise TrainingDiverged("loss is nan")

    monkeypatch.setattr(Federation, "train", diverge)
    before = snapshot(finished)
    _error(capsys, ["run", *TINY_SET, "--set", "method=fedprox", "--out", str(finished), "--overwrite",
                    "--no-progress"])  # the rounds bar is open when train() fails
    assert snapshot(finished) == before


def test_overwrite_failing_in_round_1_restores_a_run_stopped_in_its_final_scoring(capsys, finished, monkeypatch):
    """The run replaced may hold the final scoring's kept jobs (checkpoint/scoring.py): they come back too."""
    from pflalign import checkpoint as ckpt
    from pflalign.run.engine import Federation

    for name in (ckpt.RESULTS, ckpt.PREDICTIONS):
        (finished / name).unlink()
    shutil.rmtree(finished / "adapters")
    kept = ckpt.ScoringLog.open(finished, "its key")
    kept.add(0, "global", 0.5, ["a"], 1.0)
    kept.close()

    def diverge(self, *args, **kwargs):
        raise TrainingDiverged("loss is nan")

    monkeypatch.setattr(Federation, "train", diverge)
    before = snapshot(finished)
    _error(capsys, ["run", *TINY_SET, "--set", "method=fedprox", "--out", str(finished), "--overwrite",
                    "--no-progress"])
    assert snapshot(finished) == before


def test_overwrite_replaces_the_run_once_the_new_one_finished(capsys, finished):
    assert main(["run", *TINY_SET, "--set", "method=fedprox", "--out", str(finished), "--overwrite",
                 "--no-progress"]) == 0
    assert json.loads((finished / "results.json").read_text())["method"] == "fedprox"
    assert json.loads((finished / "config.json").read_text())["method"] == "fedprox"
    assert not (finished / run_dir.ASIDE).exists() and not (finished / run_dir.LOCK).exists()


def test_an_overwrite_killed_before_the_new_run_saved_is_undone_at_the_next_start(capsys, finished):
    before = snapshot(finished)
    run_dir.Aside(finished).move()  # what a kill -9 during the new run's model load leaves
    (finished / "config.json").write_text("{}")  # the new run's first file
    err = _error(capsys, ["run", *TINY_SET, "--out", str(finished)])
    assert "finished run" in err
    assert snapshot(finished) == before


# ---- two writers --------------------------------------------------------------------------
def test_a_second_run_on_a_locked_folder_names_the_holder_and_exits_2(capsys, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    first = subprocess.Popen([sys.executable, "-m", "pflalign", "run", *TINY_SET, "--set", "rounds=100000",
                              "--out", str(out), "--no-progress"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (out / "config.json").exists():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.2)
        err = _error(capsys, ["run", *TINY_SET, "--set", "method=fedavg", "--out", str(out), "--overwrite"])
        assert f"pid {first.pid}" in err and "in use by another pflalign run" in err
        assert json.loads((out / "config.json").read_text())["method"] == "pflalign"  # the first run's
    finally:
        first.kill()
        first.wait()


def test_a_sweep_on_a_locked_folder_exits_2(capsys, tmp_path):
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('methods = ["fedavg"]\nseeds = [0]\n[[datasets]]\nname = "syn"\n')
    with run_dir.RunLock(tmp_path / "out", "sweep"):
        err = _error(capsys, ["sweep", "--config", str(sweep), *TINY_SET, "--out", str(tmp_path / "out")])
    assert f"pid {os.getpid()}" in err
    assert not (tmp_path / "out" / "syn").exists()


def test_the_lock_is_released_and_its_file_removed(tmp_path):
    with run_dir.RunLock(tmp_path / "a" / "b"):
        assert (tmp_path / "a" / "b" / run_dir.LOCK).read_text().strip() == str(os.getpid())
    assert not (tmp_path / "a" / "b" / run_dir.LOCK).exists()
    with run_dir.RunLock(tmp_path / "a" / "b"):  # and can be taken again
        pass


# ---- what --out may be ----------------------------------------------------------------------
def test_a_model_folder_as_out_is_refused_untouched(capsys, tmp_path):
    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (model / "model.safetensors").write_bytes(b"x" * 10)
    before = snapshot(model)
    err = _error(capsys, ["run", *TINY_SET, "--out", str(model)])
    assert "not a pflalign run folder" in err
    _error(capsys, ["run", *TINY_SET, "--out", str(model), "--overwrite"])
    assert snapshot(model) == before


def test_a_file_as_out_is_refused(capsys, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    assert "is a file" in _error(capsys, ["run", *TINY_SET, "--out", str(f)])
    assert "is a file" in _error(capsys, ["run", *TINY_SET, "--out", str(f / "run")])
    assert f.read_text() == "mine"


def test_a_read_only_out_is_refused_before_loading(capsys, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(run_dir.os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    import pflalign.run.engine as engine

    monkeypatch.setattr(engine, "Federation", lambda *a, **k: pytest.fail("loaded before refusing"))
    assert "is not writable" in _error(capsys, ["run", *TINY_SET, "--out", str(ro / "run")])


def test_a_resume_under_a_changed_training_recipe_is_refused_unless_allowed(capsys, tmp_path):
    """Issue 57: config.json edited under a stopped run (optimizer.name=adamw after SGD rounds)
    is refused at --resume in one line naming the keys, the folder untouched; a change outside
    the recipe (eval.*, device) resumes; --allow-recipe-change trains on and metrics.jsonl
    records which round the new values start at."""
    out = tmp_path / "run"
    base = ["run", "--out", str(out), "--no-progress"]
    assert main([*base, *TINY_SET, "--set", "method=fedavg", "--set", "rounds=3", "--stop-after-rounds", "1"]) == 0

    def edit(**changes):
        saved = json.loads((out / "config.json").read_text())
        for key, value in changes.items():
            *tables, last = key.split("__")
            node = saved
            for t in tables:
                node = node.setdefault(t, {})
            node[last] = value
        (out / "config.json").write_text(json.dumps(saved))

    edit(eval__batch_size=1, eval__max_new_tokens=3, device="auto")  # not the recipe: how it runs and scores
    assert main([*base, "--resume", "--stop-after-rounds", "1"]) == 0
    edit(optimizer__name="adamw", lr=0.001)
    before = snapshot(out)
    err = _error(capsys, [*base, "--resume"])
    assert "is not the recipe the checkpoint's 2 rounds were trained with (lr 0.04 -> 0.001, optimizer.name " \
           "'sgd' -> 'adamw')" in err and "--allow-recipe-change" in err, err
    assert snapshot(out) == before
    assert "goes with --resume" in _error(capsys, [*base, *TINY_SET, "--allow-recipe-change"])
    assert main([*base, "--resume", "--allow-recipe-change"]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    change = [r for r in lines if r["event"] == "recipe_change"]
    assert change == [{"event": "recipe_change", "round": 2,
                       "changed": {"lr": [0.04, 0.001], "optimizer.name": ["sgd", "adamw"]}}]
    assert [r["round"] for r in lines if r["event"] == "round"] == [0, 1, 2]
    assert lines.index(change[0]) == max(i for i, r in enumerate(lines) if r.get("round") == 1) + 1
