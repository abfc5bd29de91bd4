"""Clients in lockstep on the CPU (`--batch clients`): one pass for K clients against K passes.

    .venv/bin/python benchmarks/batched.py --out benchmarks/results/batched-cpu.json

SmolLM2-135M's architecture (gpu.py's ARCHS, random weights, float32 as on CPU runs) with LoRA
r16 α32 on every linear layer; K clients with adapters of their own and FLAN-shaped minibatches
(4 examples of 60 to 250 tokens, the last third the response). The same batches two ways, in
one process: one client after another (`set_lora` + `loss_and_grads`, the sequential engine's
step) and all K in one pass (`lockstep.shared_pass`, the lockstep engine's: `routed_loss_and_grads`,
or for K = 1 the client's own pass). Both pack rows of
at most 512 tokens and keep one row's activations at a time, so their memory is alike. Each
setting's fastest of `--repeats` timed passes (after one untimed), tokens/s, the ratio, and the
largest relative difference of a client's gradient between the two (a check, not a timing).
The machine may be shared (a background job at nice 19 on ours): figures are indicative.
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
from gpu import ARCHS  # noqa: E402

from pflalign.config import LoraSettings  # noqa: E402
from pflalign.model import FederatedLM  # noqa: E402
from pflalign.prompts import IGNORE  # noqa: E402
from pflalign.run.lockstep import PassSize, own_adapter, shared_pass  # noqa: E402


def build(arch: str, layers: int | None) -> FederatedLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(ARCHS[arch])
    if layers is not None:  # the architecture's layers, fewer of them (a quicker measurement)
        spec["num_hidden_layers"] = layers
    assert spec.pop("family") == "llama"
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**spec))
    return FederatedLM.from_base(base, None, LoraSettings(r=16, alpha=32), seed=0, device="cpu")


def flan_batch(g: torch.Generator, vocab: int, size: int = 4) -> dict:
    lengths = torch.randint(60, 251, (size,), generator=g).tolist()
    width = max(lengths)
    ids = torch.randint(3, vocab, (size, width), generator=g)
    mask = torch.zeros(size, width, dtype=torch.long)
    labels = torch.full((size, width), IGNORE)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        labels[i, 2 * n // 3:n] = ids[i, 2 * n // 3:n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def timed(fn, repeats: int) -> float:
    """The fastest of `repeats` calls after an untimed one: on a shared machine the least disturbed."""
    fn()  # untimed: first-call allocations
    seconds = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - tic)
    return min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="smollm2-135m")
    parser.add_argument("--clients", default="1,4,12", help="K values, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, help="build the architecture with this many layers (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lm = build(args.arch, args.layers)
    vocab = ARCHS[args.arch]["vocab_size"]
    rows = []
    for k in [int(x) for x in args.clients.split(",")]:
        g = torch.Generator().manual_seed(k)
        batches = [flan_batch(g, vocab) for _ in range(k)]
        adapters = []
        for _ in range(k):
            live = own_adapter(lm.lora)
            with torch.no_grad():
                for t in live.values():
                    t.add_(torch.randn(t.shape, generator=g) * 0.01)
            adapters.append(live)
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        alone_grads = []

        def one_at_a_time():
            alone_grads.clear()
            for b, adapter in zip(batches, adapters):
                lm.set_lora(adapter)
                _, grads = lm.loss_and_grads(b)
                alone_grads.append({n: t.clone() for n, t in grads.items()})

        def lockstep():  # the engine's pass (one client: its own pass, `lockstep.alone`)
            shared_pass(lm, batches, adapters, PassSize())

        sequential_s = timed(one_at_a_time, args.repeats)
        lockstep_s = timed(lockstep, args.repeats)
        diff = max(float((a.grad - alone[n]).norm() / alone[n].norm().clamp_min(1e-30))
                   for adapter, alone in zip(adapters, alone_grads) for n, a in adapter.items())
        row = {"clients": k, "tokens": tokens, "sequential_s": sequential_s, "lockstep_s": lockstep_s,
               "sequential_tok_s": tokens / sequential_s, "lockstep_tok_s": tokens / lockstep_s,
               "lockstep_over_sequential": sequential_s / lockstep_s, "max_grad_rel_diff": diff}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"arch": args.arch, "layers": args.layers or ARCHS[args.arch]["num_hidden_layers"],
              "command": "benchmarks/batched.py " + " ".join(sys.argv[1:]), "timing": f"fastest of {args.repeats}", "dtype": "float32", "lora": "r16 alpha32 all-linear", "batch": "4 FLAN-shaped examples",
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
              "note": "shared machine (a background job at nice 19): indicative figures", "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
