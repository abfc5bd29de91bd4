"""benchmarks/gpu.py (issue 39's device check) on CPU with tiny shapes: every section runs and
writes what the GPU run will write; its FLOP count and bill are checked by hand."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import pytest

from test_pinned_results import PINS, digest, numerics_fingerprint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_flops_by_hand(gpu):
    params = {"base_linear": 10, "lora": 2, "head": 3}
    config = types.SimpleNamespace(hidden_size=4, num_hidden_layers=2)
    flops = gpu.train_flops(params, config, batch=1, seq=5)
    # per token: 4*10 (frozen: forward + input gradient) + 6*2 (LoRA: + weight gradient)
    # + 4*3 (frozen head) + 6*L*T*H = 6*2*5*4 (causal attention, forward + backward)
    assert flops["total"] == 5 * (40 + 12 + 12 + 240)


def test_bill_by_hand(gpu):
    row = {"train": {"seq": 1024, "step_seconds": 0.5}, "train_short": {"seq": 256, "step_seconds": 0.2},
           "generate": {"tokens_per_s": 1000.0}}
    out = gpu.bill({"llama-3.2-1b": row, "opt-1.3b": row})
    flan, dolly = out["llama-3.2-1b"]["flan"], out["llama-3.2-1b"]["dolly"]
    assert flan["train_minutes"] == pytest.approx(50 * 5 * 4 * 0.2 / 60)
    assert dolly["train_minutes"] == pytest.approx(50 * 5 * 4 * 0.5 / 60)
    assert flan["eval_minutes"] == pytest.approx(800 * 3 * 128 / 1000 / 60)
    assert dolly["eval_minutes"] == pytest.approx(662 * 3 * 128 / 1000 / 60)
    # Table 1: 3 seeds x (10 methods + FedSAM's two gradients) x 1000 steps; 33 x 2 models + the base once
    assert out["llama-3.2-1b"]["table1_flan_hours"] == pytest.approx(
        (3 * 12 * 1000 * 0.2 + 67 * 800 * 128 / 1000) / 3600)
    assert out["llama-3.2-1b"]["table1_dolly_hours"] == pytest.approx(
        (3 * 12 * 1000 * 0.5 + 67 * 662 * 128 / 1000) / 3600)


def test_batched_bill_by_hand(gpu):
    rates = {"1": {"tokens_per_s": 1000.0}, "4": {"tokens_per_s": 2000.0}, "44": {"tokens_per_s": 8000.0}}
    out = gpu.bill_batched({"smollm2-135m": {"dolly": rates}}, {"smollm2-135m": {"generate": {"tokens_per_s": 500.0}}})
    row = out["smollm2-135m dolly"]
    tokens, sam = 4 * 1024, 250 * 3 * 4 * 4 * 1024 / 1000  # one client's step; FedSAM's second gradients alone
    eval_s = 67 * 662 * 128 / 500
    assert row["adapters_per_pass_measured"] == 44
    assert row["clients_minutes"] == pytest.approx((250 * 33 * 4 * tokens / 2000 + sam + eval_s) / 60)
    assert row["runs_minutes"] == pytest.approx((250 * 33 * 4 * tokens / 8000 + sam + eval_s) / 60)
    assert "error" in out["llama-3.2-1b flan"]  # no figures, no projection
    assert row["eval_from"] == "speed.generate (64 rows)" and row["eval_minutes_by_mode"] == {}
    # with one run's scoring measured: 33 runs and half a run (the base once) at each mode's seconds,
    # scaled from SCORING_NEW_TOKENS (32) to 128 new tokens; the fastest mode in the totals
    scored = {"one_at_a_time_rows64": {"seconds": 40.0}, "one_loop_rowsauto": {"seconds": 8.0},
              "one_at_a_time_rowsauto": {"error": "skipped"}}
    out = gpu.bill_batched({"smollm2-135m": {"dolly": rates}}, {}, {"smollm2-135m dolly": scored})
    row = out["smollm2-135m dolly"]
    assert row["eval_minutes_by_mode"] == {"one_at_a_time_rows64": pytest.approx(33.5 * 40 * 4 / 60),
                                           "one_loop_rowsauto": pytest.approx(33.5 * 8 * 4 / 60)}
    assert row["eval_from"] == "one_loop_rowsauto"
    assert row["runs_minutes"] == pytest.approx((250 * 33 * 4 * tokens / 8000 + sam + 33.5 * 8 * 4) / 60)
    # with the updates measured: every client step's GSNR sums in 33 runs, pFLAlign's update in 3
    work = {"gsnr_sums_flat": {"ms": 2.0}, "pflalign_step_flat": {"ms": 5.0}}
    out = gpu.bill_batched({"smollm2-135m": {"dolly": rates}}, {}, {"smollm2-135m dolly": scored},
                           {"smollm2-135m": work})
    updates = 250 * 4 * (33 * 2.0 + 3 * 5.0) / 1e3
    assert out["smollm2-135m dolly"]["updates_minutes"] == pytest.approx(updates / 60)
    assert out["smollm2-135m dolly"]["runs_minutes"] == pytest.approx(row["runs_minutes"] + updates / 60)
    # with the records measured: in memory for the whole table, plus per minute of the rest one
    # checkpoint and 4 clients' files written, at the methods' mean
    kept = {"pflalign": {"files_s": 0.6, "files_save_s": 0.4, "checkpoint_s": 0.1},
            "fedavg": {"files_s": 0.2, "files_save_s": 0.1, "checkpoint_s": 0.1},
            "table1": {"in_memory_minutes": 1.5, "every_round_minutes": 20.0}}
    with_records = gpu.bill_batched({"smollm2-135m": {"dolly": rates}}, {}, {"smollm2-135m dolly": scored},
                                    {"smollm2-135m": work}, {"smollm2-135m": kept})["smollm2-135m dolly"]
    rest = out["smollm2-135m dolly"]["runs_minutes"]
    assert with_records["runs_minutes"] == pytest.approx(rest + 1.5 + rest * (0.1 + 4 * 0.25) / 60)
    assert with_records["records_minutes_every_round"] == 20.0


def test_the_script_runs_on_cpu(gpu, tmp_path, monkeypatch):
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--out", str(out), "--methods", "fedavg"]) == 0
    report = json.loads(out.read_text())
    for name in ("matmul_peak", "correctness", "speed", "bill"):
        assert "error" not in report[name], report[name]
    assert report["matmul_peak"]["tflops"] > 0
    fp32, bf16 = report["correctness"]["float32"]["fedavg"], report["correctness"]["bfloat16"]["fedavg"]
    # float32 within RTOL_FP32; bit for bit on the CPU kind the reference was made on (on another,
    # e.g. an AMD EPYC host, 2026-11-27, kernels round differently: 3e-7 relative)
    assert fp32["pass"]
    reference = json.loads(gpu.REFERENCE.with_suffix(".json").read_text())
    if numerics_fingerprint() == reference["cpu_host"]:
        assert fp32["max_rel_diff_loss"] == 0 and fp32["max_rel_diff_global_adapter"] == 0
    # bfloat16 really ran in bfloat16 (not equal to float32), close, and the adapter stayed float32
    assert bf16["pass"] and 0 < bf16["max_rel_diff_global_adapter"] <= gpu.RTOL_BF16
    assert bf16["adapter_and_server_state_dtypes"] == ["torch.float32"]
    assert bf16["client_state_dtypes"] == ["torch.float32"]
    for name in gpu.ARCHS:
        row = report["speed"][name]
        assert "error" not in row, row
        assert row["base_dtype"] == "torch.bfloat16" and row["lora_dtype"] == "torch.float32"
        assert row["train"]["tokens_per_s"] > 0 and row["train"]["losses_finite"]
        assert row["generate"]["tokens_per_s"] > 0 and row["generate"]["rows"] == 4
    assert report["speed"]["llama-3.2-1b"]["train_profile"]["top"][0]["ms"] > 0
    assert report["bill"]["llama-3.2-1b"]["table1_flan_hours"] > 0
    # the HF + PEFT anchor: each shape timed both ways, set beside pflalign's step on the same
    # weights and batch (B = 0 at the start in both: the same function, so the same first loss)
    # clients in lockstep: every K timed at both shapes, all in one pass on a CPU
    for name in gpu.BATCHED_ARCHS:
        for shape in ("flan", "dolly"):
            per = report["batched"][name][shape]
            assert sorted(map(int, per)) == [1, 4, 12], per
            for k, row in per.items():
                assert row["tokens_per_s"] > 0 and row["losses_finite"] and row["clients_per_pass"] == int(k)
            assert per["12"]["batch"] == 12 * 2 and per["12"]["over_one_adapter"] > 0
    assert report["bill_batched"]["smollm2-135m dolly"]["runs_minutes"] > 0
    # updates: the same work tensor by tensor and over flat buffers, far fewer operations flat
    for name in gpu.BATCHED_ARCHS:
        row = report["updates"][name]
        assert "error" not in row, row
        for what in ("pflalign_step", "gsnr_sums"):
            assert row[f"{what}_flat"]["ops"] < row[f"{what}_tensor_by_tensor"]["ops"] / 2
            assert row[f"{what}_flat"]["ms"] > 0 and row[f"{what}_tensor_by_tensor_over_flat"] > 0
    # scoring: one run's jobs (4 clients' personalized and the global model over each client's
    # prompts) one merged model after another and in one loop, at 64 and auto rows (64 on a CPU)
    for case in ("smollm2-135m dolly", "llama-3.2-1b flan"):
        row = report["scoring"][case]
        assert "error" not in row, row
        assert row["jobs"] == 8 and row["prompts"] == 8 * 3
        for mode, rows in gpu.SCORING_MODES:
            assert row[f"{mode}_rows{rows}"]["tokens_per_s"] > 0 and row[f"{mode}_rows{rows}"]["rows"] == 64
    assert report["bill_batched"]["smollm2-135m dolly"]["eval_from"] in [f"{m}_rows{r}" for m, r in gpu.SCORING_MODES]
    # files: a client's record through its file and kept in memory, and the checkpoint, per method
    for method in ("pflalign", "fedavg"):
        cells = report["files"]["smollm2-135m"][method]
        assert cells["files_s"] > 0 and cells["memory_s"] > 0 and cells["checkpoint_s"] > 0
    assert report["files"]["smollm2-135m"]["pflalign"]["file_mb"] == pytest.approx(4 * 19.54, rel=1e-3)
    assert report["bill_batched"]["smollm2-135m dolly"]["records_minutes"] > 0
    anchor = report["hf_anchor"]
    assert len(anchor) == len(gpu.HF_SHAPES)
    for key, row in anchor.items():
        assert "error" not in row, (key, row)
        assert row["plain"]["tokens_per_s"] > 0 and row["autocast"]["losses_finite"]
        assert row["pflalign_over_best_hf"] > 0
        assert row["first_loss_rel_diff"] < 2e-2, (key, row)


def test_the_eval_batch_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/gpu_eval_batch.py at toy sizes: one timing per batch size, every row answered."""
    import subprocess
    import sys

    out = tmp_path / "b.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_eval_batch.py"), "--device", "cpu",
                           "--out", str(out)], env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted(map(int, rows)) == [4, 8]
    assert all(r["tokens_per_s"] > 0 and r["rows"] == int(k) for k, r in rows.items())


