"""One device check: correctness on CUDA, speed at the paper's shapes, and the bill (issue 39).

    PYTHONPATH=src python3 benchmarks/gpu.py --out benchmarks/results/gpu.json   # on one GPU, < 8 min
    PYTHONPATH=src python3 benchmarks/gpu.py --device cpu --out /tmp/gpu.json    # tiny shapes (the test)

Sections, each wrapped so that one failing records its error in the JSON and the rest still run:

* ``matmul_peak``: the machine's bf16 matmul rate, measured here (8192^3, mean of 10 after 3
  warm-ups): the denominator of every utilisation figure below.
* ``correctness``: the pinned tiny configurations (tests/test_pinned_results.py: the federation
  of tests/test_engine.py's TINY, 2 rounds) of pFLAlign, FedAvg, SCAFFOLD and FedSA-LoRA through
  `pflalign.run.engine.run` on the device, in float32 with TF32 off, against the CPU results in
  benchmarks/results/gpu_reference.* (written on CPU by ``--write-reference``, which records
  whether its adapters hash to tests/pinned_results.json's pins): every train-step loss and the final global
  adapter within RTOL_FP32 relative; then the same in bfloat16 (frozen base in bf16, adapters
  and method state float32): finite, adapters still float32, within RTOL_BF16.
* ``speed``: LLaMA-3.2-1B-Instruct, OPT-1.3B and SmolLM2-135M built from their configurations
  (written below) with random weights, bf16 base, LoRA r16 alpha32 on every linear layer through
  `pflalign.model.FederatedLM.from_base` (the project's own LoRA path), batch 4 x 1024 and
  4 x 256 tokens: training step time, tokens/s, peak memory, achieved TFLOP/s (`train_flops`)
  and its share of the measured peak, one profiled step's top kernels (LLaMA); greedy
  generation tokens/s at the evaluation's batch (64 rows, 128 new tokens,
  `pflalign.evaluate.greedy_ids` on the merged adapter, as the final evaluation runs).
* ``hf_anchor``: the loop a user would write (issue 55): the same bases through PEFT's LoRA
  (r16 alpha32, all linear layers, float32 adapters) and ``torch.optim.SGD``, plain bf16 and under
  ``torch.autocast(bfloat16)`` as the HF Trainer's ``bf16=True``, at LLaMA 4 x 1024 and 4 x 256,
  OPT and SmolLM2 4 x 1024: tokens/s, and ``pflalign_over_best_hf`` against the ``speed`` rows.
* ``batched``: clients in lockstep (issue 55): SmolLM2-135M and LLaMA-3.2-1B with 1, 4, 12 and
  44 adapters, FLAN-shaped (4 x 256) and Dolly-shaped (4 x 1024) minibatches each: tokens/s, share
  of the peak, peak memory, adapters per pass, gain over one adapter (`batched`).
* ``updates``: a client's work per local step outside the pass, pFLAlign's update and the GSNR
  sums, tensor by tensor against once over flat buffers: ms and operations dispatched (`updates`).
* ``scoring``: one run's final scoring at the protocol's test splits (SmolLM2-135M on Dolly,
  LLaMA-3.2-1B on FLAN): one merged model after another at 64 rows and at ``auto`` rows, and
  every model in one loop with per-row adapters at ``auto`` (`scoring`).
* ``bill``: the projected device time of one FLAN and one Dolly run at the paper's protocol and
  of each 33-run Table 1, from those figures (`bill`); ``bill_batched``: a Table 1 in lockstep,
  clients of a run (built) and all runs' clients (projected) (`bill_batched`).

``--budget-s`` (420) skips what has not started by then; the correctness runs start within
their first 240 s. Without rouge-score the correctness runs score ROUGE-L as 0 and say so.

``--device cpu`` runs every section with tiny shapes (2-layer versions of the three
architectures, 2 x 64 tokens, a 256^3 matmul) so that tests/test_gpu_script.py covers the script.
What it imports is in the GPU image (torch, transformers, peft, safetensors, tokenizers, numpy,
tqdm, pytest for tests/test_engine.py's TINY) except the final evaluation's ROUGE-L: rouge-score,
nltk and defusedxml, carried as wheels (benchmarks/gpu_wheels.sh; checked on CPU with gguf,
datasets, flwr, flwr-datasets, nltk, rouge-score and mimalloc made unimportable).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "benchmarks" / "results" / "gpu_reference"  # .json (losses, scores) + .safetensors (adapters)
METHODS = ["pflalign", "fedavg", "scaffold", "fedsa-lora"]
RTOL_FP32 = 1e-5  # the target: CUDA float32 equal to CPU within 1e-5 relative
RTOL_BF16 = 5e-2  # bf16 keeps 8 mantissa bits (~4e-3 per rounding): losses and adapters within 5%

# The paper's models as their Hugging Face configurations give them (config.json of
# meta-llama/Llama-3.2-1B-Instruct, facebook/opt-1.3b, HuggingFaceTB/SmolLM2-135M-Instruct).
ARCHS = {
    "llama-3.2-1b": {
        "family": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
    },
    "opt-1.3b": {
        "family": "opt", "vocab_size": 50272, "hidden_size": 2048, "ffn_dim": 8192, "num_hidden_layers": 24,
        "num_attention_heads": 32, "max_position_embeddings": 2048, "word_embed_proj_dim": 2048,
        "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True,
        "tie_word_embeddings": True, "dropout": 0.0, "attention_dropout": 0.0,
        "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
    },
    "smollm2-135m": {
        "family": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    },
}

# The paper's protocol (config.py's flan-paper / dolly-paper, sweep.py's table1 presets)
ROUNDS, LOCAL_STEPS, CLIENTS, BATCH, SEQ = 50, 5, 4, 4, 1024
SHORT_SEQ = 256  # FLAN: prompt + response at most ~250 tokens, so its padded batches are this wide at most
EVAL_BATCH, EVAL_NEW_TOKENS = 64, 128
TEST_PROMPTS = {"flan": 4 * 200, "dolly": 214 + 178 + 151 + 119}  # docs/reproduce.md
MODELS_SCORED = 3  # personalized, global, base (eval.base_model=true, the default)
TABLE1_RUNS = 33  # 11 methods x 3 seeds (sweep.py's table1-flan and table1-dolly)
TABLE1_GRADIENTS = 3 * (10 + 2)  # per step: FedSAM takes two gradients, the other 10 methods one


CORRECTNESS_BUDGET_S = 240  # the tiny runs start within this; the speed section needs ~2 min
DEADLINE = math.inf  # time.time() after which the remaining runs are skipped (--budget-s)


def out_of_time() -> bool:
    return time.time() > DEADLINE


def log(msg: str) -> None:
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def strict_fp32() -> dict:
    """TF32 off everywhere (else CUDA float32 matmuls round to 10 mantissa bits and cannot
    match the CPU within 1e-5); returns the settings as read back (each guarded: torch 2.9+
    spells them `fp32_precision`, and some releases refuse a mix of the two spellings)."""
    readings = {}
    for name, setter in (("matmul.allow_tf32", lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", False)),
                         ("cudnn.allow_tf32", lambda: setattr(torch.backends.cudnn, "allow_tf32", False)),
                         ("float32_matmul_precision", lambda: torch.set_float32_matmul_precision("highest"))):
        try:
            setter()
        except Exception as exc:  # noqa: BLE001
            readings[f"set {name}"] = f"{type(exc).__name__}: {exc}"
    for label, backend in (("backends", torch.backends), ("matmul", torch.backends.cuda.matmul),
                           ("cudnn", torch.backends.cudnn)):
        if hasattr(backend, "fp32_precision"):
            try:
                backend.fp32_precision = "ieee"
                readings[f"{label}.fp32_precision"] = backend.fp32_precision
            except Exception as exc:  # noqa: BLE001
                readings[f"{label}.fp32_precision"] = f"{type(exc).__name__}: {exc}"
    for name, read in (("matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                       ("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
                       ("float32_matmul_precision", torch.get_float32_matmul_precision)):
        try:
            readings[name] = read()
        except Exception as exc:  # noqa: BLE001
            readings[name] = f"{type(exc).__name__}: {exc}"
    return readings


def section(report: dict, name: str, fn, *args) -> None:
    """Run one section; its error (type, message, traceback tail) goes into the report."""
    log(f"section {name}")
    start = time.time()
    try:
        report[name] = fn(*args)
    except Exception as exc:  # noqa: BLE001  (recorded, the next section runs)
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        log(f"section {name} FAILED: {type(exc).__name__}: {exc}")
    report.setdefault("seconds", {})[name] = round(time.time() - start, 1)


# --- the matmul peak ------------------------------------------------------------------------

def matmul_peak(device: str, n: int) -> dict:
    """bf16 n^3 matrix product on random data: mean TFLOP/s of 10 after 3 warm-ups."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    mean = sum(times) / len(times)
    return {"n": n, "mean_seconds": mean, "tflops": 2 * n ** 3 / mean / 1e12}


