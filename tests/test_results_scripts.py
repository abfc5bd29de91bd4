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


# the real sweep's plan of a run, from the folders: finished here or in a --done folder, unfinished
# (a folder without results.json) here, else new; a run it is asked for is written down and finished
LANE_STAND_IN = f"""#!{sys.executable}
import json, os, pathlib, sys, time
args = sys.argv[2:]
value = lambda name: args[args.index(name) + 1]
rows = {{"table1": ["pflalign", "fedavg", "fedsa-lora", "fedsam"],
        "step-size": ["pflalign@lr=0.33", "fedavg@lr=0.16"]}}[pathlib.Path(value("--config")).stem]
out, dones = pathlib.Path(value("--out")), [pathlib.Path(args[i + 1]) for i, a in enumerate(args) if a == "--done"]
for row in rows:
    key = f"dolly/{{row}}/seed{{value('--seeds')}}"
    if any((d / key / "results.json").exists() for d in [out] + dones):
        state = "finished"
    else:
        state = "unfinished" if (out / key).is_dir() else "new"
    if "--dry-run" in args:
        print(key, state, out / key)
    elif row.split("@")[0] == value("--methods") and state != "finished":
        with open(pathlib.Path(__file__).with_name("runs.jsonl"), "a") as f:
            f.write(json.dumps([key, str(out), os.environ.get("OMP_NUM_THREADS"), args]) + "\\n")
        (out / key).mkdir(parents=True, exist_ok=True)
        time.sleep(0.05)
        (out / key / "results.json").write_text("{{}}")
"""


def _run_grid(tmp_path, **env) -> list:
    """run-grid.sh through the stand-in sweep with `env` set: the runs it started, in order."""
    pfl = tmp_path / "pflalign"
    pfl.write_text(LANE_STAND_IN)
    pfl.chmod(0o755)
    done = subprocess.run(["bash", str(RESULTS / "table1-dolly" / "run-grid.sh")], capture_output=True, text=True,
                          env=dict(os.environ, PFL=str(pfl), DATA=str(tmp_path), **env), timeout=120)
    assert done.returncode == 0 and "grid done" in done.stdout, done.stdout + done.stderr
    return [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]


def test_grid_lanes_take_every_run_left_once_each_lane_its_own_unfinished_one(tmp_path):
    """run-grid.sh with LANES=2: two lanes side by side take the runs not finished (committed or
    by another lane), in the grid's order, each exactly once, one run a sweep in one thread
    (--workers 1, OMP_NUM_THREADS=1); an unfinished run is resumed by the lane whose folder holds it."""
    conf, runs = tmp_path / "conf", tmp_path / "runs"
    (conf / "runs" / "dolly" / "pflalign" / "seed0").mkdir(parents=True)  # committed
    (conf / "runs" / "dolly" / "pflalign" / "seed0" / "results.json").write_text("{}")
    for f in ["table1.toml", "step-size.toml"]:
        (conf / f).write_text("")
    (runs / "lane1" / "dolly" / "fedsam" / "seed0").mkdir(parents=True)  # lane 1 stopped in it
    started = _run_grid(tmp_path, LANES="2", SEEDS="0 1", CONF=str(conf), RUNS=str(runs))
    keys = [key for key, *_ in started]
    wanted = ([f"dolly/{m}/seed0" for m in ["fedavg", "fedsa-lora", "fedsam", "pflalign@lr=0.33", "fedavg@lr=0.16"]]
              + [f"dolly/{m}/seed1" for m in ["pflalign", "fedavg", "fedsa-lora", "fedsam", "pflalign@lr=0.33",
                                             "fedavg@lr=0.16"]])
    assert sorted(keys) == sorted(wanted)  # each once, the committed one never
    assert dict((key, out) for key, out, *_ in started)["dolly/fedsam/seed0"] == str(runs / "lane1")
    assert {out for _, out, *_ in started} == {str(runs), str(runs / "lane1")}  # both lanes worked
    for key, out, threads, args in started:
        assert threads == "1" and args[args.index("--workers") + 1] == "1"
        assert args.count("--done") == 2 and str(conf / "runs") in args  # the committed runs and the other lane's
    for lane in [runs, runs / "lane1"]:  # each lane in the grid's order
        mine = [key for key, out, *_ in started if out == str(lane)]
        assert mine == [key for key in wanted if key in mine]


