"""`pflalign sweep`: the grid, skipping finished runs, resuming an unfinished one, bad configs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pflalign import checkpoint as ckpt
from pflalign.cli import main
from pflalign.run.engine import run
from pflalign.errors import UserError
from pflalign.settings import to_dict
from pflalign.sweep import dry_run, plan_sweep, run_sweep

SWEEP = """
methods = ["fedavg", "pflalign"]
seeds = [0, 1]

[base]
model = "tiny-llama"
lora = { r = 2, alpha = 4 }
rounds = 2
local_steps = 2
batch_size = 2
max_seq_len = 64
eval = { max_new_tokens = 2, batch_size = 4, base_model = false }

[method_args.pflalign]
beta = 0.8

[[datasets]]
name = "synth"
set = { data = { clients = ["arithmetic", "sorting"], max_train = 4, max_test = 2 } }
"""


@pytest.fixture
def sweep_file(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP)
    return path


def test_plan_builds_every_run_config(sweep_file, tmp_path):
    runs = plan_sweep(str(sweep_file), tmp_path / "out", {"data": {"max_test": 1}})
    assert [r.key for r in runs] == ["synth/fedavg/seed0", "synth/fedavg/seed1",
                                     "synth/pflalign/seed0", "synth/pflalign/seed1"]
    assert runs[3].out == tmp_path / "out" / "synth" / "pflalign" / "seed1"
    assert runs[3].cfg.seed == 1 and runs[3].cfg.method_args == {"beta": 0.8}
    assert runs[0].cfg.method_args == {}  # per-method arguments stay with their method
    assert all(r.cfg.data.max_test == 1 and r.cfg.rounds == 2 for r in runs)  # --set reaches every run


def test_sweep_skips_finished_and_resumes_unfinished(sweep_file, tmp_path, capsys):
    out = tmp_path / "out"
    runs = plan_sweep(str(sweep_file), out)
    finished, unfinished = runs[0], runs[1]
    run(finished.cfg, finished.out, progress=False)
    before = (finished.out / ckpt.RESULTS).stat().st_mtime_ns, (finished.out / ckpt.METRICS).read_bytes()
    assert run(unfinished.cfg, unfinished.out, stop_after=1, progress=False) is None
    reference = run(unfinished.cfg, tmp_path / "reference", progress=False)  # the same run, uninterrupted
    assert [r.state() for r in runs] == ["finished", "unfinished", "new", "new"]
    lines, _ = dry_run(runs)  # how far the unfinished run is: its checkpoint's manifest
    assert lines[1].endswith("(resumed from its checkpoint after round 1 of 2)") and lines[2].endswith("(runs)")
    kept = ckpt.ScoringLog.open(unfinished.out, "another key")  # as a run stopped in its final scoring leaves it
    kept.add(0, "global", 0.5, ["a"], 1.0)
    kept.close()
    assert dry_run(runs)[0][1].endswith("(resumed from its checkpoint after round 1 of 2, 1 scoring job kept)")

    results = run_sweep(runs, progress=False)
    lines = capsys.readouterr().out
    assert "[1/4] synth/fedavg/seed0: finished earlier" in lines
    assert "[2/4] synth/fedavg/seed1: resumed and finished" in lines
    assert [r.state() for r in runs] == ["finished"] * 4
    assert before == ((finished.out / ckpt.RESULTS).stat().st_mtime_ns, (finished.out / ckpt.METRICS).read_bytes())
    resumed = json.loads((unfinished.out / ckpt.RESULTS).read_text())
    assert resumed["clients"] == reference["clients"] == results[1]["clients"]
    steps = lambda d: [l for l in (d / ckpt.METRICS).read_text().splitlines() if '"train_step"' in l]  # noqa: E731
    assert [json.loads(l)["loss"] for l in steps(unfinished.out)] == \
        [json.loads(l)["loss"] for l in steps(tmp_path / "reference")]
    assert json.loads((runs[3].out / ckpt.CONFIG).read_text())["method_args"] == {"beta": 0.8}

    # a second pass runs nothing; another config on the same folder is refused before any work
    assert main(["sweep", "--config", str(sweep_file), "--out", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.count("finished earlier") == 4
    assert main(["sweep", "--config", str(sweep_file), "--out", str(out), "--set", "rounds=3"]) == 2
    assert "different config (rounds: 2 there, 3 now)" in capsys.readouterr().err


def test_grid_makes_one_run_per_combination(sweep_file, tmp_path):
    text = sweep_file.read_text() + "\n[grid.pflalign]\nbeta = [0.5, 0.9]\ngamma = ['erf', 'hard']\n"
    sweep_file.write_text(text.replace("[method_args.pflalign]\nbeta = 0.8\n", "[method_args.pflalign]\neps = 1e-8\n"))
    runs = plan_sweep(str(sweep_file), tmp_path / "out", seeds=[0])
    assert [r.key for r in runs] == ["synth/fedavg/seed0", "synth/pflalign@beta=0.5,gamma=erf/seed0",
                                     "synth/pflalign@beta=0.5,gamma=hard/seed0",
                                     "synth/pflalign@beta=0.9,gamma=erf/seed0",
                                     "synth/pflalign@beta=0.9,gamma=hard/seed0"]
    assert runs[2].cfg.method == "pflalign" and runs[2].cfg.method_args == {"eps": 1e-8, "beta": 0.5, "gamma": "hard"}
    assert runs[2].out == tmp_path / "out" / "synth" / "pflalign@beta=0.5,gamma=hard" / "seed0"
    bad = sweep_file.read_text() + "\n[grid.fedprox]\nmu = [0.1]\n"
    sweep_file.write_text(bad)
    with pytest.raises(UserError, match="grid.fedprox names a method that is not in 'methods'"):
        plan_sweep(str(sweep_file), tmp_path / "out")
    sweep_file.write_text(text.replace("beta = [0.5, 0.9]", "beta = 0.5"))
    with pytest.raises(UserError, match="grid.pflalign.beta must be a non-empty list"):
        plan_sweep(str(sweep_file), tmp_path / "out")


def test_grid_takes_run_config_keys_such_as_the_learning_rate(sweep_file, tmp_path):
    """A grid key that is not one of the method's arguments is a run-config key: a learning-rate
    grid, each point its own folder and row; the method's arguments still go to method_args."""
    sweep_file.write_text(sweep_file.read_text()
                          + "\n[grid.fedavg]\nlr = [0.01, 0.16]\n[grid.pflalign]\nbeta = [0.5]\n'eval.every' = [1]\n")
    runs = plan_sweep(str(sweep_file), tmp_path / "out", seeds=[0])
    assert [r.key for r in runs] == ["synth/fedavg@lr=0.01/seed0", "synth/fedavg@lr=0.16/seed0",
                                     "synth/pflalign@beta=0.5,eval.every=1/seed0"]
    # pFLAlign sets no lr: a sweep's new run takes the library's 0.16 (issue 56; its β is the grid's)
    assert [r.cfg.lr for r in runs] == [0.01, 0.16, 0.16] and runs[0].cfg.method_args == {}
    assert runs[2].cfg.eval.every == 1 and runs[2].cfg.method_args == {"beta": 0.5}
    for bad, why in (("lr_max = [1.0]", "grid.fedavg.lr_max is neither an argument of fedavg"),
                     ("seed = [1]", "grid.fedavg.seed is neither"), ("'data.dir' = ['x']", "grid.fedavg.data.dir")):
        sweep_file.write_text(SWEEP + f"\n[grid.fedavg]\n{bad}\n")
        with pytest.raises(UserError, match=why):
            plan_sweep(str(sweep_file), tmp_path / "out")


