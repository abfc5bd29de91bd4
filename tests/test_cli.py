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
    (["--config", "demo", "--checkpoint-every", "-5"], "--checkpoint-every must be >= 0 seconds, got -5"),
    (["--config", "demo", "--checkpoint-every", "nan"], "--checkpoint-every must be >= 0 seconds"),
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
    assert not (tmp_path / "run").exists()  # nothing written


def test_missing_model_file_exit_2(capsys, tmp_path):
    err = _error(capsys, ["run", "--config", "demo", "--set", f"model={tmp_path / 'm.gguf'}", "--out", str(tmp_path / "r")])
    assert "m.gguf" in err
    assert not (tmp_path / "r").exists()


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


def _mkdir(path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _write(path, content) -> str:
    """Write a test file (text or bytes); its path as a string."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def _bad_input(tmp_path, case):
    """`pflalign run` arguments of one bad input (its files written under tmp_path) and
    the fragments the error line must hold."""
    dolly, flan, gguf = tmp_path / "dolly.jsonl", tmp_path / "flan", tmp_path / "m.gguf"
    good = {"instruction": "a", "context": "", "response": "b", "category": "closed_qa"}

    def dolly_run(*records):
        lines = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
        return ["--set", "data.name=dolly", "--data-dir", _write(dolly, lines), "--set", "data.clients=closed_qa"]

    def without(field):
        return {k: v for k, v in good.items() if k != field}

    def flan_run(training):
        _write(flan / "test.jsonl", "")
        _write(flan / "local_training_0.json", json.dumps(training))
        return ["--set", "data.name=flan", "--data-dir", str(flan), "--set", "data.clients=coreference"]

    cases = {
        "malformed-jsonl-line": (lambda: dolly_run(good, "{oops"), [f"{dolly}:2: not valid JSON"]),
        "missing-instruction": (lambda: dolly_run(good, without("instruction")),
                                [f"{dolly}:2: record has no field 'instruction'"]),
        "missing-response": (lambda: dolly_run(without("response")), [f"{dolly}:1: record has no field 'response'"]),
        "missing-output": (lambda: flan_run([{"instruction": "a", "category": "coreference"}]),
                           [f"{flan / 'local_training_0.json'} item 0: record has no field 'output'"]),
        "category-absent": (lambda: dolly_run({**good, "category": "summarization"}),
                            [f"data.clients: no example in {dolly} has category 'closed_qa' (values there: "
                             "summarization)"]),
        "client-without-training-examples": (lambda: dolly_run(good),  # its one example would be the test split
                                             ["client 'closed_qa' has 1 rows: too few to hold out a test set"]),
        "client-with-too-few-training-examples": (lambda: dolly_run(good, good),  # one test, one to train on
                                                  ["client 0 (closed_qa) has 1 training examples, fewer than "
                                                   "batch_size=2"]),
        "unknown-task": (lambda: ["--set", "data.clients=sortng"],
                         ["no example in the synthetic tasks (generated in code) has category 'sortng'",
                          "Did you mean 'sorting'?"]),
        "unknown-dataset": (lambda: ["--set", "data.name=dolyy"], ["unknown federation 'dolyy'", "Did you mean 'dolly'?"]),
        "lora-rank-zero": (lambda: ["--set", "lora.r=0"], ["lora.r must be > 0, got 0"]),
        "beta-negative": (lambda: ["--set", "method_args.beta=-0.1"], ["method pflalign: beta must be in [0, 1), got -0.1"]),
        "batch-larger-than-data": (lambda: ["--set", "batch_size=8"],
                                   ["client 0 (arithmetic) has 4 training examples, fewer than batch_size=8"]),
        "model-directory-missing": (lambda: ["--set", f"model={tmp_path / 'no-model'}"],
                                    [f"model directory not found: {tmp_path / 'no-model'}"]),
        "model-directory-without-config": (lambda: ["--set", f"model={_mkdir(tmp_path / 'empty-model')}"],
                                           [f"model directory {tmp_path / 'empty-model'} has no config.json"]),
        "gguf-truncated": (lambda: ["--set", "model=" + _write(gguf, b"GGUF\x03\x00\x00\x00\x01")],
                           [f"cannot load model '{gguf}': damaged or truncated GGUF file"]),
        "gguf-not-gguf": (lambda: ["--set", "model=" + _write(gguf, b"PK\x03\x04 a zip, not a model")],
                          [f"cannot load model '{gguf}'", "not a GGUF file"]),
        "dolly-file-missing": (lambda: ["--set", "data.name=dolly", "--data-dir", str(tmp_path / "absent.jsonl")],
                               [f"Dolly data not found: {tmp_path / 'absent.jsonl'}"]),
        "config-file-malformed": (lambda: ["--config", _write(tmp_path / "c.toml", "rounds = = 3\n")],
                                  [f"{tmp_path / 'c.toml'}: cannot parse config"]),
        "resume-with-set": (lambda: ["--resume", "--set", "lr=0.1"], ["--resume continues with the run's saved config"]),
    }
    make, needles = cases[case]
    return make(), needles


@pytest.mark.parametrize("case", [
    "malformed-jsonl-line", "missing-instruction", "missing-response", "missing-output", "category-absent",
    "client-without-training-examples", "client-with-too-few-training-examples", "unknown-task", "unknown-dataset", "lora-rank-zero", "beta-negative",
    "batch-larger-than-data", "model-directory-missing", "model-directory-without-config", "gguf-truncated", "gguf-not-gguf", "dolly-file-missing",
    "config-file-malformed", "resume-with-set",
])
def test_bad_input_table_one_line_exit_2_nothing_written(capsys, tmp_path, case):
    extra, needles = _bad_input(tmp_path, case)
    err = _error(capsys, ["run", *TINY_SET, *extra, "--out", str(tmp_path / "run")])
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "run").exists()


def test_prompts_longer_than_max_seq_len_are_truncated_counted_and_reported(caplog, tmp_path):
    out = tmp_path / "run"
    assert main(["run", *TINY_SET, "--set", "max_seq_len=8", "--out", str(out), "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["truncated_train_examples"] == 8  # every one of the 2 x 4 training examples
    assert "8 training examples exceeded max_seq_len=8 and were truncated" in caplog.messages


def test_a_reader_that_leaves_early_gets_no_traceback(monkeypatch):
    """`pflalign methods -l | head -1`: the pipe closes before the list is written (a stdout whose
    write fails so, and which has a real file descriptor for the redirect)."""
    import io
    import os
    import sys

    from pflalign.cli import main

    read, write = os.pipe()

    class ClosedPipe(io.TextIOWrapper):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    out = ClosedPipe(io.FileIO(write, "w", closefd=False))
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["methods", "-l"]) == 141  # no exception: the shell's code for a closed pipe
    os.close(read), os.close(write)
