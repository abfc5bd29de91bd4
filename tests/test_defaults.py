"""Defaults that train (issue 56): the keys a config leaves unset (`settings.resolve_defaults`).

A new run (`pflalign run`, `sweep`, `api.config`) takes the "library" defaults: pFLAlign at β 0.5
and lr 0.16, AdamW at 2e-4; the paper presets and every saved config.json keep the "paper" ones
(every method at lr 0.04, pFLAlign's β 0.9), so that the committed runs and Table 1's presets plan
exactly the configs they planned before."""

from __future__ import annotations

import json
import logging

import pytest

from pflalign import api
from pflalign.config import build_config, make_method, to_dict
from pflalign.methods import METHODS
from pflalign.methods.pflalign import SHORT_STEP, step_ratio_cap
from pflalign.run.lifecycle import warn_at_start
from pflalign.settings import METHOD_NAMES
from pflalign.sweep import plan_sweep

PFLALIGN_FAMILY = [m for m in METHOD_NAMES if m.startswith("pflalign")]


# ---- the paper presets: unchanged ---------------------------------------------------------
@pytest.mark.parametrize("preset", ["flan-paper", "dolly-paper"])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_paper_presets_keep_lr_004_and_beta_09_for_a_new_run(preset, method):
    cfg = build_config(preset, {"method": method}, defaults="library")
    assert cfg.lr == 0.04 and cfg.optimizer.name == "sgd"
    assert to_dict(cfg)["method_args"] == {}  # as config.json wrote it before issue 56
    if method in PFLALIGN_FAMILY:
        assert make_method(cfg).args.beta == 0.9
    assert "defaults" not in to_dict(cfg)


@pytest.mark.parametrize("preset, beta", [("table1-flan", 0.8), ("table1-dolly", 0.8), ("tune-flan", None)])
def test_paper_sweeps_plan_what_they_planned(tmp_path, preset, beta):
    runs = plan_sweep(preset, tmp_path, data_dir=str(tmp_path))
    assert {r.cfg.lr for r in runs} == {0.04}
    for r in runs:
        args = to_dict(r.cfg)["method_args"]
        if r.method == "pflalign" and beta is not None:
            assert args == {"beta": beta}
        elif r.method.startswith("pflalign@"):  # tune-flan's β grid
            assert args == {"beta": float(r.method.split("=")[1])}
        elif r.method == "fedavg":
            assert args == {}


# ---- the library defaults ------------------------------------------------------------------
def test_a_new_pflalign_run_gets_beta_05_at_lr_016():
    for cfg in (build_config(None, {"method": "pflalign"}, defaults="library"), api.config(),
                api.config("demo")):
        assert (cfg.method, cfg.lr, cfg.method_args) == ("pflalign", 0.16, {"beta": 0.5})
        assert to_dict(cfg)["method_args"] == {"beta": 0.5} and to_dict(cfg)["lr"] == 0.16  # recorded


def test_what_the_user_sets_wins_and_each_default_alone():
    new = lambda **over: build_config(None, over, defaults="library")  # noqa: E731
    assert new(method="pflalign", lr=0.33).method_args == {"beta": 0.5}
    assert new(method="pflalign", method_args={"beta": 0.8}).lr == 0.16
    assert new(method="pflalign", method_args={"beta": 0.9}, lr=0.04).method_args == {"beta": 0.9}
    assert new(method="fedavg").lr == 0.04 and new(method="fedavg").method_args == {}
    # P ≡ 1 steps like SGD: the baselines' lr; its β (m, v, γ) as the full method's
    assert (new(method="pflalign-no-precond").lr, new(method="pflalign-no-precond").method_args) == (0.04, {"beta": 0.5})
    assert new(method="pflalign", method_args={"precondition": False}).lr == 0.04
    assert new(method="pflalign-no-correction").lr == 0.16
    assert new(method="fedavg", optimizer={"name": "adamw"}).lr == 2e-4
    assert new(method="fedavg", optimizer={"name": "adamw"}, lr=1e-3).lr == 1e-3
    assert build_config(None, {"method": "fedavg", "optimizer": {"name": "adamw"}}).lr == 2e-4  # paper too
    assert build_config("flan-paper", {"method": "fedavg", "optimizer": {"name": "adamw"}}).lr == 2e-4
    assert new(method="pflalign", defaults="paper").lr == 0.04


def test_a_saved_config_reads_back_the_same():
    """config.json records what the defaults filled in, and an old one (no β) ran at β 0.9."""
    for over in ({"method": "pflalign"}, {"method": "fedavg", "optimizer": {"name": "adamw"}},
                 {"method": "pflalign-no-personal-init", "rounds": 3}):
        saved = to_dict(build_config(None, over, defaults="library"))
        assert to_dict(build_config(None, json.loads(json.dumps(saved)))) == saved
    old = to_dict(build_config(None, {"method": "pflalign"}))  # paper: as every run before issue 56
    assert old["method_args"] == {} and old["lr"] == 0.04
    assert make_method(build_config(None, old)).args.beta == 0.9


def test_unknown_defaults_is_one_line():
    from pflalign.errors import UserError

    with pytest.raises(UserError, match="defaults must be one of paper, library, got 'mine'"):
        build_config(None, {"defaults": "mine"})