# --- correctness: the pinned tiny configurations --------------------------------------------

def tiny_config(method: str, device: str, dtype: str) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_engine import TINY  # the pinned federation (tests/test_pinned_results.py's `tiny`)

    return {**json.loads(json.dumps(TINY)), "method": method, "device": device, "dtype": dtype}


def tiny_run(method: str, device: str, dtype: str, root: Path) -> tuple[dict, dict]:
    """(figures, the final global adapter) of one pinned configuration's 2-round run, by the engine's
    default (`--batch auto`: on CUDA the clients in lockstep, against the CPU's one at a time)."""
    from pflalign import checkpoint as ckpt
    from pflalign.run.client_store import client_records, tensors_in
    from pflalign.config import build_config
    from pflalign.run.engine import run

    out = root / f"{method}-{device.replace(':', '')}-{dtype}"
    results = run(build_config(None, tiny_config(method, device, dtype)), out, progress=False)
    saved = ckpt.load_checkpoint(out / ckpt.CHECKPOINT)
    lines = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
    losses = [line["loss"] for line in lines if line.get("event") == "train_step"]
    glob = {n: t.detach().float().cpu() for n, t in saved["global"].items()}
    state_dtypes = sorted({str(t.dtype) for t in tensors_in(saved["server_state"])}
                          | {str(t.dtype) for t in tensors_in(saved["global"])})
    figures = {"losses": losses, "avg_rouge_l_personalized": results["avg_rouge_l_personalized"],
               "avg_rouge_l_global": results["avg_rouge_l_global"], "batch": results.get("batch", "none"),
               "adapter_and_server_state_dtypes": state_dtypes,
               "client_state_dtypes": sorted({str(t.dtype) for t in tensors_in(client_records(out, saved))})}
    return figures, glob


def rel_diff(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    """||a - b|| / ||b|| (the tensor's 2-norm, or the scalar's absolute value)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(figures: dict, glob: dict, ref: dict, ref_glob: dict, method: str) -> dict:
    losses, ref_losses = figures["losses"], ref["losses"]
    loss_rel = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref_losses)), default=math.inf)
    adapter_rel = max(rel_diff(glob[n], ref_glob[f"{method}/{n}"]) for n in glob)
    finite = all(math.isfinite(x) for x in losses) and all(bool(torch.isfinite(t).all()) for t in glob.values())
    return {"steps": len(losses), "steps_in_reference": len(ref_losses), "finite": finite,
            "max_rel_diff_loss": loss_rel, "max_rel_diff_global_adapter": adapter_rel,
            "rouge_l_personalized": figures["avg_rouge_l_personalized"],
            "rouge_l_personalized_reference": ref["avg_rouge_l_personalized"],
            "adapter_and_server_state_dtypes": figures["adapter_and_server_state_dtypes"],
            "client_state_dtypes": figures["client_state_dtypes"]}


def write_reference(methods: list[str]) -> dict:
    """On CPU: the pinned configurations' figures and final global adapters (and whether the adapter
    hashes to tests/pinned_results.json's pin on this host)."""
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from test_pinned_results import PINS, digest, numerics_fingerprint

    host = numerics_fingerprint()
    pins = json.loads(PINS.read_text())["hosts"].get(host, {}).get("in_process", {})
    figures, tensors = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            fig, glob = tiny_run(method, "cpu", "float32", Path(tmp))
            # recorded, not asserted: the reference is this host's CPU run of the pinned configuration
            fig["global_adapter_hash_equals_pin"] = method in pins and digest(glob) == pins[method]["global"]
            figures[method] = fig
            tensors.update({f"{method}/{n}": t.contiguous() for n, t in glob.items()})
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(REFERENCE.with_suffix(".safetensors")))
    # the CPU kind it was made on (tests/test_pinned_results.py): only there is a CPU run equal to it bit for bit
    REFERENCE.with_suffix(".json").write_text(json.dumps({"cpu_host": host, **figures}, indent=1) + "\n")
    return figures


def rouge_available() -> str:
    """"yes", or why not: without rouge-score (benchmarks/gpu_wheels.sh) the runs still compare
    losses and adapters, their ROUGE-L replaced by 0 (pflalign.run.client scores with it)."""
    try:
        import rouge_score.rouge_scorer  # noqa: F401
        return "yes"
    except ImportError as exc:
        import pflalign.run.client

        pflalign.run.client.rouge_l = lambda predictions, references: 0.0
        return f"no ({exc}): ROUGE-L not computed, reported as 0"


