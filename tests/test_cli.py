"""The command line: listing methods, one-line errors with exit status 2, a tiny run."""

import json

import pytest

from pflalign.cli import main
from pflalign.methods import METHODS

TINY_SET = [
    "--set", "model=tiny-llama", "--set", "lora.r=2", "--set", "rounds=1", "--set", "local_steps=1",
    "--set", "batch_size=2", "--set", "data.max_train=4", "--set", "data.max_test=2",
    "--set", "data.clients=arithmetic,uppercase", "--set", "max_seq_len=64", "--set", "eval.max_new_tokens=2",
]


def test_methods_lists_one_name_per_line(capsys):
    assert main(["methods"]) == 0
    assert capsys.readouterr().out.split() == list(METHODS)
    assert {"pflalign", "fedavg"} <= set(METHODS)


def _error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("pflalign: error:")
    return err


@pytest.mark.parametrize("argv,needle", [
    (["--config", "demoo"], "did you mean 'demo'"),
    (["--config", "demo", "--set", "lora.alhpa=4"], "did you mean 'alpha'"),
    (["--config", "demo", "--set", "lora.rank=4"], "valid keys: r, alpha"),
    (["--config", "demo", "--set", "rounds=0"], "rounds must be > 0"),
    (["--config", "demo", "--set", "lr=-1"], "lr must be > 0"),
    (["--config", "demo", "--set", "method=fedavgg"], "did you mean 'fedavg'"),
    (["--config", "demo", "--set", "method_args.betta=0.5"], "did you mean 'beta'"),
    (["--config", "demo", "--set", "method_args.beta=1.5"], "beta must be in [0, 1)"),
    (["--config", "demo", "--set", "rounds=many"], "expected an integer"),
    (["--config", "demo", "--set", "novalue"], "key=value"),
])
def test_bad_config_is_one_line_exit_2(capsys, tmp_path, argv, needle):
    err = _error(capsys, ["run", *argv, "--out", str(tmp_path / "run")])
    assert needle in err
    assert not (tmp_path / "run").exists()  # nothing written


def test_bad_data_is_one_line_exit_2(capsys, tmp_path):
    flan = tmp_path / "flan"
    flan.mkdir()
    (flan / "local_training_0.json").write_text('[{"instruction": "a", "output": "b", "category": "coreference"}]')
    (flan / "test.jsonl").write_text('{"instruction": "a", "output": "b", "category": "coreference"}\n{oops\n')
    err = _error(capsys, ["run", "--config", "flan-paper", *TINY_SET[:2], "--data-dir", str(flan),
                          "--set", "data.clients=coreference", "--out", str(tmp_path / "run")])
    assert "test.jsonl:2" in err
    err = _error(capsys, ["run", "--config", "flan-paper", "--data-dir", str(tmp_path / "absent"),
                          "--set", "model=tiny-llama", "--out", str(tmp_path / "run")])
    assert "absent" in err
    (flan / "test.jsonl").write_text('{"instruction": "a", "output": "b", "category": "coreference"}\n')
    err = _error(capsys, ["run", "--config", "flan-paper", "--data-dir", str(flan), "--set", "model=tiny-llama",
                          "--set", "data.clients=corefrence", "--out", str(tmp_path / "run")])
    assert "coreference" in err


def test_missing_model_file_exit_2(capsys, tmp_path):
    err = _error(capsys, ["run", "--config", "demo", "--set", f"model={tmp_path / 'm.gguf'}", "--out", str(tmp_path / "r")])
    assert "m.gguf" in err


def test_tiny_run_prints_table_and_writes_results(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--config", "demo", *TINY_SET, "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "arithmetic" in printed and "uppercase" in printed and "average" in printed
    results = json.loads((out / "results.json").read_text())
    assert {c["task"] for c in results["clients"]} == {"arithmetic", "uppercase"}
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == "tiny-llama" and config["lora"]["r"] == 2
    assert _error(capsys, ["run", "--config", "demo", *TINY_SET, "--out", str(out)]).endswith("--overwrite to replace it")