def test_the_tree_a_gpu_call_takes_stays_well_inside_its_limit():
    """A lent GPU machine takes the tracked tree in one call, at most 64 MiB with whatever the call
    carries (wheels, data). Committed runs are most of the tree, so they keep their JSON lines
    gzipped (docs/results/keep-run.sh): a run committed plain, or a tree past 48 MiB, fails here
    instead of at the next device call. (At 61.8 MB it had 5 MB left; gzipped, 19 MB.)"""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    names = [name for name in listed.decode().split("\0") if name]
    plain = [name for name in names if name.startswith("docs/results/") and name.endswith(".jsonl")]
    assert not plain, f"commit runs with docs/results/keep-run.sh (JSON lines gzipped): {plain[:3]}"
    size = sum((ROOT / name).stat().st_size for name in names if (ROOT / name).is_file())
    assert size < 48 * 2**20, f"the tracked tree is {size / 2**20:.1f} MiB; a device call takes 64 MiB in all"


def test_the_reference_names_the_cpu_kind_it_was_made_on(gpu):
    """Its adapters hash to that kind's pins (tests/pinned_results.json): the host the bit-for-bit
    check above trusts is the one the reference came from."""
    from safetensors.torch import load_file

    reference = json.loads(gpu.REFERENCE.with_suffix(".json").read_text())
    pins = json.loads(PINS.read_text())["hosts"][reference["cpu_host"]]["in_process"]
    tensors = load_file(str(gpu.REFERENCE.with_suffix(".safetensors")))
    methods = [m for m in reference if m != "cpu_host"]
    assert methods == ["pflalign", "fedavg", "scaffold", "fedsa-lora"]
    for method in methods:
        adapter = {n.split("/", 1)[1]: t for n, t in tensors.items() if n.startswith(f"{method}/")}
        assert digest(adapter) == pins[method]["global"], method
        assert reference[method]["global_adapter_hash_equals_pin"]