def correctness(device: str, methods: list[str]) -> dict:
    from safetensors.torch import load_file

    own_deadline = time.time() + CORRECTNESS_BUDGET_S
    rouge = rouge_available()
    ref = json.loads(REFERENCE.with_suffix(".json").read_text())
    ref_glob = load_file(str(REFERENCE.with_suffix(".safetensors")))
    out: dict = {"rtol_fp32": RTOL_FP32, "rtol_bf16": RTOL_BF16, "tf32": strict_fp32(), "rouge_l_scored": rouge,
                 "measure": "max over train steps of |loss - cpu| / |cpu|; max over the global adapter's "
                            "tensors of ||w - w_cpu|| / ||w_cpu||"}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, rtol in (("float32", RTOL_FP32), ("bfloat16", RTOL_BF16)):
            for method in methods:
                log(f"correctness {method} {dtype}")
                if out_of_time() or time.time() > own_deadline:  # leave the speed section its time
                    out.setdefault(dtype, {})[method] = {"pass": False, "error": "skipped: time budget spent"}
                    continue
                try:
                    fig, glob = tiny_run(method, device, dtype, Path(tmp))
                    row = compare(fig, glob, ref[method], ref_glob, method)
                    row["batch"] = fig["batch"]  # how the clients trained (the reference: one at a time)
                    row["pass"] = bool(row["finite"] and row["steps"] == row["steps_in_reference"]
                                       and row["max_rel_diff_loss"] <= rtol
                                       and row["max_rel_diff_global_adapter"] <= rtol
                                       and row["adapter_and_server_state_dtypes"] == ["torch.float32"])
                except Exception as exc:  # noqa: BLE001
                    row = {"pass": False, "error": f"{type(exc).__name__}: {exc}",
                           "traceback": traceback.format_exc()[-2000:]}
                out.setdefault(dtype, {})[method] = row
                log(f"  -> {json.dumps({k: v for k, v in row.items() if k != 'traceback'})}")
    out["pass"] = all(r["pass"] for d in ("float32", "bfloat16") for r in out[d].values())
    return out


# --- speed at the paper's shapes ------------------------------------------------------------

def build_arch(name: str, device: str, tiny: bool):
    """(FederatedLM with LoRA r16 alpha32 on every linear layer, its transformers config) for an
    architecture of ARCHS, random weights, bf16 base, built on the device directly."""
    from pflalign.config import LoraSettings
    from pflalign.model import FederatedLM

    base, config = build_base(name, device, tiny)
    lm = FederatedLM.from_base(base, None, LoraSettings(r=16, alpha=32), seed=0, device=device)
    return lm, config


def build_base(name: str, device: str, tiny: bool):
    """(transformers model, its config) for an architecture of ARCHS: random weights (seed 0, so
    every call gives the same model), bf16, built on the device directly."""
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    spec = dict(ARCHS[name])
    family = spec.pop("family")
    if tiny:  # --device cpu: the same architecture (family, norms, rope, tied head), toy sizes
        spec.update(num_hidden_layers=2, vocab_size=512, hidden_size=64, num_attention_heads=4,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
        if family == "llama":
            spec.update(intermediate_size=128, num_key_value_heads=2, head_dim=16)
        else:
            spec.update(ffn_dim=128, word_embed_proj_dim=64)
    if family == "llama":
        config, cls = LlamaConfig(**spec), LlamaForCausalLM
    else:
        config, cls = OPTConfig(**spec), OPTForCausalLM
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    default = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            base = cls(config)
    finally:
        torch.set_default_dtype(default)
    return base, config


def count_params(lm) -> dict:
    """Parameters of the frozen base's linear layers (decoder), the LM head, and LoRA."""
    from peft.tuners.lora import LoraLayer

    linear = sum(m.get_base_layer().weight.numel() for m in lm.model.modules() if isinstance(m, LoraLayer))
    head = lm.model.get_base_model().get_output_embeddings().weight.numel()
    lora = sum(p.numel() for p in lm.lora.values())
    total = sum(p.numel() for p in lm.model.parameters())
    return {"base_linear": linear, "head": head, "lora": lora, "total": total}


def train_flops(params: dict, config, batch: int, seq: int) -> dict:
    """FLOPs of one training step (forward + backward) with a frozen base and LoRA, every token labelled.

    Per token: the frozen linear layers 2N forward + 2N backward (the input's gradient only: no
    weight gradient for a frozen weight); LoRA 2N_lora forward + 4N_lora backward (input and
    weight gradients); the LM head 2VH forward + 2VH backward (input gradient; tied and frozen);
    attention's QK^T and AV: 4*T*H per layer forward for full attention, halved because causal
    kernels (SDPA's flash / memory-efficient) skip the masked half, and x3 for forward + backward
    (dQ, dK, dV: twice the forward's products) -> 6*L*T*H per token. Recomputation is not counted
    (useful FLOPs, as MFU is defined: Chowdhery et al. 2022, PaLM, appendix B).
    """
    tokens = batch * seq
    hidden = config.hidden_size
    linear = 4 * params["base_linear"] * tokens
    lora = 6 * params["lora"] * tokens
    head = 4 * params["head"] * tokens
    attention = 6 * config.num_hidden_layers * seq * hidden * tokens
    return {"total": linear + lora + head + attention, "base_linear": linear, "lora": lora, "head": head,
            "attention": attention,
            "formula": "tokens*(4*N_base_linear + 6*N_lora + 4*V*H + 6*L*T*H)"}


def random_batch(config, batch: int, seq: int, device: str | None = None) -> dict:
    """The timed batch: `batch` x `seq` random token ids (seed 0), every token labelled."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (batch, seq), generator=gen)
    ids = ids if device is None else ids.to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def bf16_autocast(device: str, enabled: bool):
    """torch.autocast(bfloat16) on `device`'s type (a no-op context when not `enabled`)."""
    return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=enabled)


def timed_steps(step, device: str, batch: int, seq: int, warmup: int, steps: int) -> dict:
    """`step()` (one training step; returns its loss) `warmup` + `steps` times: the mean of the
    timed steps, tokens/s, the first loss, peak memory on a GPU."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + steps):
        sync(device)
        t = time.perf_counter()
        loss = step()
        sync(device)
        losses.append(loss)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    mean = sum(times) / len(times)
    out = {"batch": batch, "seq": seq, "timed_steps": steps, "step_seconds": mean,
           "step_seconds_min": min(times), "tokens_per_s": batch * seq / mean, "first_loss": losses[0],
           "losses_finite": all(math.isfinite(x) for x in losses[warmup:])}
    if device.startswith("cuda"):
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return out


def time_training(lm, config, device: str, batch: int, seq: int, warmup: int, steps: int,
                  autocast: bool = False) -> dict:
    """`autocast`: the step under an outer torch.autocast(bfloat16), so that the float32 adapters'
    matmuls run on bf16 tensor cores (their float32 copies stay the master weights), as the HF
    Trainer's bf16=True does. Since issue 55 the library's own step does this on CUDA with a bf16
    base (`FederatedLM.adapter_autocast`), so there the two rows should agree."""
    from pflalign.params import aligned

    data = random_batch(config, batch, seq)
    live = {n: p.detach() for n, p in lm.lora.items()}  # once, as a client's round does (run/client.py)

    def step() -> float:
        with bf16_autocast(device, autocast):
            loss, grads = lm.loss_and_grads(data, unpadded=False)  # the padded batch, as on a GPU
        with torch.no_grad():  # plain SGD, as FedAvg's client: once over the flat adapter on CUDA
            for w, g in aligned(live, grads):
                w.sub_(g, alpha=1e-4)
        return loss

    return timed_steps(step, device, batch, seq, warmup, steps)


def profile_step(lm, config, device: str, batch: int, seq: int, top: int = 15) -> dict:
    """One training step under torch.profiler: the kernels that took the most device (or CPU)
    time, to say what limits the step's share of the matmul peak."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (batch, seq), generator=gen)
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        lm.loss_and_grads(data, unpadded=False)
        sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0) or 0, reverse=True)
    total = sum(getattr(e, key, 0) or 0 for e in events) or 1
    return {"by": key, "total_ms": total / 1e3,
            "top": [{"name": e.key[:120], "ms": (getattr(e, key, 0) or 0) / 1e3, "calls": e.count,
                     "share": (getattr(e, key, 0) or 0) / total} for e in events[:top]]}


