"""What a decode step of the final scoring dispatches (issue 55's scoring bill), counted on the CPU:
each aten operation but a view is one kernel launch or more on a GPU, where scoring's decode step is
bound by launches, not arithmetic (benchmarks/results/gpu_eval_batch.json: LLaMA-3.2-1B took the
same time a step at 64 and at 256 rows). Views (metadata only) are counted apart.

    .venv/bin/python benchmarks/decode_ops.py --out benchmarks/results/decode-ops.json

The architectures of gpu.py (SmolLM2-135M: 30 layers; LLaMA-3.2-1B: 16), every layer and LoRA r16
projection kept, widths cut to toy sizes (the count of operations follows the layers and
projections, not their widths), random weights that never end an answer early, float32 (and
CUDA's two modes again with a bfloat16 base under float32 adapters, as gpu.py builds it). The
scoring's three ways of decoding (gpu.py's `scoring` section): `merged`, one model's adapter
folded into the base (the sequential engine's scoring, one model after another); `per_row` with
K adapters in one loop, each row its own adapter unmerged (`--batch clients`/`runs`), as CUDA
runs it (each projection gathers its rows' factors: multi_lora.GATHER_DEVICES, forced here) and
as the CPU runs it (a pair of products per run of rows of one adapter). Each at ROWS rows, prompts
of PROMPT_TOKENS (uneven: the padded mask's path, as real prompts take). Per decode step: the
operations and views, per layer, and the step's seconds on this CPU (toy widths: the host's
share of a step, indicative only; one thread).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pflalign.evaluate import greedy_ids  # noqa: E402
from pflalign.model import multi_lora  # noqa: E402
from pflalign.run.batched_scoring import generate_per_adapter  # noqa: E402

ROWS = 64  # the CPU's eval.batch_size; decode steps cost the same launches at any row count
PROMPT_TOKENS = (40, 80)  # each prompt's length drawn in this range: uneven, so the mask is padded
NEW_TOKENS = 9  # a short and a long decode differ by NEW_TOKENS - 1 steps
ARCHS = ("smollm2-135m", "llama-3.2-1b")
ADAPTERS = (1, 8)  # per_row: one adapter (a run's single model) and a round's 4 clients x 2 models
# (base dtype, (mode, adapters) counted): every mode in float32 (the CPU's, and the GPU runs'); CUDA's
# two modes with a bf16 base under float32 adapters (gpu.py's scoring section)
CASES = ((torch.float32, [("merged", 1)] + [(m, k) for m in ("per_row_gather", "per_row_loop") for k in ADAPTERS]),
         (torch.bfloat16, [("merged", 1), ("per_row_gather", 8)]))


class Counting(TorchDispatchMode):
    """Counts dispatched operations: views (metadata only, no kernel) apart from the rest, by name."""

    def __init__(self):
        super().__init__()
        self.ops, self.views = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.views if func.is_view else self.ops)[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def toy_model(name: str, base_dtype: torch.dtype = torch.float32):
    """(FederatedLM with LoRA r16 alpha32 on every linear layer, its layer count) of gpu.py's
    architecture `name` at toy widths, every layer kept; the base in `base_dtype`, as gpu.py builds
    it (bfloat16: the adapters stay float32)."""
    from gpu import ARCHS as SPECS
    from gpu import _Ids
    from transformers import LlamaConfig, LlamaForCausalLM

    from pflalign.config import LoraSettings
    from pflalign.model import FederatedLM

    spec = {k: v for k, v in SPECS[name].items() if k != "family"}
    spec.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=None, pad_token_id=0)  # no EOS
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**spec)).to(base_dtype)
    lm = FederatedLM.from_base(base, None, LoraSettings(r=16, alpha=32), seed=0, device="cpu")
    lm.tokenizer = _Ids()  # random ids: no tokenizer (generate decodes the answers)
    return lm, spec["num_hidden_layers"]


def decode(lm, mode: str, adapters: int, new_tokens: int, prompts: list[list[int]]) -> None:
    """One scoring loop over `prompts` in `mode` (module docstring), `new_tokens` each, no EOS."""
    if mode == "merged":
        with lm.merged():
            greedy_ids(lm.model, prompts, 0, [], new_tokens, ROWS)
        return
    gen = torch.Generator().manual_seed(1)
    stack = []
    for _ in range(adapters):
        adapter = {n: t.detach().clone() for n, t in lm.lora.items()}
        for t in adapter.values():
            t.add_(torch.randn(t.shape, generator=gen) * 1e-2)
        stack.append(adapter)
    share = -(-len(prompts) // adapters)
    sets = [(stack[j], prompts[j * share:(j + 1) * share]) for j in range(adapters)]
    saved = multi_lora.GATHER_DEVICES
    multi_lora.GATHER_DEVICES = {"cpu", "cuda"} if mode == "per_row_gather" else set()
    try:
        generate_per_adapter(lm, [s for s in sets if s[1]], new_tokens, ROWS)
    finally:
        multi_lora.GATHER_DEVICES = saved


def per_step(lm, mode: str, adapters: int, prompts: list[list[int]]) -> dict:
    """Operations, views and CPU seconds of one decode step: (a loop of NEW_TOKENS) − (a loop of 1,
    the prefill alone), over NEW_TOKENS − 1 steps."""
    decode(lm, mode, adapters, 2, prompts)  # warm-up
    counted = {}
    for n in (1, NEW_TOKENS):
        counting = Counting()
        with counting:
            decode(lm, mode, adapters, n, prompts)
        best = float("inf")
        for _ in range(3):
            tic = time.perf_counter()
            decode(lm, mode, adapters, n, prompts)
            best = min(best, time.perf_counter() - tic)
        counted[n] = (counting, best)
    (short, s1), (long, s2) = counted[1], counted[NEW_TOKENS]
    steps = NEW_TOKENS - 1
    ops = {k: (long.ops[k] - short.ops[k]) / steps for k in long.ops}
    top = dict(sorted(((k, v) for k, v in ops.items() if v), key=lambda kv: -kv[1])[:12])
    return {"ops": sum(ops.values()), "views": sum(long.views.values()) / steps - sum(short.views.values()) / steps,
            "prefill_ops": sum(short.ops.values()), "seconds_cpu": (s2 - s1) / steps, "top_ops": top}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode-ops.json"))
    parser.add_argument("--archs", default=",".join(ARCHS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = {"doc": __doc__, "rows": ROWS, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
              "torch": torch.__version__}
    gen = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(*PROMPT_TOKENS, (ROWS,), generator=gen)]
    for name in args.archs.split(","):
        row = {"layers": None}
        for dtype, modes in CASES:
            lm, layers = toy_model(name, dtype)
            row["layers"] = layers
            for mode, adapters in modes:
                key = (mode if mode == "merged" else f"{mode}_{adapters}") + ("" if dtype == torch.float32 else "_bf16_base")
                got = per_step(lm, mode, adapters, prompts)
                got["ops_per_layer"] = got["ops"] / layers
                row[key] = got
                print(f"{name:14s} {key:28s} {got['ops']:7,.0f} ops a decode step ({got['ops_per_layer']:.1f} a layer),"
                      f" {got['views']:6,.0f} views, {1e3 * got['seconds_cpu']:6.1f} ms on this CPU", flush=True)
        report[name] = row
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
