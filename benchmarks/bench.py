"""pflalign benchmark: how close local training and evaluation run to this machine's limit.

    .venv/bin/python benchmarks/bench.py --data-dir ../shared/data --out benchmarks/results/cpu.json
    python benchmarks/bench.py --data-dir ../shared/data --device cuda --out benchmarks/results/gpu.json

On a GPU (`--device cuda`) everything runs in bfloat16 by default (`--dtype`):
the matmul peak is a bf16 GEMM's, training runs the padded batch in one call
(as the engine does there) and memory is also given as the CUDA allocator's
peak. MFU still counts non-pad tokens only.

Measures, in one process and one run (ratios, because absolute times drift):
  * the machine's peak fp32 matmul throughput (GFLOP/s, sustained for 1 s per
    size): the reference limit, at the start, and in short probes between the
    training steps (MFU uses the mean of those, and is also given against the
    start's);
  * local training (forward + backward at the live adapter) on FLAN and Dolly
    batches of the paper (batch 4, up to 1024 tokens): non-pad tokens/s,
    model GFLOP/s and MFU = achieved / peak;
  * a whole federated round (4 clients x 5 steps; two timed rounds after a
    warm-up one) and the share of it spent outside forward/backward;
  * evaluation: batched greedy generation vs one prompt at a time (examples/s,
    generated tokens/s, identical outputs or not);
  * peak resident memory of a 1-round job with 4 and with 8 clients (subprocesses).

FLOP count per non-pad token, per frozen linear layer (d_in x d_out):
forward 2·d_in·d_out, backward 2·d_in·d_out (input gradient only, the weight is
frozen); per LoRA pair of rank r: forward 2r(d_in + d_out), backward
4r(d_in + d_out) (input and weight gradients); attention scores and values:
forward 4·L·d_model per token for a sequence of L tokens, halved for causal
masking, and twice that backward; the LM head only at response positions:
2·d_model·V forward + 2·d_model·V backward. Embedding lookups count zero.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import sys
import time
from pathlib import Path

import torch

from pflalign.run import allocator
from pflalign.run.lifecycle import Recorder
from pflalign.config import build_config
from pflalign.data.federate import FederationOptions, federation
from pflalign.run.engine import Federation
from pflalign.evaluate import generate
from pflalign.model import FederatedLM, LoraSettings
from pflalign.prompts import IGNORE, batch_indices, collate_train, encode_prompt, encode_train


def matmul_peak(sizes=(1024, 2048, 3072), seconds: float = 1.0, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> float:
    """Best sustained GFLOP/s of a square matmul over a few sizes (fp32 on CPU).

    Each size runs back to back for `seconds`: on these shared machines a single
    call can catch a short clock burst (191 GFLOP/s once, against 116-147 in
    the following 12 one-second windows), which no training step ever sees.
    """
    if device != "cpu":
        sizes = (4096, 8192, 16384)  # a GPU needs large matrices to reach its peak
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        torch.mm(a, b)
        sync(device)
        count, tic = 0, time.perf_counter()
        while time.perf_counter() - tic < seconds:
            for _ in range(1 if device == "cpu" else 10):  # queue GPU work between clock reads
                torch.mm(a, b)
                count += 1
            sync(device)
        best = max(best, 2 * n**3 * count / (time.perf_counter() - tic) / 1e9)
    return best


def sync(device) -> None:
    """Wait for queued GPU work, so that wall-clock times cover it (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def linear_shapes(model) -> list[tuple[int, int, int]]:
    """(d_in, d_out, lora_rank or 0) of every linear layer of the backbone (not the LM head)."""
    shapes = []
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            base = module.base_layer
            rank = module.lora_A["default"].out_features
            shapes.append((base.in_features, base.out_features, rank))
    return shapes


def training_flops(lm: FederatedLM, batch: dict) -> float:
    """Model FLOPs of one forward + backward on `batch` (see the module docstring)."""
    cfg = lm.model.get_base_model().config
    d, vocab = cfg.hidden_size, cfg.vocab_size
    layers = cfg.num_hidden_layers
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    tokens = sum(lengths)
    response = int((batch["labels"][:, 1:] != IGNORE).sum())
    per_token = 0.0
    for d_in, d_out, r in linear_shapes(lm.model):
        per_token += 4 * d_in * d_out + 6 * r * (d_in + d_out)
    attention = sum(layers * 3 * 4 * L * d / 2 * L for L in lengths)  # fwd 4Ld/2 per token, x3 with backward
    head = response * 4 * d * vocab
    return per_token * tokens + attention + head


def bench_training(lm: FederatedLM, clients, batch_size: int, steps: int, max_len: int, start_peak: float) -> dict:
    """Training steps, each right after a short matmul probe (best of the sizes, 0.3 s
    each). MFU is against the mean of these probes, i.e. the machine as it ran during
    the steps: its speed drifts by 20% or more within an hour here, and other
    tenants' load comes and goes within minutes. It is also given against the
    peak measured at the start of the run (`mfu_vs_start_peak`)."""
    device, dtype = lm.device.type, lm.model.get_base_model().dtype
    pad = lm.tokenizer.pad_token_id
    encoded = [[encode_train(lm.tokenizer, ex, max_len) for ex in c.train] for c in clients]
    batches = []
    for s in range(steps + 1):
        k = s % len(clients)
        idx = batch_indices(len(encoded[k]), batch_size, s, seed=k)
        batches.append(collate_train([encoded[k][i] for i in idx], pad))
    lm.loss_and_grads(batches[0])  # warm-up
    seconds = flops = tokens = 0.0
    probes, step_mfu = [], []
    for batch in batches[1:]:
        probes.append(matmul_peak(seconds=0.3, device=device, dtype=dtype))
        sync(lm.device)
        tic = time.perf_counter()
        lm.loss_and_grads(batch)
        sync(lm.device)
        elapsed = time.perf_counter() - tic
        step_flops = training_flops(lm, batch)
        step_mfu.append(step_flops / elapsed / 1e9 / probes[-1])
        seconds += elapsed
        flops += step_flops
        tokens += int(batch["attention_mask"].sum())
    gflops = flops / seconds / 1e9
    peak = sum(probes) / len(probes)
    return {"steps": steps, "seconds_per_step": seconds / steps, "tokens_per_s": tokens / seconds,
            "gflops": gflops, "matmul_peak_gflops": peak, "mfu": gflops / peak,
            "mfu_vs_start_peak": gflops / start_peak, "matmul_probes_gflops": probes, "step_mfu": step_mfu}


def own_peak_rss_gb() -> float:
    """This process's peak resident memory (VmHWM). Not ru_maxrss: Linux carries
    that over from the parent across fork + exec, so a subprocess of a big
    benchmark process would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e6  # kB -> GB
    raise RuntimeError("no VmHWM in /proc/self/status")


def own_peaks() -> dict:
    """Peak resident memory and, where CUDA ran, the CUDA allocator's peak (GB); the
    process's memory allocator."""
    peaks = {"peak_rss_gb": own_peak_rss_gb(), "memory_allocator": allocator.active()}
    if torch.cuda.is_initialized():
        peaks["peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return peaks


def bench_round(cfg_overrides: dict) -> dict:
    """Federated rounds through the engine, in a fresh subprocess (so its peak
    resident memory is the rounds' own): a warm-up round, then the timed rounds
    (`rounds` in the overrides, less one), with forward/backward time separated and
    the matmul peak measured just before and after them (how fast the machine ran)."""
    return python_json("from bench import _round; print(json.dumps(_round(json.loads(sys.argv[1]))))", cfg_overrides)


def python_json(code: str, arg) -> dict:
    """Run `code` in a fresh Python (with this folder importable and `arg` as JSON in
    sys.argv[1]) under the allocator the pflalign command would give it; the JSON
    object it prints last."""
    code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); {code}"
    out = subprocess.run([sys.executable, "-c", code, json.dumps(arg)], capture_output=True, text=True,
                         env=allocator.preload_env())
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _round(cfg_overrides: dict) -> dict:
    """Two timed rounds, not one: a process's first checkpoints are written into fresh
    file space. In two real FLAN runs here the second save took 1.27 and 1.36 s, the
    third 1.08 and 0.65 s: one round after the warm-up alone leans on the slowest."""
    cfg = build_config(None, cfg_overrides)
    fed = Federation(cfg, progress=False)
    inner = {"seconds": 0.0, "tokens": 0}
    original = fed.lm.loss_and_grads

    def timed(batch):
        sync(fed.lm.device)
        tic = time.perf_counter()
        out = original(batch)
        sync(fed.lm.device)
        inner["seconds"] += time.perf_counter() - tic
        inner["tokens"] += int(batch["attention_mask"].sum())
        return out

    fed.lm.loss_and_grads = timed
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(Path(tmp), resume=False, overwrite=False)
        rec.open(cfg)
        fed.train(rec, 0, 1)  # warm-up round (first calls are slow)
        before = matmul_peak(device=fed.lm.device.type, dtype=fed.lm.model.get_base_model().dtype)
        for r in range(1, cfg.rounds):
            inner.update(seconds=0.0, tokens=0)
            tic = time.perf_counter()
            fed.train(rec, r, r + 1)
            rounds.append({"seconds": time.perf_counter() - tic, "forward_backward_seconds": inner["seconds"],
                           "tokens": inner["tokens"]})
        after = matmul_peak(device=fed.lm.device.type, dtype=fed.lm.model.get_base_model().dtype)
        rec.close()
        checkpoint_mb = (Path(tmp) / "checkpoint.pt").stat().st_size / 1e6
    total = sum(r["seconds"] for r in rounds)
    inside = sum(r["forward_backward_seconds"] for r in rounds)
    return {"timed_rounds": len(rounds), "seconds": total / len(rounds), "forward_backward_seconds": inside / len(rounds),
            "overhead_share": 1 - inside / total, "non_pad_tokens_per_s": sum(r["tokens"] for r in rounds) / total,
            "per_round": [{**r, "overhead_share": 1 - r["forward_backward_seconds"] / r["seconds"]} for r in rounds],
            "checkpoint_mb": checkpoint_mb, "matmul_peak_before_after_gflops": [before, after], **own_peaks()}


def bench_generation(lm: FederatedLM, examples, max_new_tokens: int, batch_size: int, single: int) -> dict:
    """Evaluation's generation (adapter merged, prompts grouped by length): all `examples`
    batched, and an evenly spread subset of `single` of them batched and one at a time."""
    prompts = [encode_prompt(lm.tokenizer, ex, 1024)[0] for ex in examples]
    subset = prompts[:: max(1, len(prompts) // single)][:single]
    with lm.merged():
        tic = time.perf_counter()
        batched = generate(lm.model, lm.tokenizer, prompts, max_new_tokens, batch_size, progress=False)
        t_batched = time.perf_counter() - tic
        tic = time.perf_counter()
        batched_subset = generate(lm.model, lm.tokenizer, subset, max_new_tokens, batch_size, progress=False)
        t_batched_subset = time.perf_counter() - tic
        tic = time.perf_counter()
        one = generate(lm.model, lm.tokenizer, subset, max_new_tokens, 1, progress=False)
        t_one = time.perf_counter() - tic
    new_tokens = sum(len(lm.tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in batched)
    return {
        "examples": len(prompts), "batch_size": batch_size, "max_new_tokens": max_new_tokens,
        "batched_examples_per_s": len(prompts) / t_batched,
        "batched_generated_tokens_per_s": new_tokens / t_batched,
        "single_examples_per_s": single / t_one,
        "speedup_batched_vs_single": (len(prompts) / t_batched) / (single / t_one),
        "speedup_same_prompts": t_one / t_batched_subset,
        "identical_outputs": batched_subset == one,
    }


def peak_memory(clients: int, flan_dir: Path, setting: dict) -> dict:
    """Peak memory (`own_peaks`) of a subprocess running a 1-round, 1-step FLAN job with
    `clients` clients (of FLAN's 8); `setting`: model, device and dtype."""
    categories = ["coreference", "entailment", "paraphrase", "structure_to_text", "linguistic_acceptability",
                  "question_classification", "text_formatting", "word_disambiguation"][:clients]
    overrides = {**setting, "rounds": 1, "local_steps": 1, "eval": {"base_model": False, "max_new_tokens": 1},
                 "data": {"name": "flan", "dir": str(flan_dir), "clients": categories, "max_test": 1}}
    code = ("import tempfile; from bench import own_peaks; from pflalign.config import build_config; "
            "from pflalign.run.engine import run; run(build_config(None, json.loads(sys.argv[1])), tempfile.mkdtemp(), "
            "progress=False); print(json.dumps(own_peaks()))")
    return python_json(code, overrides)


SECTIONS = ("train", "round_flan", "round_dolly", "generation", "memory")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="folder with flan/ and dolly/ (e.g. ../shared/data)")
    parser.add_argument("--out", default="benchmarks/results/latest.json")
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per dataset")
    parser.add_argument("--model", default="smollm2-135m", help="model spec, as for `pflalign run --model`")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on CPU, bfloat16 on a GPU")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (default: all): {', '.join(SECTIONS)}")
    args = parser.parse_args()
    allocator.reexec_under_mimalloc()  # as the pflalign command does; its subprocesses too (python_json)
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    if not only or only - set(SECTIONS):
        parser.error(f"unknown section(s) {sorted(only - set(SECTIONS))}; valid: {', '.join(SECTIONS)}")
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available")
    setting = {"model": args.model, "device": args.device, "dtype": dtype}
    data = Path(args.data_dir)
    report: dict = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                                "cpus": os.cpu_count(), "torch": torch.__version__,
                                "threads": torch.get_num_threads(), "memory_allocator": allocator.active()},
                    "setting": setting}
    if args.device != "cpu":
        report["machine"]["gpu"] = torch.cuda.get_device_name(args.device)
    peak = matmul_peak(device=args.device, dtype=getattr(torch, dtype))
    report["matmul_peak_gflops"] = peak
    print(f"{dtype} matmul peak on {args.device}: {peak:.1f} GFLOP/s")

    lm = FederatedLM.build(args.model, LoraSettings(), seed=0, dtype=getattr(torch, dtype), device=args.device)
    flan = federation("flan", str(data / "flan"), None, 42, None, 64, FederationOptions())[0]
    dolly = federation("dolly", str(data / "dolly" / "databricks-dolly-15k.jsonl"), None, 42, None, None,
                       FederationOptions())[0]
    if "train" in only:
        report["train_flan"] = bench_training(lm, flan, 4, args.steps, 1024, peak)
        report["train_dolly"] = bench_training(lm, dolly, 4, args.steps, 1024, peak)
        report["mfu"] = report["train_flan"]["mfu"]
        for key in ("train_flan", "train_dolly"):
            r = report[key]
            print(f"{key}: {r['tokens_per_s']:.0f} tok/s, {r['gflops']:.1f} GFLOP/s, MFU {r['mfu']:.1%} against "
                  f"{r['matmul_peak_gflops']:.1f} GFLOP/s (mean of the probes between steps; "
                  f"{r['mfu_vs_start_peak']:.1%} against the start's {peak:.1f})")

    base = {**setting, "rounds": 3, "eval": {"base_model": False}}  # a warm-up round and two timed ones
    for name, data_cfg in (("flan", {"name": "flan", "dir": str(data / "flan"), "max_test": 1}),
                           ("dolly", {"name": "dolly", "dir": str(data / "dolly" / "databricks-dolly-15k.jsonl"),
                                      "max_test": 1})):
        if f"round_{name}" not in only:
            continue
        r = report[f"round_{name}"] = bench_round({**base, "data": data_cfg})
        print(f"round_{name}: {r['seconds']:.1f} s per round, {r['non_pad_tokens_per_s']:.0f} non-pad tok/s, "
              f"overhead {r['overhead_share']:.1%} (rounds: "
              + ", ".join(f"{x['seconds']:.1f} s, {x['overhead_share']:.1%}" for x in r["per_round"]) + "), "
              f"checkpoint {r['checkpoint_mb']:.0f} MB, peak RSS {r['peak_rss_gb']:.2f} GB, "
              f"matmul peak before/after {r['matmul_peak_before_after_gflops'][0]:.0f}/{r['matmul_peak_before_after_gflops'][1]:.0f} GFLOP/s"
              + (f", CUDA peak {r['peak_cuda_gb']:.2f} GB" if "peak_cuda_gb" in r else ""))

    test = [ex for c in flan for ex in c.test[:16]]
    if "generation" in only:
        report["generation_flan"] = bench_generation(lm, test, 128, 64, single=16)
        g = report["generation_flan"]
        print(f"generation: batched {g['batched_examples_per_s']:.2f} ex/s vs single {g['single_examples_per_s']:.2f} ex/s "
              f"= {g['speedup_batched_vs_single']:.1f}x; same 16 prompts: {g['speedup_same_prompts']:.1f}x, identical={g['identical_outputs']}")

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")  # kept if the memory step fails
    if "memory" in only:
        peaks = {f"{n}_clients": peak_memory(n, data / "flan", setting) for n in (4, 8)}
        for key in ("peak_rss_gb", "peak_cuda_gb"):  # the latter on a GPU only
            if key not in peaks["4_clients"]:
                continue
            report[key] = {n: p[key] for n, p in peaks.items()}
            print(f"{key}: {report[key]} ({report[key]['8_clients'] / report[key]['4_clients']:.2f}x with 8 clients)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