def profile_calls(step, device: str, top: int = 12) -> dict:
    """One call of `step` under torch.profiler: its wall time against the time the device was busy
    (kernels' summed time: far below the wall time, the step waits on the host's launches), the
    number of kernels launched, and the operators that took the most host time (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    tic = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        sync(device)
    wall = time.perf_counter() - tic
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) if cuda else 0.0
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) if cuda else 0
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"wall_ms_profiled": wall * 1e3, "device_busy_ms": device_us / 1e3, "kernels": kernels,
            "top_host_ops": [{"name": e.key[:80], "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                             for e in host]}


def build_hf_peft(name: str, device: str, tiny: bool):
    """The loop a user would write in ten lines (issue 55's anchor): the same bf16 base as
    `build_arch` (same seed, same weights) with PEFT's LoRA r16 alpha32 on every linear layer
    (``target_modules="all-linear"``: the decoder's, not the head) and its float32 adapters."""
    from peft import LoraConfig, get_peft_model

    base, config = build_base(name, device, tiny)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(base, lora), config


def time_hf_training(model, config, device: str, batch: int, seq: int, warmup: int, steps: int,
                     autocast: bool) -> dict:
    """The user's step: ``model(**batch).loss.backward()`` and ``torch.optim.SGD``; `autocast`: under
    torch.autocast(bfloat16), as the HF Trainer's ``bf16=True`` runs it. Same batch as `time_training`."""
    data = random_batch(config, batch, seq, device)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> float:
        with bf16_autocast(device, autocast):  # the forward only, as torch's autocast recipe says
            loss = model(**data).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return timed_steps(step, device, batch, seq, warmup, steps)


# the shapes issue 55 measured the anchor at: (architecture, batch, tokens)
HF_SHAPES = [("llama-3.2-1b", BATCH, SEQ), ("llama-3.2-1b", BATCH, SHORT_SEQ), ("opt-1.3b", BATCH, SEQ),
             ("smollm2-135m", BATCH, SEQ)]


def hf_anchor(device: str, tiny: bool, speed_rows: dict) -> dict:
    """The HF + PEFT loop (plain bf16 and under autocast) beside pflalign's step at the same shape
    (the ``speed`` section's rows), as ``pflalign_over_best_hf``: issue 55's target is >= 1.0 at
    4 x 1024 and >= 1.2 at 4 x 256. ``first_loss_rel_diff``: the two loops' first losses on the same
    weights and batch (LoRA's B starts at 0 in both, so they start from the same function)."""
    warmup, steps = (1, 2) if tiny else (2, 5)
    out = {}
    for name, batch, seq in HF_SHAPES:
        if tiny:
            batch, seq = 2, (64 if seq == SEQ else 32)
        key = f"{name} {batch}x{seq}"
        log(f"hf_anchor {key}")
        if out_of_time():
            out[key] = {"error": "skipped: --budget-s spent"}
            continue
        try:
            model, config = build_hf_peft(name, device, tiny)
            row = {mode: time_hf_training(model, config, device, batch, seq, warmup, steps, autocast=mode == "autocast")
                   for mode in ("plain", "autocast")}
            del model
            ours = speed_rows.get(name, {}).get("train" if seq == (64 if tiny else SEQ) else "train_short", {})
            if "tokens_per_s" in ours:
                best = max(row["plain"]["tokens_per_s"], row["autocast"]["tokens_per_s"])
                row["pflalign_tokens_per_s"] = ours["tokens_per_s"]
                row["pflalign_over_best_hf"] = ours["tokens_per_s"] / best
                if ours.get("first_loss") is not None:
                    row["first_loss_rel_diff"] = abs(ours["first_loss"] - row["plain"]["first_loss"]) / abs(
                        row["plain"]["first_loss"])
        except Exception as exc:  # noqa: BLE001  (the next shape still runs)
            row = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        out[key] = row
        log(f"  -> {json.dumps({k: v for k, v in row.items() if k != 'traceback'})}")
    return out


def time_generation(lm, config, device: str, rows: int, prompt_len: int, new_tokens: int) -> dict:
    """Greedy decoding as the final evaluation runs it (`greedy_ids` with the adapter merged), no EOS:
    every row runs the full `new_tokens` (the upper bound of the evaluation's cost)."""
    from pflalign.evaluate import greedy_ids

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(rows)]
    with lm.merged():
        greedy_ids(lm.model, prompts[:2], 0, [], 4, rows)  # warm-up
        sync(device)
        t = time.perf_counter()
        answers = greedy_ids(lm.model, prompts, 0, [], new_tokens, rows)
        sync(device)
        seconds = time.perf_counter() - t
    made = sum(map(len, answers))
    return {"rows": rows, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_s": made / seconds, "prompts_per_s": rows / seconds}


def speed(device: str, tiny: bool, peak: dict | None) -> dict:
    out = {}
    batch, seq, short = (2, 64, 32) if tiny else (BATCH, SEQ, SHORT_SEQ)
    warmup, steps = (1, 2) if tiny else (2, 5)
    rows, prompt_len, new_tokens = (4, 16, 8) if tiny else (EVAL_BATCH, 96, EVAL_NEW_TOKENS)
    peak_tflops = peak.get("tflops") if isinstance(peak, dict) else None
    for name in ARCHS:
        log(f"speed {name}")
        if out_of_time():
            out[name] = {"error": "skipped: --budget-s spent"}
            continue
        try:
            lm, config = build_arch(name, device, tiny)
            row = {"params": count_params(lm), "fused_lora_mlps": lm.fused_mlps, "fused_rms_norms": lm.fused_norms,
                   "segment_attention": lm.segment_attention, "attn_implementation": config._attn_implementation,
                   "base_dtype": str(lm.base_dtype), "lora_dtype": str(lm.dtype),
                   "fast_paths": lm.fast_paths()}
            row["train"] = time_training(lm, config, device, batch, seq, warmup, steps)
            flops = train_flops(row["params"], config, batch, seq)
            row["train"]["flops_per_step"] = flops
            flops_full = flops["total"]
            row["train"]["tflops"] = flops["total"] / row["train"]["step_seconds"] / 1e12
            if peak_tflops:
                row["train"]["share_of_matmul_peak"] = row["train"]["tflops"] / peak_tflops
            # FLAN's padded batches: its examples are at most ~250 tokens (docs/reproduce.md)
            row["train_short"] = time_training(lm, config, device, batch, short, warmup, steps)
            flops = train_flops(row["params"], config, batch, short)
            row["train_short"]["tflops"] = flops["total"] / row["train_short"]["step_seconds"] / 1e12
            if name == "llama-3.2-1b":
                try:  # what autocast would gain (an experiment: the library trains without it)
                    gen = torch.Generator().manual_seed(0)
                    ids = torch.randint(3, config.vocab_size, (batch, seq), generator=gen)
                    one = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
                    plain = lm.loss_and_grads(one, unpadded=False)[0]
                    with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
                        cast = lm.loss_and_grads(one, unpadded=False)[0]
                    row["train_autocast"] = time_training(lm, config, device, batch, seq, warmup, steps,
                                                          autocast=True)
                    row["train_autocast"]["loss_rel_diff_vs_plain"] = abs(cast - plain) / abs(plain)
                    row["train_autocast"]["tflops"] = flops_full / row["train_autocast"]["step_seconds"] / 1e12
                    if peak_tflops:
                        row["train_autocast"]["share_of_matmul_peak"] = row["train_autocast"]["tflops"] / peak_tflops
                except Exception as exc:  # noqa: BLE001
                    row["train_autocast"] = {"error": f"{type(exc).__name__}: {exc}"}
                try:
                    row["train_profile"] = profile_step(lm, config, device, batch, seq)
                except Exception as exc:  # noqa: BLE001  (a diagnostic: its failure costs nothing else)
                    row["train_profile"] = {"error": f"{type(exc).__name__}: {exc}"}
            row["generate"] = time_generation(lm, config, device, rows, prompt_len, new_tokens)
            del lm
        except Exception as exc:  # noqa: BLE001  (the next architecture still runs)
            row = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        out[name] = row
        log(f"  -> {json.dumps({k: v for k, v in row.items() if k != 'traceback'})}")
    return out


# --- clients in lockstep (issue 55) ---------------------------------------------------------

BATCHED_ARCHS = ("smollm2-135m", "llama-3.2-1b")
BATCHED_ADAPTERS = (1, 4, 12, 44)  # one client; a round's 4; 3 runs' 12; 11 methods' 44
BATCHED_SHAPES = {"flan": SHORT_SEQ, "dolly": SEQ}  # tokens per example: FLAN's at most ~250, Dolly's up to 1024


def for_each_arch(archs, device: str, measure) -> dict:
    """{name: measure(name)} for each architecture while the budget lasts; a failure is that
    architecture's row (with its traceback) and the next still runs."""
    out = {}
    for name in archs:
        if out_of_time():
            out[name] = {"error": "skipped: --budget-s spent"}
            continue
        try:
            out[name] = measure(name)
        except Exception as exc:  # noqa: BLE001  (the next architecture still runs)
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        log(f"  -> {json.dumps(out[name])[:2000]}")
    return out


def batched(device: str, tiny: bool, peak: dict | None, archs=BATCHED_ARCHS) -> dict:
    """K adapters trained in lockstep (`--batch clients`' step: `lockstep.shared_pass` over K
    minibatches of BATCH examples, each through its own adapter, then each adapter's SGD step),
    for K in BATCHED_ADAPTERS, at FLAN's and Dolly's example lengths: tokens/s, its share of the
    measured bf16 peak (`train_flops` over all K batches), peak memory, how many adapters one pass
    took (`clients_per_pass`: fewer than K where the device ran out of memory), and
    ``over_one_adapter``: tokens/s against K = 1 (issue 55's target: >= 5 at 12 SmolLM2
    adapters; LLaMA-3.2-1B batched >= 40% of the peak)."""
    from pflalign.params import aligned
    from pflalign.run.lockstep import PassSize, own_adapter, shared_pass

    warmup, steps = (1, 2) if tiny else (1, 3)
    counts, shapes = ((1, 4, 12), {"flan": 32, "dolly": 64}) if tiny else (BATCHED_ADAPTERS, BATCHED_SHAPES)
    batch = 2 if tiny else BATCH
    peak_tflops = peak.get("tflops") if isinstance(peak, dict) else None

    def one(name: str) -> dict:
        lm, config = build_arch(name, device, tiny)
        params = count_params(lm)
        row = {}
        for shape, seq in shapes.items():
            size, per = PassSize(), {}
            for k in counts:
                log(f"batched {name} {shape} K={k}")
                if out_of_time():
                    per[str(k)] = {"error": "skipped: --budget-s spent"}
                    continue
                gen = torch.Generator().manual_seed(k)
                adapters = []
                for _ in range(k):  # adapters apart, as clients' are after a round
                    live = own_adapter(lm.lora)
                    with torch.no_grad():
                        for t in live.values():
                            t.add_(torch.randn(t.shape, generator=gen).to(t.device) * 1e-3)
                    adapters.append(live)
                batches = []
                for j in range(k):
                    ids = torch.randint(3, config.vocab_size, (batch, seq), generator=gen)
                    batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                    "labels": ids.clone()})

                def step() -> float:
                    losses = shared_pass(lm, batches, adapters, size)
                    with torch.no_grad():  # each client's SGD step, as FedAvg's client takes it (flat on CUDA)
                        for adapter in adapters:
                            for w, g in aligned(adapter, {n: p.grad for n, p in adapter.items()}):
                                w.sub_(g, alpha=1e-4)
                    return sum(losses) / len(losses)

                try:
                    timing = timed_steps(step, device, k * batch, seq, warmup, steps)
                except torch.OutOfMemoryError as exc:  # one client's pass did not fit
                    per[str(k)] = {"error": f"OutOfMemoryError: {str(exc)[:200]}"}
                    break
                flops = train_flops(params, config, k * batch, seq)["total"]
                timing.update(adapters=k, clients_per_pass=size.clients or k,
                              tflops=flops / timing["step_seconds"] / 1e12)
                if peak_tflops:
                    timing["share_of_matmul_peak"] = timing["tflops"] / peak_tflops
                one = per.get("1", {}).get("tokens_per_s")
                if one:
                    timing["over_one_adapter"] = timing["tokens_per_s"] / one
                if name == BATCHED_ARCHS[0] and shape == "dolly" and k in (1, 12):
                    # where a step's time goes as adapters are added (a diagnostic: its failure costs nothing else)
                    try:
                        timing["profile"] = profile_calls(step, device)
                    except Exception as exc:  # noqa: BLE001
                        timing["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
                per[str(k)] = timing
                del adapters, batches
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            row[shape] = per
        del lm
        return row

    return for_each_arch(archs, device, one)


UPDATE_REPEATS = 20  # timed local steps per mode (after 3 untimed)


class _CountOps:
    """Counts the aten operations dispatched inside it (each is one or more kernels on CUDA)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.ops, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def updates(device: str, tiny: bool, archs=BATCHED_ARCHS) -> dict:
    """A client's work per local step outside the pass (issue 55): pFLAlign's update (Algorithm 1,
    with its measurements) and the engine's GSNR sums (`GradientStats.add`, every method's), over an
    adapter of the architecture (LoRA r16 on every linear layer), tensor by tensor against once over
    the flat buffers the tensors are views of (`params.aligned`, on CUDA since 2026-11-28): ms a
    step and aten operations dispatched (each one kernel launch or more on a GPU)."""
    from pflalign import params as P
    from pflalign.config import build_config, make_method
    from pflalign.methods.base import StepContext
    from pflalign.run.client import GradientStats

    kind = torch.device(device).type
    repeats = 2 if tiny else UPDATE_REPEATS

    def one(name: str) -> dict:
        lm, _ = build_arch(name, device, tiny)
        like = {n: p.detach() for n, p in lm.lora.items()}
        del lm
        gen = torch.Generator().manual_seed(0)
        grads = P.clone({n: torch.randn(t.shape, generator=gen).to(t.device) * 1e-3 for n, t in like.items()})
        method = make_method(build_config(None, {"method": "pflalign", "model": "tiny-llama"}))
        state, scratch = method.init_client_state(like), method.new_scratch()
        live = P.clone(method.client_start(like, state, {}, scratch))
        ctx = StepContext(round=0, step=0, num_steps=LOCAL_STEPS, lr=0.04, global_params=like, scratch=scratch)
        stats = GradientStats()
        work = {"pflalign_step": lambda: method.local_step(live, lambda: (0.0, grads), state, ctx),
                "gsnr_sums": lambda: stats.add(grads)}
        row = {"tensors": len(like), "parameters": sum(t.numel() for t in like.values())}
        saved = P.FLAT_DEVICES
        try:
            for mode, flat in (("tensor_by_tensor", set()), ("flat", {kind})):
                P.FLAT_DEVICES = flat
                for what, fn in work.items():
                    for _ in range(3):
                        fn()
                    with _CountOps() as count:
                        fn()
                    sync(device)
                    tic = time.perf_counter()
                    for _ in range(repeats):
                        fn()
                    sync(device)
                    row[f"{what}_{mode}"] = {"ms": 1e3 * (time.perf_counter() - tic) / repeats, "ops": count.ops}
        finally:
            P.FLAT_DEVICES = saved
        for what in work:
            row[f"{what}_tensor_by_tensor_over_flat"] = row[f"{what}_tensor_by_tensor"]["ms"] / row[f"{what}_flat"]["ms"]
        return row

    return for_each_arch(archs, device, one)


def files(device: str, tiny: bool) -> dict:
    """Each client's record kept between its rounds, to and from its file or in memory, and the
    run's checkpoint, at the real adapters' sizes, per Table 1 method (benchmarks/client_files.py;
    on this machine's host and disk: the files are written there whatever the device)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import client_files

    if tiny:  # the CPU test of this script: two methods at SmolLM2's sizes, once
        return client_files.measure(device, ("smollm2-135m",), ("pflalign", "fedavg"), repeats=1)
    return client_files.measure(device, BATCHED_ARCHS)


# One run's final scoring at the protocol's test splits (`scoring`): the architecture and the
# dataset whose Table 1 targets issue 55 sets, each decoding mode (how the models take turns, rows)
SCORING_CASES = (("smollm2-135m", "dolly"), ("llama-3.2-1b", "flan"))
SCORING_MODES = (("one_at_a_time", 64), ("one_at_a_time", "auto"), ("one_loop", "auto"))
SCORING_NEW_TOKENS = 32  # per row, no EOS: every row runs all its tokens; the bill scales to EVAL_NEW_TOKENS
PROMPT_LENGTHS = ROOT / "benchmarks" / "results" / "test_prompt_lengths.json"


class _Ids:
    """A tokenizer stand-in for random token ids (generate decodes the answers)."""

    pad_token_id = 0
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def write_prompt_lengths(data_dir: str) -> dict:
    """PROMPT_LENGTHS from the paper's federations in `data_dir` (the shared data: on CPU, where it
    lies; the scoring section reads the file on a GPU, where it does not travel)."""
    from pflalign.config import build_config
    from pflalign.data.clients import client_shares
    from pflalign.model import FederatedLM, LoraSettings
    from pflalign.prompts import encode_prompt

    lm = FederatedLM.build("smollm2-135m", LoraSettings(r=16, alpha=32), seed=0)
    out = {"doc": ("Token counts of every test prompt of the paper's federations (dolly-paper, flan-paper "
                   "presets: chat template, max_seq_len 1024), SmolLM2-135M-Instruct's tokenizer; written by "
                   "`benchmarks/gpu.py --write-prompt-lengths --data-dir ../shared/data` on CPU, read by its "
                   "scoring section on a GPU, where the data does not travel.")}
    for dataset, where in (("dolly", "dolly/databricks-dolly-15k.jsonl"), ("flan", "flan")):
        cfg = build_config(f"{dataset}-paper")
        out[dataset] = {s.name: [len(encode_prompt(lm.tokenizer, ex, cfg.max_seq_len, cfg.data.template)[0])
                                 for ex in s.test] for s in client_shares(cfg, str(Path(data_dir) / where))}
    PROMPT_LENGTHS.write_text(json.dumps(out) + "\n")
    return out


def scoring(device: str, tiny: bool, cases=SCORING_CASES) -> dict:
    """One run's final scoring (issue 55, point 4), as the engine scores it: each client's
    personalized model and the global model over the client's test prompts (the protocol's splits,
    PROMPT_LENGTHS: random token ids of the real prompts' lengths), SCORING_NEW_TOKENS each, in
    each of SCORING_MODES: ``one_at_a_time`` (`run_score_job`'s path: one merged model after another,
    a job per client and model) or ``one_loop`` (`generate_per_adapter`, what --batch clients/runs
    scores with: every job in one decoding loop, each row with its own unmerged adapter), at 64 rows
    (the CPU's eval.batch_size) or ``auto`` (`evaluate.decode_plan`: on CUDA up to 1024 rows within
    half the free memory). Seconds, tokens/s, peak memory. Decoding is bound by launches on a GPU
    (gpu_eval_batch.json): what auto and the one loop buy is fuller steps, fewer of them."""
    from pflalign.evaluate import decode_plan, generate
    from pflalign.run.batched_scoring import generate_per_adapter

    lengths = json.loads(PROMPT_LENGTHS.read_text())
    new_tokens = 4 if tiny else SCORING_NEW_TOKENS
    out = {"new_tokens": new_tokens, "prompt_lengths": PROMPT_LENGTHS.name}

    def one(case: str) -> dict:
        name, dataset = case.split(" ")
        lm, config = build_arch(name, device, tiny)
        lm.tokenizer = _Ids()
        generate_per_adapter(lm, [(lm.get_lora(), [[5, 6, 7]] * 2)], 2, 2)  # warm-up, untimed
        gen = torch.Generator().manual_seed(0)
        clients = []  # (personalized adapter, prompts) per client
        for counts in lengths[dataset].values():
            counts = [min(n, 24) for n in counts[:3]] if tiny else counts
            adapter = {n: t.detach().clone() for n, t in lm.lora.items()}
            for t in adapter.values():
                t.add_(torch.randn(t.shape, generator=gen).to(t.device) * 1e-2)
            clients.append((adapter, [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in counts]))
        global_ = {n: t.detach().clone() for n, t in lm.lora.items()}
        jobs = clients + [(global_, prompts) for _, prompts in clients]  # the engine's score_jobs
        made = new_tokens * sum(len(prompts) for _, prompts in jobs)
        row = {"jobs": len(jobs), "prompts": sum(len(p) for _, p in jobs)}
        for mode, rows in SCORING_MODES:
            key = f"{mode}_rows{rows}"
            if out_of_time():
                row[key] = {"error": "skipped: --budget-s spent"}
                continue
            log(f"scoring {name} {dataset} {key}")
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            sync(device)
            tic = time.perf_counter()
            if mode == "one_loop":
                generate_per_adapter(lm, jobs, new_tokens, rows)
            else:
                for adapter, prompts in jobs:
                    lm.set_lora(adapter)
                    with lm.merged():
                        generate(lm.model, lm.tokenizer, prompts, new_tokens, rows, progress=False)
            sync(device)
            seconds = time.perf_counter() - tic
            row[key] = {"seconds": seconds, "tokens_per_s": made / seconds,
                        "rows": decode_plan(lm.model, rows)[0],
                        "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30
                                            if device.startswith("cuda") else None)}
            log(f"  {key}: {seconds:.2f} s")
        del lm
        return row

    return {**out, **for_each_arch([f"{n} {d}" for n, d in cases], device, one)}


