"""What a decode step of the final evaluation costs as the prompts grow (Dolly's are long).

    .venv/bin/python benchmarks/decode_context.py --lengths 64,256,600 --out benchmarks/results/decode_context.json

The default model (SmolLM2-135M, float32, its LoRA adapter unmerged as `--batch clients` scores)
decodes `--rows` random prompts of about each length with `evaluate.greedy_ids`, as one group
(no refill). Every forward call is timed: the prefill, then each decode step (one token for every
row). A second, shorter decode of the same prompts runs under torch.profiler from its first
decode step on, so the op table is the decode steps' own (`top_ops`: each op's share of their
CPU time). On FLAN's prompts (69-88 tokens) a step costs about what reading the weights costs
(benchmarks/README.md, "A Table 1 run's final evaluation"); on Dolly's (up to 1,024 tokens with
their context) the KV cache is read by the attention and, in transformers' DynamicCache, copied
whole by a `torch.cat` at every step: this shows how much each costs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pflalign.evaluate import greedy_ids
from pflalign.model import FederatedLM, LoraSettings


def timed_decode(model, prompts: list[list[int]], pad_id: int, new_tokens: int) -> dict:
    """Seconds of the prefill and of each decode step of one group of prompts."""
    calls, forward = [], model.forward

    def timed(*args, **kwargs):
        tic = time.perf_counter()
        out = forward(*args, **kwargs)
        calls.append((kwargs["input_ids"].shape[1], time.perf_counter() - tic))
        return out

    model.forward = timed
    try:
        greedy_ids(model, prompts, pad_id, [-1], new_tokens, len(prompts), refill_at=0)
    finally:
        model.forward = forward
    steps = [s for width, s in calls if width == 1]
    return {"prefill_seconds": sum(s for width, s in calls if width > 1),
            "decode_steps": len(steps), "decode_ms_per_step": 1000 * sum(steps) / len(steps)}


def decode_ops(model, prompts: list[list[int]], pad_id: int, new_tokens: int, top: int) -> list[dict]:
    """The decode steps' op table: each op's share of their CPU time (the prefill not profiled)."""
    forward, prof = model.forward, profile(activities=[ProfilerActivity.CPU])
    started = []

    def profiled(*args, **kwargs):
        if kwargs["input_ids"].shape[1] == 1 and not started:
            prof.__enter__()
            started.append(True)
        return forward(*args, **kwargs)

    model.forward = profiled
    try:
        greedy_ids(model, prompts, pad_id, [-1], new_tokens, len(prompts), refill_at=0)
    finally:
        model.forward = forward
        if started:
            prof.__exit__(None, None, None)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in events[:top]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="64,256,600", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--rows", type=int, default=64, help="prompts decoded together (eval.batch_size's default)")
    p.add_argument("--new-tokens", type=int, default=24, help="decode steps timed (plus the first token)")
    p.add_argument("--profile-tokens", type=int, default=12)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    lm = FederatedLM.build("smollm2-135m", LoraSettings(r=16, alpha=32), seed=0)
    model, pad = lm.model, lm.tokenizer.pad_token_id
    report = {"what": __doc__.splitlines()[0], "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "rows": args.rows, "lengths": {}}
    for length in map(int, args.lengths.split(",")):
        g = torch.Generator().manual_seed(length)
        # lengths a few tokens apart, as a group sorted by length has: padded, masked
        prompts = [torch.randint(100, 40000, (length - i % 7,), generator=g).tolist() for i in range(args.rows)]
        row = timed_decode(model, prompts, pad, args.new_tokens + 1)
        row["top_ops"] = decode_ops(model, prompts, pad, args.profile_tokens + 1, args.top)
        report["lengths"][length] = row
        ops = ", ".join(f"{o['op'].removeprefix('aten::')} {100 * o['share']:.0f}%" for o in row["top_ops"][:4])
        print(f"{length} tokens: prefill {row['prefill_seconds']:.1f} s, decode {row['decode_ms_per_step']:.0f} ms "
              f"a step ({ops})", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
