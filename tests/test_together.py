"""`pflalign sweep --batch runs` (issue 55 point 3): runs that share a base model trained in
lockstep, each keeping its own folder, checkpoint, resume and metrics; equal to the sweep one run
after another within the lockstep tolerance; a run that diverges stops alone."""

from __future__ import annotations

import json

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.errors import UserError
from pflalign.run.engine import run
from pflalign.sweep import plan_sweep, run_sweep

from test_batched_scoring import far_start  # noqa: F401  (a fixture)
from test_lockstep import assert_runs_close

# three methods, two seeds (so two w^0), SCAFFOLD at its own lr: their rounds share passes
SWEEP = """
methods = ["fedavg", "pflalign", "scaffold"]
seeds = [0, 1]

[base]
model = "tiny-llama"
lora = { r = 2, alpha = 4 }
rounds = 2
local_steps = 2
batch_size = 2
max_seq_len = 64
defaults = "paper"
eval = { max_new_tokens = 2, batch_size = 4, base_model = false }

[method_args.pflalign]
beta = 0.8

[grid.scaffold]
lr = [0.02]

[[datasets]]
name = "synth"
set = { data = { clients = ["arithmetic", "sorting"], max_train = 4, max_test = 2 } }
"""


@pytest.fixture
def sweep_file(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP)
    return path


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_runs_in_lockstep_equal_the_sweep_one_run_after_another(sweep_file, tmp_path):
    alone = plan_sweep(str(sweep_file), tmp_path / "alone")
    together = plan_sweep(str(sweep_file), tmp_path / "together")
    assert len(together) == 6
    expected = run_sweep(alone, progress=False)
    got = run_sweep(together, progress=False, batch="runs")
    for a, b, ra, rb in zip(alone, together, expected, got):
        assert _files(b.out) == _files(a.out), a.key  # the same files
        assert rb["batch"] == "runs" and "batch" not in ra
        assert set(rb) - {"batch"} == set(ra), a.key  # the same keys in results.json
        assert [c["task"] for c in rb["clients"]] == [c["task"] for c in ra["clients"]]
        assert_runs_close(a.out, b.out)  # every loss, adapter and method state within 1e-5
        assert json.loads((b.out / ckpt.CONFIG).read_text()) == json.loads((a.out / ckpt.CONFIG).read_text())


def test_a_run_that_diverges_stops_alone_and_the_others_finish_as_alone(sweep_file, tmp_path):
    """FedAvg at lr 1e30 reaches a non-finite value in its first round: it stops with no round's
    lines, as in the one-at-a-time sweep, and the other runs finish equal to their runs alone."""
    runs = plan_sweep(str(sweep_file), tmp_path / "together", seeds=[0])
    blown = runs[0]
    assert blown.method == "fedavg"
    blown.cfg.lr = 1e30
    with pytest.raises(UserError, match=r"2 of 3 runs finished; 1 stopped on a non-finite value.*synth/fedavg/seed0"):
        run_sweep(runs, progress=False, batch="runs")
    assert not (blown.out / ckpt.RESULTS).exists() and not ckpt.has_run_checkpoint(blown.out)
    for r in runs[1:]:
        assert (r.out / ckpt.RESULTS).exists()
        run(r.cfg, tmp_path / "alone" / r.method, progress=False)
        assert_runs_close(tmp_path / "alone" / r.method, r.out)


def test_a_run_resumed_beside_a_new_one(sweep_file, tmp_path):
    """One run stopped after its first round (its checkpoint) and one new run train together: each
    its own next round; both end equal to their uninterrupted runs."""
    runs = plan_sweep(str(sweep_file), tmp_path / "together", seeds=[1], methods=["fedavg", "pflalign"])
    run(runs[0].cfg, runs[0].out, progress=False, stop_after=1)
    assert runs[0].state() == "unfinished"
    run_sweep(runs, progress=False, batch="runs")
    for r in runs:
        run(r.cfg, tmp_path / "alone" / r.method, progress=False)
        assert_runs_close(tmp_path / "alone" / r.method, r.out)


def test_runs_on_other_bases_train_in_groups_of_their_own(sweep_file, tmp_path, monkeypatch):
    from pflalign.run import together

    runs = plan_sweep(str(sweep_file), tmp_path / "out", seeds=[0], methods=["fedavg", "pflalign"])
    runs[1].cfg.lora.r = 4  # another adapter shape: not one lockstep
    groups = []
    real = together.run_together
    monkeypatch.setattr(together, "run_together",
                        lambda planned, *a: groups.append(len(planned)) or real(planned, *a))
    run_sweep(runs, progress=False, batch="runs")
    assert groups == [1, 1]