def bill_batched(batched_rows: dict, speed_rows: dict, scoring_rows: dict | None = None,
                 updates_rows: dict | None = None, files_rows: dict | None = None) -> dict:
    """Projected device time of a 33-run Table 1 trained in lockstep, from the ``batched`` figures.

    ``clients`` (what --batch clients does today): each run's 4 clients share a pass, the runs one
    after another. ``runs`` (issue 55's point 3, `sweep --batch runs`; projected, as no call times such a
    sweep): every run's clients of a round share passes, TABLE1_RUNS x CLIENTS adapters at the largest measured K's tokens/s. Both add
    FedSAM's second gradient per client alone (the K = 1 rate; 3 runs x CLIENTS per step). The
    scoring: where the ``scoring`` section measured one run's at this architecture and dataset,
    TABLE1_RUNS + 1/2 of its seconds (the base model once, half a run's two models) scaled from
    its SCORING_NEW_TOKENS to EVAL_NEW_TOKENS (prefills too: an upper bound), for each mode
    (``eval_minutes_by_mode``) and the fastest in the totals; else 2 models per run plus the base
    once at the ``speed`` section's generation rate (64 rows; EVAL_NEW_TOKENS each: an upper
    bound). Where the ``updates`` section measured the architecture, each client step's work outside
    the pass is added (``updates_minutes``, flat as on CUDA): the GSNR sums in every run, pFLAlign's
    update in its 3 runs (the other methods' SGD step is in the ``batched`` rates). Where the
    ``files`` section measured the architecture, the clients' records between rounds are added
    (``records_minutes``: in memory, CUDA's default, plus a checkpoint with each client's file per
    minute of the rest, ``--checkpoint-every`` 60; ``records_minutes_every_round``: every record
    through its file and a checkpoint every round, as before 2026-11-28, for comparison). Model
    building, data and aggregation are left out.
    Targets: the Dolly Table 1 at SmolLM2-135M <= 12 minutes, LLaMA-3.2-1B's FLAN one <= 1 hour."""
    out = {"doc": bill_batched.__doc__}
    steps = ROUNDS * LOCAL_STEPS
    for name, dataset in (("smollm2-135m", "dolly"), ("smollm2-135m", "flan"), ("llama-3.2-1b", "flan"),
                          ("llama-3.2-1b", "dolly")):
        per = batched_rows.get(name, {}).get(dataset, {})
        rates = {int(k): v["tokens_per_s"] for k, v in per.items() if isinstance(v, dict) and "tokens_per_s" in v}
        generate = speed_rows.get(name, {}).get("generate", {}).get("tokens_per_s")
        scored = (scoring_rows or {}).get(f"{name} {dataset}", {})
        made = (scoring_rows or {}).get("new_tokens", SCORING_NEW_TOKENS)  # per row, in the scoring section
        by_mode = {key: (TABLE1_RUNS + 0.5) * row["seconds"] * EVAL_NEW_TOKENS / made
                   for key, row in scored.items() if isinstance(row, dict) and "seconds" in row}
        if 1 not in rates or CLIENTS not in rates or not (generate or by_mode):
            out[f"{name} {dataset}"] = {"error": "no batched or scoring figures for this architecture"}
            continue
        seq = BATCHED_SHAPES[dataset]
        tokens = BATCH * seq  # one client's step
        widest = max(rates)
        sam_s = steps * 3 * CLIENTS * tokens / rates[1]  # FedSAM's second gradient, each client alone
        if by_mode:
            eval_from = min(by_mode, key=by_mode.get)
            eval_s = by_mode[eval_from]
        else:
            eval_from = "speed.generate (64 rows)"
            eval_s = (2 * TABLE1_RUNS + 1) * TEST_PROMPTS[dataset] * EVAL_NEW_TOKENS / generate
        work = (updates_rows or {}).get(name, {})
        updates_s = 0.0
        if "gsnr_sums_flat" in work and "pflalign_step_flat" in work:
            updates_s = steps * CLIENTS * (TABLE1_RUNS * work["gsnr_sums_flat"]["ms"]
                                           + 3 * work["pflalign_step_flat"]["ms"]) / 1e3
        clients_s = steps * TABLE1_RUNS * CLIENTS * tokens / rates[CLIENTS] + sam_s + updates_s
        runs_s = steps * TABLE1_RUNS * CLIENTS * tokens / rates[widest] + sam_s + updates_s
        records = records_minutes((files_rows or {}).get(name, {}), (clients_s + eval_s) / 60)
        if records:
            clients_s += 60 * records["records_minutes"]
            runs_s += 60 * records_minutes(files_rows[name], (runs_s + eval_s) / 60)["records_minutes"]
        out[f"{name} {dataset}"] = {**records,
            "adapters_per_pass_measured": widest, "eval_minutes": eval_s / 60, "eval_from": eval_from,
            "eval_minutes_by_mode": {key: v / 60 for key, v in by_mode.items()}, "updates_minutes": updates_s / 60,
            "clients_minutes": (clients_s + eval_s) / 60, "runs_minutes": (runs_s + eval_s) / 60}
    return out


