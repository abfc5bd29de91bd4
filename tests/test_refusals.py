"""Issue 20: inputs and faults that ended in a traceback (or were accepted silently) now end in
one line on stderr and exit status 2, before anything is written or loaded for long."""

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pflalign import checkpoint as ckpt
from pflalign.cli import main
from pflalign.run.adapter_folder import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from pflalign.run.export import ADAPTERS

from test_cli import TINY_SET, _error

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("extra,needle", [
    (["--set", "lora.dropout=2"], "lora.dropout must be in [0, 1), got 2.0"),
    (["--set", "lora.dropout=-1"], "lora.dropout must be in [0, 1), got -1.0"),
    (["--set", "lora.target_modules=[]"], "lora.target_modules must name at least one module"),
    (["--set", 'lora.target_modules=["nomodule"]'], "lora.target_modules ['nomodule']"),
    (["--set", "seed=-1", "--set", "participation=0.5"], "seed must be in [0, 2**32), got -1"),
    (["--set", f"seed={2**70}", "--set", "participation=0.5"], "seed must be in [0, 2**32)"),
    (["--set", "method=fedprox", "--set", "method_args.mu=NaN"], "method_args.mu must be a finite number, got nan"),
    (["--set", "lora.alpha=Infinity"], "lora.alpha must be a finite number"),
    (["--set", "max_seq_len=100000"], "max_seq_len=100000 exceeds the model's 2048 positions"),
    (["--stop-after-rounds", "-1"], "--stop-after-rounds must be >= 1, got -1"),
    (["--set", "dtype=float16"], "dtype=float16 on the CPU"),  # issue 41: was accepted, and ignored by tiny models
])
def test_bad_value_is_one_line_exit_2_nothing_written(capsys, tmp_path, extra, needle):
    err = _error(capsys, ["run", *TINY_SET, *extra, "--out", str(tmp_path / "run")])
    assert needle in err, err
    assert not (tmp_path / "run").exists()


def test_config_holding_a_json_list_is_refused(capsys, tmp_path):
    (tmp_path / "c.json").write_text("[1, 2]")
    err = _error(capsys, ["run", "--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "run")])
    assert "a config must be a table of keys, got a JSON list" in err


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_safetensors_model_is_refused(capsys, tmp_path, damage):
    from pflalign.model import _tiny_model

    model, tok = _tiny_model("tiny-llama")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"garbage" * 10)
    capsys.readouterr()  # save_pretrained's progress bar
    err = _error(capsys, ["run", *TINY_SET, "--set", f"model={folder}", "--out", str(tmp_path / "run")])
    assert "damaged or truncated safetensors file" in err
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped (checkpointed) after round 1 of 3."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert main(["run", *TINY_SET, "--set", "rounds=3", "--out", str(out), "--stop-after-rounds", "1",
                 "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("damage,needle", [
    ("missing", "config.json is missing"),
    ("corrupt", "config.json is damaged"),
    ("list", "config.json is damaged"),
])
def test_resume_with_a_missing_or_corrupt_config_is_refused(capsys, stopped_run, tmp_path, damage, needle):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    if damage == "missing":
        (out / "config.json").unlink()
    else:
        (out / "config.json").write_text('{"rounds": 3, "lora": {' if damage == "corrupt" else "[]")
    err = _error(capsys, ["run", "--out", str(out), "--resume"])
    assert needle in err and "cannot be resumed" in err