def test_batch_runs_is_the_sweeps(tmp_path):
    from pflalign.cli import main
    from test_engine import tiny_config

    with pytest.raises(UserError, match="use pflalign sweep --batch runs"):
        run(tiny_config(), tmp_path / "x", progress=False, batch="runs")
    with pytest.raises(SystemExit) as info:  # pflalign run has no --batch runs: argparse says so
        main(["run", "--config", "demo", "--out", str(tmp_path / "y"), "--batch", "runs"])
    assert info.value.code == 2


def test_the_seeded_start_of_each_run_is_its_own_models():
    """A run on the shared model starts from the w^0 its own model would have."""
    from pflalign.model import build_model
    from pflalign.run.together import SharedModel
    from test_engine import tiny_config

    shared = SharedModel()
    for seed in (0, 3):
        cfg = tiny_config(seed=seed)
        lm, w0 = shared(cfg)
        own = build_model(cfg).get_lora()
        assert all(torch.equal(w0[n], own[n]) for n in own)
    assert not all(torch.equal(shared.initial[0][n], shared.initial[3][n]) for n in own)


def test_ctrl_c_stops_every_run_at_its_last_checkpoint_and_the_sweep_resumes_them(sweep_file, tmp_path, monkeypatch):
    from pflalign.errors import RunInterrupted
    from pflalign.run import together

    runs = plan_sweep(str(sweep_file), tmp_path / "together", seeds=[0], methods=["fedavg", "pflalign"])
    real, calls = together.run_rounds_lockstep, []

    def interrupted_in_round_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(together, "run_rounds_lockstep", interrupted_in_round_2)
    with pytest.raises(RunInterrupted) as info:
        run_sweep(runs, progress=False, batch="runs")
    assert str(info.value).count("interrupted during round 2 of 2; the last finished round (1) is saved") == 2
    assert [r.state() for r in runs] == ["unfinished", "unfinished"]
    monkeypatch.undo()
    run_sweep(runs, progress=False, batch="runs")  # the same command resumes both
    for r in runs:
        run(r.cfg, tmp_path / "alone" / r.method, progress=False)
        assert_runs_close(tmp_path / "alone" / r.method, r.out)


# ---- scoring the runs that finish together -------------------------------------------------------
def loops_spy(monkeypatch) -> list[int]:
    """The decoding loops of `batched_scoring` from now on: each one's number of (adapter, prompts) sets."""
    from pflalign.run import batched_scoring

    loops, real = [], batched_scoring.generate_per_adapter
    monkeypatch.setattr(batched_scoring, "generate_per_adapter",
                        lambda lm, sets, *a, **k: loops.append(len(sets)) or real(lm, sets, *a, **k))
    return loops


def two_methods(tmp_path, **over):
    """FedAvg at lr 0.5 and FedSA-LoRA at lr 0.2 (so that their global models differ too) on one
    federation (seed 0: the same test prompts), one round: models that answer apart
    (test_batched_scoring's `tiny_run`), no `eval.every`; `over`: eval's keys."""
    from test_batched_scoring import tiny_run

    return [tiny_run(tmp_path, method, rounds=1, lr=lr, eval={"every": 0, **over})
            for method, lr in (("fedavg", 0.5), ("fedsa-lora", 0.2))]


def test_runs_that_finish_together_are_scored_in_one_loop_as_each_alone(tmp_path, far_start, monkeypatch):
    """Three runs end in the same step of the lockstep: the two of equal eval settings are scored in
    one decoding loop (each run's global and 3 personalized adapters over its clients' prompts),
    the third (other eval.max_new_tokens) in its own; each run writes the results.json and
    predictions of its run alone, word for word. The runs answer the same prompts apart, so a
    loop that gave one run's prompts another run's adapters could not pass."""
    from pflalign.run.together import run_together
    from test_batched_scoring import tiny_run, written

    other_eval = tiny_run(tmp_path, "fedavg", seed=1, rounds=1, eval={"every": 0, "max_new_tokens": 6})
    cfgs = [*two_methods(tmp_path), other_eval]
    for i, cfg in enumerate(cfgs):
        run(cfg, tmp_path / "alone" / str(i), progress=False)
    loops = loops_spy(monkeypatch)
    got = run_together([(cfg, tmp_path / "together" / str(i), False) for i, cfg in enumerate(cfgs)], progress=False)
    assert loops == [2 * 6, 6]  # 3 clients × (personalized, global) per run; one loop for the first two
    assert all(results["batch"] == "runs" for results in got)
    alone = [written(tmp_path / "alone" / str(i)) for i in range(3)]
    for i in range(3):
        assert written(tmp_path / "together" / str(i)) == alone[i], i
    first, second = alone[0][1], alone[1][1]
    assert [p["prompt"] for p in first] == [p["prompt"] for p in second]
    for model in ("personalized", "global"):
        assert sum(a[model] != b[model] for a, b in zip(first, second)) >= 3, model