# ---- the warning at the start ---------------------------------------------------------------
@pytest.mark.parametrize("beta, warns", [(0.5, False), (0.8, False), (0.85, True), (0.9, True), (0.99, True)])
def test_a_pflalign_run_whose_cap_is_below_a_fifth_of_its_lr_says_so(caplog, beta, warns):
    cfg = build_config(None, {"method": "pflalign", "method_args": {"beta": beta}})
    caplog.set_level(logging.WARNING)
    warn_at_start(cfg, make_method(cfg))
    lines = [r.getMessage() for r in caplog.records]
    cap, _ = step_ratio_cap(beta, cfg.local_steps)
    assert (cap < SHORT_STEP) == warns
    assert len(lines) == int(warns)
    if warns:
        assert f"pFLAlign at beta {beta:g} steps at most {cap:.3f} x SGD's step" in lines[0]
        assert "\n" not in lines[0]


def test_no_warning_for_p_off_nor_for_the_baselines(caplog):
    caplog.set_level(logging.WARNING)
    for over in ({"method": "pflalign-no-precond", "method_args": {"beta": 0.9}}, {"method": "fedavg"}):
        cfg = build_config(None, over)
        warn_at_start(cfg, make_method(cfg))
    assert caplog.records == []


def test_adamw_at_an_sgd_lr_says_so(caplog):
    caplog.set_level(logging.WARNING)
    cfg = build_config(None, {"method": "fedavg", "optimizer": {"name": "adamw"}, "lr": 0.04})
    warn_at_start(cfg, make_method(cfg))
    assert len(caplog.records) == 1 and "optimizer.name=adamw at lr 0.04" in caplog.records[0].getMessage()
    caplog.clear()
    cfg = build_config(None, {"method": "fedavg", "optimizer": {"name": "adamw"}})
    warn_at_start(cfg, make_method(cfg))
    assert caplog.records == []


def test_the_caps_match_the_method_run_on_a_constant_gradient():
    """`step_ratio_cap` against the numbers tests/test_pflalign.py measures with the method itself."""
    for beta, cap, mean in [(0.5, 0.8543, 0.6791), (0.8, 0.2874, 0.2417), (0.9, 0.0895, 0.0811)]:
        assert step_ratio_cap(beta, 5) == pytest.approx((cap, mean), abs=1e-4)


def test_methods_long_says_the_library_defaults(capsys):
    from pflalign.cli import main

    assert main(["methods", "-l"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("pflalign "))
    assert "β 0.5 at lr 0.16" in line and "β 0.9" in line
    assert METHODS["pflalign"].Args().beta == 0.9  # what a config without β means


def test_a_run_on_library_defaults_resumes_as_saved(tmp_path):
    """config.json keeps what the library defaults filled in (lr, β), not which defaults did: the
    config read back on --resume is the same run, and its training recipe is the checkpoint's
    (issue 57's check must not take the lost marker for a change)."""
    from pflalign.config import load_saved_config, recipe
    from pflalign.run.engine import run

    from test_engine import TINY

    tiny = {k: v for k, v in json.loads(json.dumps(TINY)).items() if k != "defaults"}  # TINY pins the paper's
    cfg = build_config(None, {**tiny, "method": "pflalign", "rounds": 2}, defaults="library")
    assert (cfg.lr, cfg.method_args["beta"]) == (0.16, 0.5)
    out = tmp_path / "run"
    assert run(cfg, out, stop_after=1, progress=False) is None
    saved = load_saved_config(out / "config.json")
    assert saved == cfg and recipe(saved) == recipe(cfg) and saved.defaults == "paper"
    assert run(None, out, resume=True, progress=False)["method"] == "pflalign"


# ---- eval.batch_size: the decoding rows by device ------------------------------------------
def test_eval_batch_size_unset_is_64_on_the_cpu_and_auto_on_cuda_as_config_json_records():
    from pflalign.settings.defaults import EVAL_ROWS_CPU

    assert build_config("demo").eval.batch_size == EVAL_ROWS_CPU == 64  # a CPU run's config.json as before
    assert to_dict(build_config("dolly-paper"))["eval"]["batch_size"] == 64
    for device in ("cuda", "cuda:1", "auto"):
        cfg = build_config("demo", {"device": device})
        assert cfg.eval.batch_size == "auto" and to_dict(cfg)["eval"]["batch_size"] == "auto"
        assert build_config(None, json.loads(json.dumps(to_dict(cfg)))).eval.batch_size == "auto"  # read back
    assert build_config("demo", {"device": "cuda", "eval": {"batch_size": 32}}).eval.batch_size == 32
    assert build_config("demo", {"eval": {"batch_size": "auto"}}).eval.batch_size == "auto"


@pytest.mark.parametrize("bad", [0, -3, "big"])
def test_eval_batch_size_must_be_a_positive_number_or_auto(bad):
    from pflalign.errors import UserError

    with pytest.raises(UserError, match=f"eval.batch_size must be > 0 or auto, got {bad!r}"):
        build_config("demo", {"eval": {"batch_size": bad}})