def test_finished_runs_kept_elsewhere_count_as_finished(sweep_file, tmp_path, capsys):
    """--done: the small files of a finished run, copied elsewhere (as committed results are),
    make the sweep skip that run; a copy made with other settings is refused."""
    made = plan_sweep(str(sweep_file), tmp_path / "first")[0]
    run(made.cfg, made.out, progress=False)
    kept = tmp_path / "kept" / "synth" / "fedavg" / "seed0"
    kept.mkdir(parents=True)
    for name in (ckpt.CONFIG, ckpt.RESULTS, ckpt.METRICS):  # no checkpoint
        shutil.copy(made.out / name, kept / name)
    saved = json.loads((kept / ckpt.CONFIG).read_text())
    saved["data"]["dir"] = "/elsewhere/on/another/machine"  # the data path may differ there
    saved["device"] = "cuda"  # and so may the device it ran on
    saved["eval"]["batch_size"] = "auto"  # with that device's decoding rows (change no prediction)
    (kept / ckpt.CONFIG).write_text(json.dumps(saved))
    runs = plan_sweep(str(sweep_file), tmp_path / "second", done=[tmp_path / "kept"])
    assert [r.state() for r in runs] == ["finished", "new", "new", "new"]
    assert main(["sweep", "--config", str(sweep_file), "--out", str(tmp_path / "second"), "--done",
                 str(tmp_path / "kept"), "--dry-run"]) == 0
    assert "synth/fedavg/seed0" in capsys.readouterr().out.splitlines()[0].split()[0]
    assert not (tmp_path / "second" / "synth" / "fedavg" / "seed0").exists()
    assert main(["sweep", "--config", str(sweep_file), "--out", str(tmp_path / "second"), "--done",
                 str(tmp_path / "kept"), "--set", "rounds=3", "--dry-run"]) == 2
    assert "kept/synth/fedavg/seed0 was made with a different config (rounds: 2 there, 3 now)" in capsys.readouterr().err
    assert main(["sweep", "--config", str(sweep_file), "--out", str(tmp_path / "x"), "--done",
                 str(tmp_path / "nowhere")]) == 2


