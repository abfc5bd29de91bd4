"""The Python API: docs/api.md's example runs as written; only the documented names are exported."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_the_documented_example_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], str(DOC), "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] == "['arithmetic', 'sorting', 'uppercase', 'key_value']"
    assert len(eval(printed[2])) == 2  # one loss per round
    assert printed[3] == "runs/api-demo/adapters/arithmetic"
    assert (tmp_path / "runs" / "api-demo" / "adapters" / "arithmetic" / "adapter_model.safetensors").exists()


def test_api_surface_and_errors(tmp_path):
    from pflalign import api
    from pflalign.errors import UserError

    assert api.__all__ == ["config", "run", "load_run", "Run"]
    cfg = api.config(None, {"lora.r": 8, "data": {"name": "synthetic", "max_test": 3}, "method_args.beta": 0.5})
    assert (cfg.lora.r, cfg.data.max_test, cfg.method_args["beta"]) == (8, 3, 0.5)
    with pytest.raises(UserError, match="unknown config key"):
        api.config("demo", {"lora.rank": 8})
    with pytest.raises(UserError, match="no finished run"):
        api.load_run(tmp_path)


def test_run_shows_progress_by_default_and_progress_false_silences_it(tmp_path, capfd):
    """Issue 42: minutes of silence look like a hang; `progress=False` is the switch."""
    from pflalign import api

    cfg = api.config(None, {"model": "tiny-opt", "method": "fedavg", "rounds": 2, "local_steps": 1, "batch_size": 2,
                            "max_seq_len": 64, "lora": {"r": 2, "alpha": 4},
                            "data": {"name": "synthetic", "clients": ["arithmetic", "sorting"], "max_train": 4,
                                     "max_test": 1},
                            "eval": {"max_new_tokens": 2, "base_model": False}})
    capfd.readouterr()
    api.run(cfg, tmp_path / "loud")
    err = capfd.readouterr().err
    assert "rounds: 100%" in err and "2/2" in err, err[-500:]
    api.run(cfg, tmp_path / "quiet", progress=False)
    assert capfd.readouterr().err == ""
