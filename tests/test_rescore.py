"""`pflalign rescore`: a finished run's models scored again under another evaluation setting."""

import hashlib
import json
from pathlib import Path

import pytest

from pflalign import checkpoint as ckpt
from pflalign.cli import main
from pflalign.run.engine import run
from pflalign.run.rescore import rescore
from pflalign.errors import UserError

from test_engine import tiny_config

VOLATILE = {"seconds_train_this_session", "seconds_eval", "seconds_eval_by_model", "rescored_from", "seconds"}


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _lines(folder: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in VOLATILE} for row in ckpt.metrics_rows(folder / ckpt.METRICS)]


def test_rescore_equals_a_run_that_scored_so_from_the_start(tmp_path):
    """pFLAlign scored with w^R + Δ_k afterwards gives the results of a run that chose it from
    the start (the choice changes no training), and leaves the run it reads as it was."""
    cfg = tiny_config(method="pflalign")
    source = tmp_path / "w_kT"
    run(cfg, source, progress=False)
    before = _tree(source)
    got = rescore(source, tmp_path / "rescored", {"method_args": {"personalized": "after_aggregation"}},
                  progress=False)
    assert _tree(source) == before
    direct = run(tiny_config(method="pflalign", method_args={"personalized": "after_aggregation"}),
                 tmp_path / "direct", progress=False)
    strip = lambda r: {k: v for k, v in r.items() if k not in VOLATILE}  # noqa: E731
    assert strip(got) == strip(direct)
    assert got["rescored_from"] == str(source.resolve())
    assert _lines(tmp_path / "rescored") == _lines(tmp_path / "direct")
    assert (tmp_path / "rescored" / ckpt.PREDICTIONS).read_bytes() == (tmp_path / "direct" / ckpt.PREDICTIONS).read_bytes()
    original = json.loads((source / ckpt.RESULTS).read_text())
    assert [c["rouge_l_global"] for c in got["clients"]] == [c["rouge_l_global"] for c in original["clients"]]
    saved = json.loads((tmp_path / "rescored" / ckpt.CONFIG).read_text())
    assert saved["method_args"] == {"personalized": "after_aggregation"}
    assert (tmp_path / "rescored" / "adapters" / "global").is_dir()


def test_rescore_refuses_what_would_change_the_training(tmp_path, capsys):
    source = tmp_path / "run"
    run(tiny_config(method="fedavg"), source, progress=False)
    with pytest.raises(UserError, match="lr would change the training"):
        rescore(source, tmp_path / "x", {"lr": 0.1}, progress=False)
    with pytest.raises(UserError, match="unknown argument .personalized. for method fedavg"):
        rescore(source, tmp_path / "x", {"method_args": {"personalized": "after_aggregation"}}, progress=False)
    with pytest.raises(UserError, match="differs from the run's"):
        rescore(source, tmp_path / "x", {"eval": {"max_new_tokens": 4}}, progress=False)
    with pytest.raises(UserError, match="--out must differ"):
        rescore(source, source, {"eval": {"max_new_tokens": 2}}, progress=False)
    copy = tmp_path / "copy"  # committed small files: no checkpoint
    copy.mkdir()
    for name in (ckpt.CONFIG, ckpt.RESULTS, ckpt.METRICS):
        (copy / name).write_bytes((source / name).read_bytes())
    assert main(["rescore", str(copy), "--out", str(tmp_path / "y"), "--set", "eval.max_new_tokens=2"]) == 2
    assert "is not a finished run with its checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # an eval-only change is fine, by the command line too
    assert main(["rescore", str(source), "--out", str(tmp_path / "z"), "--set", "eval.max_new_tokens=2",
                 "--no-progress"]) == 0
    assert json.loads((tmp_path / "z" / ckpt.CONFIG).read_text())["eval"]["max_new_tokens"] == 2
    assert json.loads((tmp_path / "z" / ckpt.RESULTS).read_text())["seconds_eval_by_model"]["global"] > 0


def test_rescore_takes_the_global_models_generations_from_the_run_when_only_the_personal_choice_changes(tmp_path):
    """Choosing another personalized model leaves the global one and the eval settings as they were,
    so its generations are the source's: read from its files, not generated again (FedAvg's full
    FLAN run at lr 0.006, issue 38: the global model's generation was 516 of the final evaluation's
    1218 worker-seconds). Where the source's predictions are torn or name other prompts, it is
    generated again, with the same outcome."""
    source = tmp_path / "w_kT"
    run(tiny_config(method="pflalign"), source, progress=False)
    change = {"method_args": {"personalized": "after_aggregation"}}
    reused = rescore(source, tmp_path / "a", change, progress=False)
    assert reused["seconds_eval_by_model"]["global"] == 0.0 and reused["seconds_eval_by_model"]["personalized"] > 0
    lines = (source / ckpt.PREDICTIONS).read_bytes().splitlines(keepends=True)
    (source / ckpt.PREDICTIONS).write_bytes(b"".join(lines[:-1]))  # one client short of its test split
    again = rescore(source, tmp_path / "b", change, progress=False)
    assert again["seconds_eval_by_model"]["global"] > 0
    strip = lambda r: {k: v for k, v in r.items() if k not in VOLATILE}  # noqa: E731
    assert strip(again) == strip(reused)
    assert (tmp_path / "a" / ckpt.PREDICTIONS).read_bytes() == (tmp_path / "b" / ckpt.PREDICTIONS).read_bytes()
    first = json.loads(lines[0])
    first["prompt"] += " (another test split)"  # the same count of rows, not the same examples
    (source / ckpt.PREDICTIONS).write_bytes(json.dumps(first).encode() + b"\n" + b"".join(lines[1:]))
    other = rescore(source, tmp_path / "c", change, progress=False)
    assert other["seconds_eval_by_model"]["global"] > 0 and strip(other) == strip(reused)
