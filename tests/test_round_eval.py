"""Optional per-round evaluation (`eval.every`): round_eval lines, and no effect on training."""

import json

import pytest

from pflalign import checkpoint as ckpt
from pflalign.config import build_config
from pflalign.run.engine import run
from pflalign.errors import UserError

TINY = {
    "model": "tiny-llama", "lora": {"r": 2, "alpha": 4}, "rounds": 3, "local_steps": 2, "batch_size": 2,
    "max_seq_len": 64, "data": {"name": "synthetic", "clients": ["arithmetic", "sorting"], "max_train": 4,
                                "max_test": 3},
    "eval": {"max_new_tokens": 2, "batch_size": 4, "base_model": False},
}


def _config(**eval_over):
    cfg = json.loads(json.dumps(TINY))
    cfg["eval"].update(eval_over)
    return build_config(None, cfg)


def _rows(out):
    return [json.loads(l) for l in (out / ckpt.METRICS).read_text().splitlines()]


def test_round_eval_lines_every_n_rounds_before_the_checkpoint(tmp_path):
    run(_config(every=2, every_max_test=2), tmp_path / "a", progress=False)
    rows = _rows(tmp_path / "a")
    evals = [r for r in rows if r["event"] == "round_eval"]
    assert [(r["round"], r["client"], r["task"]) for r in evals] == [(1, 0, "arithmetic"), (1, 1, "sorting")]
    for r in evals:
        assert r["n_test"] == 2 and 0 <= r["rouge_l_personalized"] <= 100 and 0 <= r["rouge_l_global"] <= 100
    events = [r["event"] for r in rows]
    # after round 1's summary line, before round 2's training
    first = events.index("round_eval")
    assert rows[first - 1]["event"] == "round" and rows[first - 1]["round"] == 1
    assert rows[first + 2]["event"] == "train_step" and rows[first + 2]["round"] == 2


def test_round_eval_changes_no_training_and_survives_resume(tmp_path):
    plain = run(_config(), tmp_path / "plain", progress=False)
    with_eval = run(_config(every=1), tmp_path / "eval", progress=False)
    losses = lambda d: [r["loss"] for r in _rows(d) if r["event"] == "train_step"]  # noqa: E731
    assert losses(tmp_path / "plain") == losses(tmp_path / "eval")
    assert plain["clients"] == with_eval["clients"]
    assert sum(r["event"] == "round_eval" for r in _rows(tmp_path / "eval")) == 3 * 2

    run(_config(every=1), tmp_path / "split", stop_after=2, progress=False)
    run(None, tmp_path / "split", resume=True, progress=False)
    strip = lambda d: [{k: v for k, v in r.items() if k != "seconds"} for r in _rows(d)]  # noqa: E731
    assert strip(tmp_path / "split") == strip(tmp_path / "eval")


def test_round_eval_settings_are_checked():
    with pytest.raises(UserError, match="eval.every must be >= 0"):
        _config(every=-1)
    with pytest.raises(UserError, match="eval.every_max_test must be > 0"):
        _config(every=1, every_max_test=0)