def test_one_lane_runs_the_named_rows_in_the_named_order_files_first_as_told(tmp_path):
    """run-grid.sh with LANES=1, METHODS and FILES: per seed, the files in FILES' order and within
    each the rows of METHODS in METHODS' order, one sweep each with both workers; a finished
    (committed) run and a row not named are never started."""
    conf, runs = tmp_path / "conf", tmp_path / "runs"
    (conf / "runs" / "dolly" / "fedavg" / "seed0").mkdir(parents=True)  # committed
    (conf / "runs" / "dolly" / "fedavg" / "seed0" / "results.json").write_text("{}")
    for f in ["table1.toml", "step-size.toml"]:
        (conf / f).write_text('"pflalign" "fedavg" "fedsam"' if f == "table1.toml" else '"pflalign" "fedavg"')
    started = _run_grid(tmp_path, LANES="1", SEEDS="0 1", METHODS="fedsam fedavg pflalign", FILES="step-size table1",
                        CONF=str(conf), RUNS=str(runs))
    assert [key for key, *_ in started] == [
        "dolly/fedavg@lr=0.16/seed0", "dolly/pflalign@lr=0.33/seed0", "dolly/fedsam/seed0", "dolly/pflalign/seed0",
        "dolly/fedavg@lr=0.16/seed1", "dolly/pflalign@lr=0.33/seed1",
        "dolly/fedsam/seed1", "dolly/fedavg/seed1", "dolly/pflalign/seed1"]
    for _, out, _, args in started:
        assert out == str(runs) and args[args.index("--workers") + 1] == "2"


PAPER_CSV = """model,method,dolly_c1,dolly_c2,dolly_avg,dolly_ci95,flan_c1,flan_avg
M,FedAvg,10,20,15,1,0,0
M,pFLAlign,30,10,20,2,0,0
M,FedSAM,20,30,25,3,0,0
"""
OURS_CSV = """method,family,x,y,avg,avg_ci95,n_seeds
fedavg,F,5,6,5.5,,1
pflalign,F,4,5,6.5,0.5,3
fedsam,F,3,7,5,,1
local,F,1,1,1,,1
"""


def _beside(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RESULTS / "beside-paper.py"), *args], capture_output=True, text=True)


def test_beside_paper_sets_the_papers_table_beside_ours_with_ranks_from_both(tmp_path):
    """beside-paper.py (collect.sh writes beside-paper.md with it): cells "paper / ours", pFLAlign's
    rank in each column and Spearman's ρ over the methods both have, checked by hand: on c1 the paper
    orders FedAvg, pFLAlign, FedSAM 3rd, 1st, 2nd and we 1st, 2nd, 3rd (Σd² = 6, ρ = 1 − 36/24);
    on c2 both 2nd, 3rd, 1st (ρ = 1)."""
    (tmp_path / "paper.csv").write_text(PAPER_CSV)
    (tmp_path / "ours.csv").write_text(OURS_CSV)
    done = _beside(str(tmp_path / "paper.csv"), str(tmp_path / "ours.csv"), "dolly")
    assert done.returncode == 0, done.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert rows["pFLAlign"] == "| pFLAlign | 30.00 / 4.00 | 10.00 / 5.00 | 20.00 ± 2.00 / 6.50 ± 0.50 |"
    assert rows["FedAvg"].endswith("| 15.00 ± 1.00 / 5.50 (1 seed) |")
    assert rows["Local"] == "| Local | – / 1.00 | – / 1.00 | – / 1.00 (1 seed) |"  # ours only
    assert rows["pFLAlign's rank, paper"] == "| pFLAlign's rank, paper | 1 of 3 | 3 of 3 | 2 of 3 |"
    assert rows["pFLAlign's rank, ours"] == "| pFLAlign's rank, ours | 2 of 3 | 3 of 3 | 1 of 3 |"
    assert rows["Spearman ρ, paper vs ours"] == "| Spearman ρ, paper vs ours | -0.50 | +1.00 | -0.50 |"
    assert "(the paper's c1–c4 are x, y)" in done.stdout


def test_beside_paper_ranks_share_ties_and_refuse_bad_input_in_one_line(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("beside_paper", RESULTS / "beside-paper.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.ranks({"a": 1.0, "b": 1.0, "c": 0.0}) == {"a": 1.5, "b": 1.5, "c": 3.0}
    assert module.spearman({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}) is None  # under 3 methods
    done = _beside(str(tmp_path / "none.csv"), str(tmp_path / "ours.csv"), "dolly")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "none.csv" in done.stderr