def records_minutes(files_row: dict, other_minutes: float) -> dict:
    """The clients' records of Table 1 between rounds from a ``files`` row (client_files.py):
    held in memory (its ``in_memory_minutes``) plus, per minute of the rest of the bill
    (`other_minutes`), one checkpoint and each client's file written (--checkpoint-every 60), at
    the mean over the methods; {} when the row has no such figures."""
    table1 = files_row.get("table1", {})
    methods = [v for v in files_row.values() if isinstance(v, dict) and "files_s" in v]
    if "in_memory_minutes" not in table1 or not methods:
        return {}
    # a checkpoint: the run's file, then each client's record written (`ClientStore.flush`)
    per_checkpoint = statistics.mean(m["checkpoint_s"] + CLIENTS * m["files_save_s"] for m in methods)
    return {"records_minutes": table1["in_memory_minutes"] + other_minutes * per_checkpoint / 60,
            "records_minutes_every_round": table1["every_round_minutes"]}


# --- the bill -------------------------------------------------------------------------------

def bill(speed_rows: dict) -> dict:
    """Projected device time at the paper's protocol, from the measured 1B figures.

    Training: ROUNDS x LOCAL_STEPS x CLIENTS steps of a BATCH-example batch, timed at SHORT_SEQ
    tokens for FLAN and SEQ for Dolly: upper bounds, since a GPU trains the batch padded to its
    longest example (FLAN's are at most ~250 tokens, Dolly's reach 1024). Evaluation: every test prompt x
    MODELS_SCORED models, EVAL_NEW_TOKENS tokens each at the measured generation rate (an upper
    bound too: answers stop at EOS). Table 1 (33 runs): FedSAM's steps take two gradients, and
    the base model is scored once per sweep. Model building, data and checkpoints are left out.
    """
    out = {"assumptions": {"rounds": ROUNDS, "local_steps": LOCAL_STEPS, "clients": CLIENTS, "batch": BATCH,
                           "seq_upper_bound": {"flan": SHORT_SEQ, "dolly": SEQ}, "test_prompts": TEST_PROMPTS, "models_scored": MODELS_SCORED,
                           "new_tokens_upper_bound": EVAL_NEW_TOKENS, "table1_runs": TABLE1_RUNS,
                           "table1_gradient_steps_per_step_of_one_run": TABLE1_GRADIENTS},
           "doc": bill.__doc__}
    for name in ("llama-3.2-1b", "opt-1.3b"):
        row = speed_rows.get(name, {})
        if "train" not in row or "generate" not in row:
            out[name] = {"error": "no speed figures for this architecture"}
            continue
        per = {}
        for dataset, prompts in TEST_PROMPTS.items():
            timing = row["train_short" if dataset == "flan" and "train_short" in row else "train"]
            train_s = ROUNDS * LOCAL_STEPS * CLIENTS * timing["step_seconds"]
            eval_s = prompts * MODELS_SCORED * EVAL_NEW_TOKENS / row["generate"]["tokens_per_s"]
            per[dataset] = {"train_seq": timing["seq"], "train_minutes": train_s / 60, "eval_minutes": eval_s / 60,
                            "total_minutes": (train_s + eval_s) / 60}
        for dataset, prompts in TEST_PROMPTS.items():
            # every run scores its personalized and global models; the base model once per sweep
            # (model/base_cache.py)
            step = row["train_short" if dataset == "flan" and "train_short" in row else "train"]["step_seconds"]
            train_s = TABLE1_GRADIENTS * ROUNDS * LOCAL_STEPS * CLIENTS * step
            eval_s = (2 * TABLE1_RUNS + 1) * prompts * EVAL_NEW_TOKENS / row["generate"]["tokens_per_s"]
            per[f"table1_{dataset}_hours"] = (train_s + eval_s) / 3600
        out[name] = per
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (tiny shapes, the test)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    parser.add_argument("--sections",
                        default="matmul_peak,correctness,speed,hf_anchor,batched,updates,scoring,files,bill")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--batched-archs", default=",".join(BATCHED_ARCHS),
                        help="the architectures of the batched section (a short call: smollm2-135m)")
    parser.add_argument("--write-reference", action="store_true",
                        help="on CPU: write benchmarks/results/gpu_reference.* from the pinned runs")
    parser.add_argument("--write-prompt-lengths", metavar="DATA_DIR",
                        help="on CPU: write benchmarks/results/test_prompt_lengths.json from the shared data there")
    parser.add_argument("--budget-s", type=float, default=420,
                        help="skip the runs not started after this many seconds (the check must end < 8 min)")
    args = parser.parse_args(argv)
    global DEADLINE
    DEADLINE = time.time() + args.budget_s
    os.environ.setdefault("PFLALIGN_CACHE", tempfile.mkdtemp(prefix="pflalign-gpu-"))
    methods = args.methods.split(",")
    if args.write_prompt_lengths:
        write_prompt_lengths(args.write_prompt_lengths)
        log(f"wrote {PROMPT_LENGTHS}")
        return 0
    if args.write_reference:
        write_reference(methods)
        log(f"wrote {REFERENCE}.json and .safetensors")
        return 0
    device, tiny = args.device, not args.device.startswith("cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu.py: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    import peft
    import transformers

    report: dict = {"device": device, "tiny_shapes": tiny, "torch": torch.__version__,
                    "transformers": transformers.__version__, "peft": peft.__version__,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        report["gpu"] = {"name": props.name, "memory_gib": props.total_memory / 2 ** 30,
                         "multiprocessors": props.multi_processor_count, "capability": f"{props.major}.{props.minor}"}
    sections = args.sections.split(",")
    start = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every section, so a call cut off at its limit keeps what was measured
        report["total_seconds"] = round(time.time() - start, 1)
        out.with_suffix(".part").write_text(json.dumps(report, indent=1) + "\n")
        out.with_suffix(".part").replace(out)

    if "matmul_peak" in sections:
        section(report, "matmul_peak", matmul_peak, device, 256 if tiny else 8192)
        save()
    if "correctness" in sections:
        section(report, "correctness", correctness, device, methods)
        save()
    if "speed" in sections:
        section(report, "speed", speed, device, tiny, report.get("matmul_peak"))
        save()
    if "hf_anchor" in sections:
        section(report, "hf_anchor", hf_anchor, device, tiny, report.get("speed", {}))
        save()
    if "batched" in sections:
        section(report, "batched", batched, device, tiny, report.get("matmul_peak"), args.batched_archs.split(","))
        save()
    if "updates" in sections:
        section(report, "updates", updates, device, tiny)
        save()
    if "scoring" in sections:
        section(report, "scoring", scoring, device, tiny)
        save()
    if "files" in sections:
        section(report, "files", files, device, tiny)
        save()
    if "bill" in sections:
        section(report, "bill", bill, report.get("speed", {}))
        if "batched" in report:
            section(report, "bill_batched", bill_batched, report["batched"], report.get("speed", {}),
                    report.get("scoring"), report.get("updates"), report.get("files"))
    save()
    log(f"wrote {args.out} in {report['total_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
