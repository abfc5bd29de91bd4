"""Where a run's final evaluation spends its time: prefill and decode, per model and client.

    .venv/bin/python benchmarks/final_eval.py RUN_DIR --out benchmarks/results/final_eval.json

RUN_DIR is a finished (or checkpointed) run folder with its checkpoint, e.g. a
Table 1 run outside the work tree. The run's final adapters are loaded and each
scored model (personalized, global; the base model is cached across runs, see
model/base_cache.py) generates for every test prompt exactly as `Federation.evaluate`
does. Every forward call is timed: a call with more than one input position is
a prefill (the left-padded batch of prompts), one with a single position a
decode step (one new token for each row still running).

Reported, next to the machine's fp32 matmul peak (bench.matmul_peak, measured
at the start):
  * seconds, calls, tokens (padded prompt tokens for prefill, row-steps for
    decode) and model GFLOP/s of each phase, per model and client;
  * a least-squares fit of a decode step's time as ``fixed + per_row * rows``:
    the fixed part is what every step pays whatever its batch (reading the
    weights, ~540 MB in fp32 for SmolLM2-135M, and dispatch), the per-row part
    the compute;
  * whether the outputs equal the run's own predictions.jsonl (they need not be
    bit-equal when the run used another thread count, see
    docs/results/table1-flan/README.md).

FLOPs per token and forward: 2·d_in·d_out for each linear layer of the backbone
(the adapter is merged into the weights while generating), the LM head's
2·d_model·V once per row and call (logits of the last position only), and
attention's 4·L·d_model per layer for a position attending to L positions
(halved within a causal prefill). Pad tokens are counted: they are computed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import linear_shapes, matmul_peak  # noqa: E402

from pflalign import checkpoint as ckpt  # noqa: E402
from pflalign.run.client import score_client  # noqa: E402
from pflalign.config import build_config  # noqa: E402
from pflalign.run.engine import Federation  # noqa: E402


class ForwardTimer:
    """Wraps the model's forward: time and size of every prefill and decode call."""

    def __init__(self, model, per_token_linear: float, head: float, d_model: int, layers: int):
        self.model, self.original = model, model.forward
        self.per_token_linear, self.head, self.d_model, self.layers = per_token_linear, head, d_model, layers
        self.calls: list[dict] = []
        model.forward = self.forward

    def forward(self, *args, **kwargs):
        ids, cache = kwargs["input_ids"], kwargs.get("cache", kwargs.get("past_key_values"))
        past = 0 if cache is None else cache.get_seq_length()
        tic = time.perf_counter()
        out = self.original(*args, **kwargs)
        seconds = time.perf_counter() - tic
        rows, width = ids.shape
        if width > 1:  # prefill: causal attention over the prompt
            attention = rows * self.layers * 4 * self.d_model * width * width / 2
        else:
            attention = rows * self.layers * 4 * self.d_model * (past + 1)
        flops = rows * width * self.per_token_linear + rows * self.head + attention
        self.calls.append({"rows": rows, "width": width, "seconds": seconds, "flops": flops})
        return out

    def take(self) -> list[dict]:
        calls, self.calls = self.calls, []
        return calls

    def close(self) -> None:
        self.model.forward = self.original


def phase(calls: list[dict], peak: float) -> dict:
    seconds = sum(c["seconds"] for c in calls)
    flops = sum(c["flops"] for c in calls)
    return {"seconds": seconds, "calls": len(calls), "tokens": sum(c["rows"] * c["width"] for c in calls),
            "gflops_per_s": flops / seconds / 1e9 if seconds else None,
            "share_of_peak": flops / seconds / 1e9 / peak if seconds else None}


def decode_fit(calls: list[dict]) -> dict | None:
    """Least squares of a decode step's seconds on its number of rows."""
    if len(calls) < 3 or len({c["rows"] for c in calls}) < 2:
        return None
    x = torch.tensor([[1.0, c["rows"]] for c in calls], dtype=torch.float64)
    y = torch.tensor([c["seconds"] for c in calls], dtype=torch.float64)
    fixed, per_row = torch.linalg.lstsq(x, y[:, None]).solution.flatten().tolist()
    return {"fixed_ms_per_step": 1000 * fixed, "ms_per_row": 1000 * per_row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder with its checkpoint")
    parser.add_argument("--out", type=Path, required=True, help="JSON to write")
    parser.add_argument("--models", default="personalized,global", help="comma-separated: personalized, global")
    args = parser.parse_args()

    cfg = build_config(None, json.loads((args.run / ckpt.CONFIG).read_text()))
    fed = Federation(cfg, progress=False, out=args.run)
    fed.restore(ckpt.load_run_checkpoint(args.run))
    lm = fed.lm
    base = lm.model.get_base_model().config
    per_token_linear = sum(2 * d_in * d_out for d_in, d_out, _ in linear_shapes(lm.model))
    head = 2 * base.hidden_size * base.vocab_size
    run_predictions = []
    if (args.run / ckpt.PREDICTIONS).exists():
        run_predictions = [json.loads(line) for line in (args.run / ckpt.PREDICTIONS).read_text().splitlines()]

    peak = matmul_peak()
    timer = ForwardTimer(lm.model, per_token_linear, head, base.hidden_size, base.num_hidden_layers)
    adapters = {"personalized": fed.personalized_of, "global": lambda k: fed.global_params}
    report: dict = {"models": {}}
    try:
        for model_name in args.models.split(","):
            rows, prefill_all, decode_all = [], [], []
            tic_model = time.perf_counter()
            for k in fed.eval_ids:
                client = fed.clients[k]
                tic = time.perf_counter()
                score, outputs = score_client(lm, client.data.test, adapters[model_name](k), cfg, "", False)
                seconds = time.perf_counter() - tic
                calls = timer.take()
                prefill = [c for c in calls if c["width"] > 1]
                decode = [c for c in calls if c["width"] == 1]
                prefill_all += prefill
                decode_all += decode
                theirs = [p[model_name] for p in run_predictions if p["task"] == client.name]
                rows.append({"client": client.name, "prompts": len(outputs), "rouge_l": score, "seconds": seconds,
                             "prefill": phase(prefill, peak), "decode": phase(decode, peak),
                             "decode_fit": decode_fit(decode),
                             "outputs_equal_run": (sum(a == b for a, b in zip(outputs, theirs))
                                                   if len(theirs) == len(outputs) else None)})
                print(f"{model_name} {client.name}: {seconds:.1f} s (prefill {rows[-1]['prefill']['seconds']:.1f}, "
                      f"decode {rows[-1]['decode']['seconds']:.1f}), ROUGE-L {score:.2f}", flush=True)
            report["models"][model_name] = {
                "seconds": time.perf_counter() - tic_model, "prefill": phase(prefill_all, peak),
                "decode": phase(decode_all, peak), "decode_fit": decode_fit(decode_all), "clients": rows}
    finally:
        timer.close()
    report.update({
        "run": str(args.run), "method": cfg.method, "seed": cfg.seed,
        "eval": {"batch_size": cfg.eval.batch_size, "max_new_tokens": cfg.eval.max_new_tokens},
        "matmul_peak_gflops_at_start": peak, "threads": torch.get_num_threads(),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    })
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