def test_dry_run_lists_runs_and_states(sweep_file, tmp_path, capsys):
    assert main(["sweep", "--config", str(sweep_file), "--out", str(tmp_path / "o"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(" new " in l for l in lines)
    assert main(["sweep", "--config", str(sweep_file), "--out", str(tmp_path / "o"), "--dry-run", "--seeds", "7"]) == 0
    assert [l.split()[0] for l in capsys.readouterr().out.splitlines()] == ["synth/fedavg/seed7", "synth/pflalign/seed7"]
    assert not (tmp_path / "o").exists()


def test_methods_keeps_part_of_a_preset_with_the_same_configs(tmp_path, capsys):
    flan = tmp_path / "flan"
    flan.mkdir()
    whole = plan_sweep("table1-flan", tmp_path / "out", data_dir=str(flan))
    part = plan_sweep("table1-flan", tmp_path / "out", data_dir=str(flan), methods=["pflalign", "local", "fedprox"])
    assert [(r.method, r.seed) for r in part] == [(m, s) for m in ("fedprox", "local", "pflalign") for s in (0, 1, 2)]
    same = {(r.method, r.seed): r.cfg for r in whole}
    assert all(r.cfg == same[(r.method, r.seed)] for r in part)  # pFLAlign's beta and FedProx's mu kept
    assert part[0].cfg.method_args == {"mu": 1.0} and part[-1].cfg.method_args["beta"] == 0.8
    assert main(["sweep", "--config", "table1-flan", "--data-dir", str(flan), "--out", str(tmp_path / "o"),
                 "--dry-run", "--methods", "local", "--seeds", "1"]) == 0
    assert [l.split()[0] for l in capsys.readouterr().out.splitlines()] == ["flan/local/seed1"]
    assert main(["sweep", "--config", "table1-flan", "--data-dir", str(flan), "--out", str(tmp_path / "o"),
                 "--dry-run", "--methods", "local,fedgloss"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--methods fedgloss: choose among this sweep's methods: ffa-lora, " in err[0]


def test_the_committed_table1_runs_are_finished_runs_of_the_preset(tmp_path):
    # a preset value changed without moving the runs made with the old one would stop every resume
    committed = Path(__file__).resolve().parents[1] / "docs" / "results" / "table1-flan" / "runs"
    found = {p.parent.relative_to(committed).as_posix() for p in committed.rglob(ckpt.RESULTS)}
    (tmp_path / "flan").mkdir()
    runs = plan_sweep("table1-flan", tmp_path / "out", data_dir=str(tmp_path / "flan"), done=[committed])
    assert found and {r.key for r in runs if r.state() == "finished"} == found


def test_table1_presets_hold_the_paper_grid(tmp_path):
    flan = tmp_path / "flan"
    flan.mkdir()
    runs = plan_sweep("table1-flan", tmp_path / "out", data_dir=str(flan))
    # the paper's LLaMA rows plus local: 11 methods x 3 seeds = 33 runs
    expected = ["ffa-lora", "fedsa-lora", "fedsvd", "fedavg", "fedprox", "fedsam", "scaffold", "feddyn", "fedyogi",
                "local", "pflalign"]
    assert [r.method for r in runs[::3]] == expected and len(runs) == 33
    assert {r.seed for r in runs} == {0, 1, 2}
    cfg = runs[0].cfg
    assert (cfg.data.name, cfg.data.dir, cfg.rounds, cfg.local_steps, cfg.batch_size, cfg.lr, cfg.lora.r) == (
        "flan", str(flan.resolve()), 50, 5, 4, 0.04, 16)
    assert {r.cfg.data.name for r in plan_sweep("table1-dolly", tmp_path / "out", data_dir="x.jsonl")} == {"dolly"}


@pytest.mark.parametrize("text,extra,needle", [
    ("seeds = [0]\n[[datasets]]\nname = 'a'", [], "'methods' must be a non-empty list"),
    ("methods = ['fedavgg']\nseeds = [0]\n[[datasets]]\nname = 'a'", [], "did you mean 'fedavg'"),
    ("methods = ['fedavg']\nseeds = ['x']\n[[datasets]]\nname = 'a'", [], "expected int values"),
    ("methods = ['fedavg']\nseeds = [0]", [], "'datasets' must be a non-empty list"),
    ("methods = ['fedavg']\nseeds = [0]\nseed = 1\n[[datasets]]\nname = 'a'", [], "unknown key 'seed'"),
    ("methods = ['fedavg']\nseeds = [0]\n[[datasets]]\nname = 'a'\ndir = 'x'", [], "unknown key 'dir'"),
    ("methods = ['fedavg']\nseeds = [0]\n[base]\nrounds = 0\n[[datasets]]\nname = 'a'", [], "rounds must be > 0"),
    ("methods = ['fedavg']\nseeds = [0]\n[[datasets]]\nname = 'a'", ["--set", "lora.rank=2"], "valid keys: r"),
    ("methods = ['fedavg']\nseeds = [0]\n[[datasets]]\nname = 'a'", ["--set", "method=fedavg"], "does not apply"),
    ("methods = ['fedavg']\nseeds = [0]\n[[datasets]]\nname = 'a'\nconfig = 'flan-paper'", [], "needs its data"),
    ("methods = ['fedavg']\nseeds = [0]\n[method_args.fedprox]\nmu = 1\n[[datasets]]\nname = 'a'", [],
     "not in 'methods'"),
    ("methods = [", [], "cannot parse"),
    ("methods = ['fedavg']\nseeds = [0]\n[[datasets]]\nname = 'a'", ["--seeds", "0,x"], "--seeds expects"),
])
def test_bad_sweep_config_is_one_line_exit_2(tmp_path, capsys, text, extra, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["sweep", "--config", str(path), "--out", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pflalign: error:") and needle in err, err
    assert not (tmp_path / "out").exists()


def test_preset_without_data_dir_is_refused(tmp_path, capsys):
    assert main(["sweep", "--config", "table1-flan", "--out", str(tmp_path / "out")]) == 2
    assert "--data-dir" in capsys.readouterr().err


def test_a_run_that_blows_up_stops_alone_and_the_sweep_goes_on(sweep_file, tmp_path, capsys):
    """A first dataset at lr 1e30 reaches a non-finite loss in round 1: its two runs stop, the
    second dataset's two still run to the end, and the sweep ends with one line naming the
    stopped ones (exit 2)."""
    bad = '[[datasets]]\nname = "blowup"\nset = { lr = 1e30, data = { clients = ["arithmetic", "sorting"], max_train = 4, max_test = 2 } }\n\n'
    sweep_file.write_text(sweep_file.read_text().replace("[[datasets]]", bad + "[[datasets]]", 1))
    out = tmp_path / "out"
    assert main(["sweep", "--config", str(sweep_file), "--out", str(out), "--no-progress", "--seeds", "0"]) == 2
    captured = capsys.readouterr()
    runs = plan_sweep(str(sweep_file), out, seeds=[0])
    assert [r.key for r in runs] == ["blowup/fedavg/seed0", "blowup/pflalign/seed0", "synth/fedavg/seed0",
                                     "synth/pflalign/seed0"]
    assert "[1/4] blowup/fedavg/seed0: stopped after" in captured.out and "non-finite" in captured.out
    assert "[4/4] synth/pflalign/seed0: finished in" in captured.out
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("pflalign: error: 2 of 4 runs finished; 2 stopped on a non-finite value")
    assert "blowup/fedavg/seed0 (" in err and "blowup/pflalign/seed0 (" in err
    assert [r.state() for r in runs][2:] == ["finished", "finished"]
    assert not any((r.out / ckpt.RESULTS).exists() for r in runs[:2])


def test_issue_38s_grid_files_plan_and_the_committed_runs_are_theirs(tmp_path):
    """docs/results/pflalign-analysis: every phase file plans (a typo there would stop the
    background grid hours in), and every committed run is a finished run of one of them, or
    the `pflalign rescore` of one (its "personalized=after_aggregation" sibling)."""
    here = Path(__file__).resolve().parents[1] / "docs" / "results" / "pflalign-analysis"
    (tmp_path / "flan").mkdir()
    (tmp_path / "mine.csv").write_text("instruction,context,response,category\n")  # short-runs: a CSV of one's own
    finished = set()
    for phase, done, data in (("validation", "validation/runs", "flan"), ("matched", "runs", "flan"),
                              ("components", "runs", "flan"), ("validated", "runs", "flan"),
                              ("validated-next", "runs", "flan"),
                              ("curves", "curves/runs", "flan"), ("remake", "remake/runs", "flan"),
                              ("curves-full", "curves-full/runs", "flan"),
                              ("short-runs", "short-runs/runs", "files")):
        if not (here / f"{phase}.toml").exists():  # written once the runs before it have decided its values
            continue
        runs = plan_sweep(str(here / f"{phase}.toml"), tmp_path / phase,
                          data_dir=str(tmp_path / ("flan" if data == "flan" else "mine.csv")),
                          done=[here / done] if (here / done).is_dir() else [])
        assert runs and all(r.cfg.data.name == data for r in runs)
        finished |= {f"{done}/{r.key}" for r in runs if r.state() == "finished"}
    validation = plan_sweep(str(here / "validation.toml"), tmp_path / "v", data_dir=str(tmp_path / "flan"))
    assert len(validation) == 35 and {r.cfg.rounds for r in validation} == {10}
    assert {r.cfg.lr for r in validation} == {0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32}
    committed = {p.parent.relative_to(here).as_posix() for p in here.rglob(ckpt.RESULTS)}
    rescored = {c for c in committed if "personalized=after_aggregation" in c}
    assert committed - rescored <= finished, sorted(committed - rescored - finished)



def validated_plan(here: Path) -> tuple[dict, set]:
    """Issue 38's 4b: each method's validated lr, computed from the committed validation runs by
    the report's rule (`Sweep.best`), and the (method, lr, beta) full runs the rule then asks for:
    3 seeds of each method whose validated lr is not Table 1's 0.04, and pFLAlign at beta 0.5 at its own."""
    from pflalign.analysis.report import find_runs, summarize, sweeps

    runs, _ = find_runs(here / "validation" / "runs")
    _, rows = summarize([r for r in runs if "personalized=" not in r.method])
    best = {s.name: s.best() for s in sweeps(rows) if s.setting == "lr" and len(s.points) == 7}
    wanted = {(m, lr, None) for m, lr in best.items() if lr != 0.04 and m != "pflalign"}
    if "pflalign" in best:
        wanted |= {("pflalign", best["pflalign"], 0.5)} | ({("pflalign", best["pflalign"], 0.8)}
                                                          if best["pflalign"] != 0.04 else set())
    return best, wanted


def test_issue_38s_validated_runs_follow_the_validation_grid(tmp_path):
    """validated.toml, once written, holds exactly the full runs the fixed rule derives from the
    committed validation runs: nothing tuned by hand after the fact."""
    here = Path(__file__).resolve().parents[1] / "docs" / "results" / "pflalign-analysis"
    if not (here / "validated.toml").exists():
        pytest.skip("validated.toml is written once 4b's validation grid is in")
    best, wanted = validated_plan(here)
    assert set(best) == {"pflalign", "fedavg", "fedsa-lora", "feddyn", "local"}, "validation grid incomplete"
    runs = plan_sweep(str(here / "validated.toml"), tmp_path, data_dir=str(tmp_path))
    got = {(r.cfg.method, r.cfg.lr, r.cfg.method_args.get("beta") if r.cfg.method == "pflalign" else None)
           for r in runs}
    assert got == wanted and {r.cfg.seed for r in runs} == {0, 1, 2} and {r.cfg.rounds for r in runs} == {50}


@pytest.mark.parametrize("diverged, unreadable", [([], False), (["fedavg"], False), (["fedavg", "local"], False),
                                                   ([], True)])
def test_issue_38s_grid_holds_back_seeds_1_2_of_a_method_whose_seed_0_diverged(tmp_path, diverged, unreadable):
    """run-grid.sh's validated phase (the real script and validated.toml, a stand-in pflalign that
    logs its calls): every method's seed 0 first, then seeds 1-2 only of the methods whose seed 0
    did not diverge (README's rule: a validated lr is kept only if its seed 0 holds); none at all
    when a seed-0 run cannot be read (it is not taken for one that held)."""
    here = Path(__file__).resolve().parents[1] / "docs" / "results" / "pflalign-analysis"
    if not (here / "validated.toml").exists():
        pytest.skip("validated.toml is written once 4b's validation grid is in")
    conf, runs, calls = tmp_path / "conf", tmp_path / "runs", tmp_path / "calls.txt"
    conf.mkdir()
    shutil.copy(here / "validated.toml", conf)
    planned = plan_sweep(str(conf / "validated.toml"), runs, data_dir=str(tmp_path), seeds=[0])
    for r in planned:  # seed 0 of each method finished, its loss 2 -> 1, or 2 -> 9 where it diverged
        r.out.mkdir(parents=True)
        last = 9.0 if r.cfg.method in diverged else 1.0
        avg = None if unreadable else 1.0
        (r.out / ckpt.RESULTS).write_text(json.dumps({"method": r.cfg.method, "seed": 0, "avg_rouge_l_personalized": avg,
                                                      "clients": [{"id": 0, "task": "t", "rouge_l_personalized": 1.0}]}))
        (r.out / ckpt.CONFIG).write_text("{}")
        (r.out / ckpt.METRICS).write_text("".join(json.dumps({"event": "round", "round": i, "mean_loss": x}) + "\n"
                                                  for i, x in enumerate([2.0, last])))
    fake = tmp_path / "pflalign"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PHASES": "validated", "CONF": str(conf), "RUNS": str(runs), "PFL": str(fake),
           "PY": sys.executable, "DATA": str(tmp_path)}
    out = subprocess.run(["bash", str(here / "run-grid.sh")], env=env, capture_output=True, text=True, check=True)
    first, *rest = [c for c in calls.read_text().splitlines() if c.startswith("sweep")]
    assert first.startswith("sweep --config") and first.endswith("--seeds 0")
    if unreadable:
        assert rest == [] and "no seed 1-2 run of validated.toml started" in out.stdout and "no average personalized score" in out.stderr
        return
    kept = [m for m in ["fedavg", "fedsa-lora", "feddyn", "local", "pflalign"] if m not in diverged]
    assert rest == [first.replace("--seeds 0", f"--methods {','.join(kept)}")]
    assert ("held back" in out.stdout) == bool(diverged) and all(m in out.stdout for m in diverged)


def next_plan(here: Path, best: dict) -> set:
    """The (method, lr) full runs of the next validated lr: for each baseline whose full run at its
    validated lr diverged on seed 0 (committed under runs/), the best of its other validation points
    by the same rule. pFLAlign's own 4b runs are a β, not an lr: not covered."""
    from pflalign.analysis.report import Sweep, divergence, find_runs, summarize, sweeps

    runs, _ = find_runs(here / "validation" / "runs")
    _, rows = summarize([r for r in runs if "personalized=" not in r.method])
    wanted = set()
    for line in sweeps(rows):
        lr = best.get(line.name)
        seed0 = here / "runs" / "flan" / f"{line.name}@lr={lr}" / "seed0"
        if line.setting != "lr" or line.name == "pflalign" or not (seed0 / ckpt.RESULTS).is_file():
            continue
        if divergence(find_runs(seed0)[0][0]):
            rest = Sweep(line.name, "lr", [(v, row) for v, row in line.points if v != lr])
            wanted.add((line.name, rest.best()))
    return wanted


def test_issue_38s_next_validated_runs_follow_a_diverged_seed_0(tmp_path):
    """validated-next.toml holds exactly the runs of the next validated lr of each method whose
    seed 0 diverged at its validated lr (README's rule), and exists only when one did."""
    here = Path(__file__).resolve().parents[1] / "docs" / "results" / "pflalign-analysis"
    if not (here / "validated.toml").exists():
        pytest.skip("validated.toml is written once 4b's validation grid is in")
    wanted = next_plan(here, validated_plan(here)[0])
    if not wanted:
        assert not (here / "validated-next.toml").exists()
        return
    runs = plan_sweep(str(here / "validated-next.toml"), tmp_path, data_dir=str(tmp_path))
    assert {(r.cfg.method, r.cfg.lr) for r in runs} == wanted
    assert {r.cfg.seed for r in runs} == {0, 1, 2} and {r.cfg.rounds for r in runs} == {50}
    assert {r.cfg.eval.base_model for r in runs} == {False}


def test_validated_plan_by_the_rule_on_made_up_sweeps(tmp_path):
    """The derivation above on a made-up validation folder: FedAvg best at 0.16, pFLAlign at 0.04,
    FedSA-LoRA at 0.04 (Table 1's: no full runs), an incomplete sweep left out."""
    root = tmp_path / "validation" / "runs" / "flan"
    avgs = {"fedavg": [1, 2, 3, 4, 5, 9, 0], "pflalign": [1, 2, 3, 8, 5, 4, 3], "fedsa-lora": [1, 2, 3, 7, 7, 7, 0]}
    lrs = [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32]
    for method, values in {**avgs, "local": [1, 2]}.items():
        for lr, avg in zip(lrs, values):
            d = root / f"{method}@lr={lr}" / "seed0"
            d.mkdir(parents=True)
            (d / ckpt.RESULTS).write_text(json.dumps({"method": method, "seed": 0, "avg_rouge_l_personalized": avg,
                                                      "clients": [{"id": 0, "task": "t", "rouge_l_personalized": avg}]}))
            (d / ckpt.CONFIG).write_text("{}")
            (d / ckpt.METRICS).write_text("")
    best, wanted = validated_plan(tmp_path)
    assert best == {"fedavg": 0.16, "pflalign": 0.04, "fedsa-lora": 0.04}
    assert wanted == {("fedavg", 0.16, None), ("pflalign", 0.04, 0.5)}


def test_flat_and_merge_the_configs_that_sweep_and_rescore_compare():
    from pflalign.settings import flat, merge

    saved = {"lr": 0.1, "method_args": {}, "eval": {"every": 0, "batch_size": 4}}
    # a sweep compares empty tables too; a rescore drops them (`method_args: {}` -> `{personalized: x}`
    # is one changed key)
    assert flat(saved) == {"lr": 0.1, "method_args": {}, "eval.every": 0, "eval.batch_size": 4}
    assert flat(saved, empty_tables=False) == {"lr": 0.1, "eval.every": 0, "eval.batch_size": 4}
    merged = merge(saved, {"eval": {"every": 2}, "method_args": {"personalized": "x"}, "lr": [1, 2]})
    assert merged == {"lr": [1, 2], "method_args": {"personalized": "x"}, "eval": {"every": 2, "batch_size": 4}}
    assert saved == {"lr": 0.1, "method_args": {}, "eval": {"every": 0, "batch_size": 4}}  # inputs unchanged


def test_dolly_grid_files_plan_the_preset_and_the_step_size_rows(tmp_path):
    """Issue 58: docs/results/table1-dolly/table1.toml is the preset table1-dolly (the same 33
    configs, FLAN's validated method arguments), in another order; step-size.toml adds 6 runs."""
    folder = Path(__file__).resolve().parent.parent / "docs" / "results" / "table1-dolly"
    dolly = tmp_path / "dolly.jsonl"
    dolly.write_text("")
    preset = plan_sweep("table1-dolly", tmp_path / "a", data_dir=str(dolly))
    mine = plan_sweep(str(folder / "table1.toml"), tmp_path / "a", data_dir=str(dolly))
    assert sorted((r.key, repr(to_dict(r.cfg))) for r in mine) == sorted(
        (r.key, repr(to_dict(r.cfg))) for r in preset)
    args = {r.method: r.cfg.method_args for r in preset}
    assert args["pflalign"]["beta"] == 0.8 and args["fedprox"]["mu"] == 1.0 and args["feddyn"]["alpha"] == 0.1
    assert {(r.cfg.lr, r.cfg.rounds, r.cfg.local_steps, r.cfg.max_seq_len) for r in preset} == {(0.04, 50, 5, 1024)}
    steps = plan_sweep(str(folder / "step-size.toml"), tmp_path / "a", data_dir=str(dolly))
    assert sorted({(r.method, r.cfg.lr) for r in steps}) == [("fedavg@lr=0.16", 0.16), ("pflalign@lr=0.33", 0.33)]
    assert len(steps) == 6 and all(r.cfg.method_args.get("beta", 0.8) == 0.8 for r in steps)