def test_a_file_size_limit_while_saving_names_the_file_and_keeps_the_checkpoint(capsys, stopped_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    size = (out / ckpt.CHECKPOINT).stat().st_size
    before = (out / ckpt.CHECKPOINT).read_bytes()
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))

    done = subprocess.run([sys.executable, "-m", "pflalign", "run", "--out", str(out), "--resume", "--no-progress"],
                          env=env, preexec_fn=limit, capture_output=True, text=True, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    # the first file over the limit: client 0's state after round 2 (its own file since issue 21)
    assert err[-1].startswith("pflalign: error: cannot write") and "clients/0.r2.safetensors" in err[-1]
    assert "the previous checkpoint (after round 1) is intact" in err[-1] and "--resume" in err[-1]
    assert not any("Traceback" in line for line in err)
    assert (out / ckpt.CHECKPOINT).read_bytes() == before
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 0  # with room again it finishes


# ---- issue 41, items 2 and 7: a full disk at the final adapters, out of memory ----------------
@pytest.mark.parametrize("failing", [ADAPTER_CONFIG, ADAPTER_WEIGHTS])
def test_a_full_disk_while_the_final_adapters_are_written_is_one_line_and_resumes(capsys, tmp_path, monkeypatch,
                                                                                 failing):
    from peft import LoraConfig

    def no_room(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a failed write() raises it: no file name

    if failing == ADAPTER_CONFIG:
        monkeypatch.setattr(LoraConfig, "save_pretrained", no_room)
    else:
        write_bytes = Path.write_bytes
        monkeypatch.setattr(Path, "write_bytes", lambda self, data: no_room() if self.name == failing
                            else write_bytes(self, data))
    out = tmp_path / "run"
    err = _error(capsys, ["run", *TINY_SET, "--out", str(out), "--no-progress"])
    assert err.startswith(f"pflalign: error: cannot write {out / ADAPTERS / 'global' / failing}: No space left on "
                          "device; "), err
    assert "the checkpoint after round 1 is intact; free some space, then continue with --resume" in err, err
    assert not (out / ckpt.RESULTS).exists() and not (out / ADAPTERS).exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(".adapters")] == []  # no half-written folder
    monkeypatch.undo()
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert sorted(p.name for p in (out / ADAPTERS).iterdir()) == ["arithmetic", "global", "uppercase"]
    assert all((out / ADAPTERS / name / ADAPTER_WEIGHTS).is_file() for name in ("arithmetic", "global", "uppercase"))


@pytest.mark.parametrize("where", ["training", "scoring"])
def test_out_of_memory_is_one_line_naming_the_sizes_and_the_checkpoint_resumes(capsys, tmp_path, monkeypatch, where):
    import torch

    from pflalign.run import jobs

    args = ["run", *TINY_SET, "--set", "rounds=2", "--no-progress", "--out"]
    if where == "training":  # CUDA's allocator in client 0's second round (round index 1)
        local_round = jobs.local_round

        def step(*a, **k):
            if a[7] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return local_round(*a, **k)

        monkeypatch.setattr(jobs, "local_round", step)
        needle, kept = ("out of memory training client 0 (arithmetic) with batch_size=2, max_seq_len=64, model "
                        "tiny-llama: lower batch_size or max_seq_len"), 1
    else:  # a CPU MemoryError in the final evaluation
        def score(*a, **k):
            raise MemoryError()

        monkeypatch.setattr(jobs, "score_client", score)
        needle, kept = ("out of memory scoring client 0 (arithmetic)'s personalized model with eval.batch_size=", 2)
    out = tmp_path / "run"
    err = _error(capsys, [*args, str(out)])
    assert needle in err and "model tiny-llama" in err, err
    assert f"the checkpoint after round {kept} is kept: free memory and continue with --resume" in err, err
    assert not (out / ckpt.RESULTS).exists()
    monkeypatch.undo()
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert main([*args, str(tmp_path / "uninterrupted")]) == 0
    resumed, ref = (ckpt.load_run_checkpoint(d)["global"] for d in (out, tmp_path / "uninterrupted"))
    assert all(torch.equal(resumed[n], ref[n]) for n in ref)


# ---- sweep and report on damaged results ----------------------------------------------------
SWEEP = """
methods = ["fedavg"]
seeds = [0]
[base]
model = "tiny-llama"
lora = { r = 2, alpha = 4 }
rounds = 1
local_steps = 1
batch_size = 2
max_seq_len = 64
eval = { max_new_tokens = 2, batch_size = 4, base_model = false }
[[datasets]]
name = "synth"
set = { data = { clients = ["arithmetic", "sorting"], max_train = 4, max_test = 2 } }
"""


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    (root / "sweep.toml").write_text(SWEEP)
    assert main(["sweep", "--config", str(root / "sweep.toml"), "--out", str(root / "out"), "--no-progress"]) == 0
    return root


DAMAGED_RESULTS = {
    "truncated": (lambda text: text[: len(text) // 2], "not valid JSON"),
    "not-utf8": (lambda text: b"\xff\xfe" + text.encode(), "not UTF-8"),
    "empty-list": (lambda text: "[]", "expected a JSON object"),
    "no-clients": (lambda text: json.dumps({**json.loads(text), "clients": []}), "no clients"),
    "null-score": (lambda text: json.dumps({**json.loads(text), "clients": [
        {**c, "rouge_l_personalized": None} for c in json.loads(text)["clients"]]}), "has no personalized score"),
    "null-average": (lambda text: json.dumps({**json.loads(text), "avg_rouge_l_personalized": None}),
                     "no average personalized score"),
}


@pytest.mark.parametrize("damage", list(DAMAGED_RESULTS))
def test_sweep_and_report_on_damaged_results(capsys, finished_sweep, tmp_path, damage):
    root = tmp_path / "sweep"
    shutil.copytree(finished_sweep, root)
    results = root / "out" / "synth" / "fedavg" / "seed0" / ckpt.RESULTS
    change, needle = DAMAGED_RESULTS[damage]
    new = change(results.read_text())
    results.write_bytes(new if isinstance(new, bytes) else new.encode())
    err = _error(capsys, ["sweep", "--config", str(root / "sweep.toml"), "--out", str(root / "out"), "--no-progress"])
    assert needle in err and "--overwrite" in err
    err = _error(capsys, ["report", str(root / "out"), "--out", str(tmp_path / "report")])
    assert "no finished runs" in err and needle in err


def test_sweep_dry_run_says_the_sweep_stops_on_damaged_results_here_and_under_done(capsys, finished_sweep,
                                                                                    tmp_path):
    """Issue 41, item 4: --dry-run listed a run with a truncated results.json as finished."""
    root = tmp_path / "sweep"
    shutil.copytree(finished_sweep, root)
    run = root / "out" / "synth" / "fedavg" / "seed0"
    assert main(["sweep", "--config", str(root / "sweep.toml"), "--out", str(root / "out"), "--dry-run"]) == 0
    assert "finished" in capsys.readouterr().out  # intact: skipped, with its score
    kept = tmp_path / "kept" / "synth" / "fedavg" / "seed0"  # the same run as a --done copy
    shutil.copytree(run, kept)
    for results, args in [(run / ckpt.RESULTS, ["--out", str(root / "out")]),
                          (kept / ckpt.RESULTS, ["--out", str(tmp_path / "fresh"), "--done", str(tmp_path / "kept")])]:
        results.write_text(results.read_text()[:40])  # truncated
        assert main(["sweep", "--config", str(root / "sweep.toml"), *args, "--dry-run"]) == 2
        printed = capsys.readouterr()
        err = printed.err.strip()
        assert len(err.splitlines()) == 1 and "synth/fedavg/seed0" in printed.out and " damaged " in printed.out
        assert "the sweep would run 0 runs, then stop at synth/fedavg/seed0" in err and "not valid JSON" in err, err
        assert ("--overwrite" in err) if "--done" not in args else ("under --done" in err)
    assert not (tmp_path / "fresh").exists()


def test_report_on_a_half_finished_sweep_lists_the_unfinished_runs(capsys, finished_sweep, stopped_run, tmp_path):
    root = tmp_path / "sweep"
    shutil.copytree(finished_sweep, root)
    shutil.copytree(stopped_run, root / "out" / "synth" / "pflalign" / "seed0")
    report = Path(main(["report", str(root / "out"), "--out", str(tmp_path / "report")]) and "" or
                  tmp_path / "report" / "report.md").read_text()
    assert "## Left out" in report
    assert "synth/pflalign/seed0: left out, unfinished (checkpoint after round 1 of 3)" in report


# ---- item 5: resume says what it could not verify ---------------------------------------------
def test_resume_without_metrics_is_refused(capsys, stopped_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    (out / ckpt.METRICS).unlink()
    err = _error(capsys, ["run", "--out", str(out), "--resume"])
    assert "metrics.jsonl is missing" in err and "round 1" in err
    assert not (out / ckpt.METRICS).exists() and not (out / ckpt.RESULTS).exists()


def test_resume_with_metrics_of_another_run_is_refused(capsys, stopped_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    lines = (out / ckpt.METRICS).read_text().splitlines(keepends=True)
    (out / ckpt.METRICS).write_text("".join(lines[:-1]) + lines[-1].replace('"round": 0', '"round": 7') + "padding\n")
    err = _error(capsys, ["run", "--out", str(out), "--resume"])
    assert "does not match the checkpoint" in err


def test_resume_without_the_manifest_says_so_and_refuses_a_damaged_tensor(capsys, caplog, stopped_run, tmp_path):
    import torch

    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    (out / ckpt.MANIFEST).unlink()
    payload = ckpt.load_checkpoint(out / ckpt.CHECKPOINT)
    tensor = next(iter(payload["global"].values()))
    tensor.view(-1)[0] = float("nan")  # a bit flip in an exponent
    ckpt.save_checkpoint(out / ckpt.CHECKPOINT, payload)
    err = _error(capsys, ["run", "--out", str(out), "--resume"])
    assert "holds NaN or Inf" in err and "checkpoint.json is missing" in err
    assert any("loaded unverified" in m for m in caplog.messages)


def test_report_into_a_file_is_refused(capsys, finished_sweep, tmp_path):
    (tmp_path / "afile").write_text("mine")
    err = _error(capsys, ["report", str(finished_sweep / "out"), "--out", str(tmp_path / "afile")])
    assert "is a file, not a folder" in err and (tmp_path / "afile").read_text() == "mine"


def test_safetensors_full_disk_text_becomes_the_disk_full_line(tmp_path):
    """safetensors' writer (a merged model's weights) reports a full disk as text, not an OSError."""
    from pflalign.run.export import _replace_folder

    def write(tmp):
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(ckpt.DiskFull, match=f"cannot write {tmp_path / 'm'}: No space left on device"):
        _replace_folder(tmp_path / "m", write)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["--set", "lr=abc"], ["--set", "lorra.r=8"], ["--set", "data.partition=dirichlet"],
                                  ["--set", "method=fedavgg"], ["--method", "fedavgg"]])
def test_a_config_mistake_is_reported_before_torch_or_transformers_load(args, tmp_path):
    """Issue 42: `pflalign run` checks the config before it imports the engine (torch and
    transformers: 4 s quiet, 25 s under load, before the error line)."""
    probe = ("import sys\nfrom pflalign.cli import main\ncode = main(sys.argv[1:])\n"
             "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", probe, "run", *args, "--out", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False", "False"], (done.stdout, done.stderr)
    assert done.stderr.startswith("pflalign: error: ") and len(done.stderr.strip().splitlines()) == 1
    if "fedavgg" in args[-1]:
        assert "unknown method 'fedavgg' (did you mean 'fedavg'?)" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_method_typo_in_a_sweep_file_is_reported_before_torch_loads(tmp_path):
    """Issue 42: `pflalign sweep` reads the sweep file's method names against settings.METHOD_NAMES
    before checkpoint, the methods or the report (torch) are imported."""
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('methods = ["fedavg", "pflalgn"]\nseeds = [0]\n'
                     '[[datasets]]\nname = "synthetic"\nconfig = "demo"\n')
    probe = ("import sys\nfrom pflalign.cli import main\ncode = main(sys.argv[1:])\n"
             "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", probe, "sweep", "--config", str(sweep), "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False", "False"], (done.stdout, done.stderr)
    assert "unknown method 'pflalgn' (did you mean 'pflalign'?)" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
