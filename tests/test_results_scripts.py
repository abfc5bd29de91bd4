"""The shell scripts under docs/results that carry runs between machines: keep-run.sh (a finished
run's small files, as committed and as a GPU call sends them back) and table1-dolly/gpu-runs.sh's
choice of the runs one GPU call starts (with a stand-in for Python, so no model runs)."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _finished_run(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"method": "fedavg"}\n')
    (path / "metrics.jsonl").write_text('{"event": "round", "round": 0}\n' * 3)
    (path / "predictions.jsonl").write_text('{"client": 0, "prediction": "a"}\n')
    (path / "results.json").write_text('{"avg_rouge_l_personalized": 1.0}\n')
    (path / "checkpoint.pt").write_bytes(b"not kept")


def _keep(src: Path, dst: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RESULTS / "keep-run.sh"), str(src), str(dst)], capture_output=True, text=True)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_keep_run_keeps_the_small_files_and_takes_a_kept_copy_as_it_is(tmp_path):
    """collect.sh keeps a GPU call's runs (already kept there) with keep-run.sh again: the same files."""
    _finished_run(tmp_path / "run")
    assert _keep(tmp_path / "run", tmp_path / "kept").returncode == 0
    kept = _files(tmp_path / "kept")
    assert sorted(kept) == ["config.json", "metrics.jsonl.gz", "predictions.jsonl.gz", "results.json"]
    assert gzip.decompress(kept["metrics.jsonl.gz"]) == (tmp_path / "run" / "metrics.jsonl").read_bytes()
    assert _keep(tmp_path / "kept", tmp_path / "again").returncode == 0
    assert _files(tmp_path / "again") == kept


def test_keep_run_refuses_an_unfinished_run_in_one_line(tmp_path):
    _finished_run(tmp_path / "run")
    (tmp_path / "run" / "results.json").unlink()
    done = _keep(tmp_path / "run", tmp_path / "kept")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no finished run" in done.stderr
    assert not (tmp_path / "kept").exists()


# what `pflalign sweep --dry-run` says per (sweep file, seed): one line per run, its key and state
PLANS = {
    "table1 0": ["dolly/pflalign/seed0 finished /x (skipped, avg ROUGE-L 30.00)", "dolly/fedavg/seed0 new /x (runs)",
                 "dolly/fedsa-lora/seed0 new /x (runs)", "dolly/fedsam/seed0 new /x (runs)"],
    "step-size 0": ["dolly/pflalign@lr=0.33/seed0 new /x (runs)", "dolly/fedavg@lr=0.16/seed0 new /x (runs)"],
    "step-size 1": ["dolly/pflalign@lr=0.33/seed1 unfinished /x (resumed from its checkpoint)",
                    "dolly/fedavg@lr=0.16/seed1 new /x (runs)"],
}
STAND_IN = f"""#!{sys.executable}
# Python's stand-in: a sweep's plan from PLANS, and every sweep it is asked to run written down
import json, pathlib, sys
args = sys.argv[1:]
if args[:3] == ["-m", "pflalign", "sweep"]:
    config, seed = pathlib.Path(args[args.index("--config") + 1]).stem, args[args.index("--seeds") + 1]
    if "--dry-run" in args:
        print("\\n".join({PLANS!r}.get(f"{{config}} {{seed}}", [])))
    else:
        with open(pathlib.Path(__file__).with_name("sweeps.jsonl"), "a") as f:
            f.write(json.dumps([config, seed, args[args.index("--methods") + 1], args]) + "\\n")
"""


def test_a_gpu_call_starts_the_resumable_runs_then_the_grids_order_in_one_sweep_per_file_and_seed(tmp_path):
    """gpu-runs.sh run: RUNS_PER_CALL runs of those left, one stopped in an earlier call on the machine
    first, then the grid's order (Table 1's rows, then the step-size rows, seed by seed), without the
    finished ones and those SKIP names; the runs of one sweep file and seed in one `--batch runs` sweep."""
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    stage = tmp_path / "stage"
    (stage / "cache" / "models").mkdir(parents=True)
    (stage / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
    env = dict(os.environ, PY=str(python), RUNS_PER_CALL="3", SKIP="fedavg/seed0", DEADLINE_S="60")
    done = subprocess.run(["bash", str(RESULTS / "table1-dolly" / "gpu-runs.sh"), "run", str(stage), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    sweeps = [json.loads(line) for line in (tmp_path / "sweeps.jsonl").read_text().splitlines()]
    assert sorted((config, seed, methods) for config, seed, methods, _ in sweeps) == [
        ("step-size", "1", "pflalign"), ("table1", "0", "fedsa-lora,fedsam")]
    for config, seed, _, args in sweeps:
        assert args[args.index("--out") + 1] == str(stage / "runs" / f"{config}-seed{seed}")  # where a later call resumes
        assert {"--batch", "runs", "device=cuda"} <= set(args)
    assert (tmp_path / "out" / "logs.tar.gz").exists() and not (tmp_path / "out" / "runs.tar.gz").exists()