def test_a_cap_on_the_adapters_of_a_loop_changes_no_prediction(tmp_path, far_start, monkeypatch):
    """Two finished runs on one shared model scored together with at most 1, 2 (`LOOP_BYTES` of
    two adapters) or all 8 adapters per loop: the same predictions, those each run wrote alone; and
    the check can fail (each run's global jobs on the other run's global adapter answer otherwise)."""
    from pflalign.config import build_config
    from pflalign.run import batched_scoring
    from pflalign.run.engine import Federation
    from pflalign.run.together import SharedModel

    outs = [tmp_path / str(i) for i in range(2)]
    for cfg, out in zip(two_methods(tmp_path, base_model=False), outs):
        run(cfg, out, progress=False)
    shared, feds = SharedModel(), []
    for out in outs:
        cfg = build_config(None, json.loads((out / ckpt.CONFIG).read_text()))
        feds.append(Federation(cfg, progress=False, out=out, batch="runs", shared=shared(cfg)))
        feds[-1].restore(ckpt.load_run_checkpoint(out))
    parts = [(fed.side, fed.score_jobs(fed.final_models)[0], {"global": fed.global_params}) for fed in feds]

    def predictions(parts, cap=None):
        return [[done.predictions for done in run_done]
                for run_done in batched_scoring.score_runs_together(parts, cap=cap)]

    loops = loops_spy(monkeypatch)
    expected = predictions(parts)
    assert expected[0] != expected[1]  # the runs' models answer apart
    for out, run_done in zip(outs, expected):  # each run's jobs: its 3 clients' personalized models, then global
        rows = [json.loads(line) for line in (out / ckpt.PREDICTIONS).read_text().splitlines()]
        assert [p["personalized"] for p in rows] == sum(run_done[:3], [])
        assert [p["global"] for p in rows] == sum(run_done[3:], [])
    assert predictions(parts, cap=1) == expected
    size = sum(t.numel() * t.element_size() for t in shared.lm.lora.values())
    monkeypatch.setattr(batched_scoring, "LOOP_BYTES", 2 * size + 1)
    assert batched_scoring.adapters_per_loop(shared.lm) == 2
    assert predictions(parts) == expected
    # 8 adapters (2 runs × (3 personalized, 1 global: its 3 jobs)): in one loop, one a loop, two a loop
    assert loops == [12] + [1, 1, 1, 3] * 2 + [2, 4] * 2
    swapped = [(parts[0][0], parts[0][1], parts[1][2]), (parts[1][0], parts[1][1], parts[0][2])]
    assert [run_done[3:] for run_done in predictions(swapped)] != [run_done[3:] for run_done in expected]



def test_each_rounds_scoring_of_runs_in_lockstep_is_one_loop_as_each_alone(tmp_path, far_start, monkeypatch):
    """Two runs scored after every round (`eval.every` 1, their first 3 test prompts): each round's
    personalized and global models of both runs go through one decoding loop, as the final scoring
    does, and give each run's prompts the answers its run alone gives them (alone with --batch
    clients, so that its scoring goes through the same loop, one run in it); each run writes the
    round_eval lines, results and predictions of its run alone. The runs answer apart after every
    round, so a loop that gave one run's prompts the other's models could not pass."""
    from pflalign.run import batched_scoring
    from pflalign.run.together import run_together
    from test_batched_scoring import tiny_run, written

    real = batched_scoring.generate_per_adapter
    answers = []  # each loop's outputs, set by set

    def spy(lm, sets, *a, **k):
        answers.append(real(lm, sets, *a, **k))
        return answers[-1]

    monkeypatch.setattr(batched_scoring, "generate_per_adapter", spy)
    cfgs = [tiny_run(tmp_path, method, rounds=2, lr=lr) for method, lr in (("fedavg", 0.5), ("fedsa-lora", 0.2))]
    alone = []
    for i, cfg in enumerate(cfgs):
        answers.clear()
        run(cfg, tmp_path / "alone" / str(i), progress=False, batch="clients")
        alone.append(list(answers))
    answers.clear()
    run_together([(cfg, tmp_path / "together" / str(i), False) for i, cfg in enumerate(cfgs)], progress=False)
    # rounds 1 and 2, the end; a loop's sets: run 0's 3 clients × (personalized, global), then run 1's
    assert [len(loop) for loop in answers] == [12, 12, 12]
    assert [len(loop) for loop in alone[0]] == [6, 6, 6]
    for r in range(2):
        assert alone[0][r] != alone[1][r], r  # the runs answer apart
    assert answers == [a + b for a, b in zip(*alone)]
    for i in range(2):
        assert written(tmp_path / "together" / str(i)) == written(tmp_path / "alone" / str(i)), i
