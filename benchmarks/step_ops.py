"""What a training step dispatches on CUDA's bf16 route (issue 55's single-client target), counted
on the CPU: each aten operation but a view is one kernel launch or more on a GPU, where a step at
short sequences is bound by launches (LLaMA-3.2-1B at 4 x 256: about 0.1 s a step against ~10 ms
of arithmetic at the measured peak, benchmarks/results/gpu-batched.json). Views apart.

    .venv/bin/python benchmarks/step_ops.py --out benchmarks/results/step-ops.json

gpu.py's architectures with every layer and LoRA r16 projection at toy widths (the count follows
the layers and tensors, not their widths), a bf16 base under float32 adapters, the forward under
torch.autocast(bfloat16) as `FederatedLM.adapter_autocast` runs it on CUDA (forced here), flat
updates forced (params.FLAT_DEVICES, CUDA's): one client's step (`loss_and_grads` on a padded batch
of 4 x 64) and 4 and 12 clients' step in one routed pass (`routed_loss_and_grads`, `--batch
clients`; 12: three runs' clients, `--batch runs`).
Each both ways: as the library runs it now, and as a plain autocast step runs it (PEFT's cast of
each LoRA branch's input to float32, autocast's cast of every adapter tensor and of its gradient
back), which is what the HF + PEFT anchor of gpu.py runs. Loss and gradients are bit for bit the
same both ways (tests/test_mixed_precision.py); the second step of each is counted (the first
allocates the gradients' buffers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pflalign import params as P  # noqa: E402
from pflalign.config import LoraSettings  # noqa: E402
from pflalign.model import FederatedLM, multi_lora  # noqa: E402

ARCHS = ("llama-3.2-1b", "smollm2-135m")
CLIENTS, BATCH, TOKENS = (4, 12), 4, 64  # clients in one pass: a round's, and three runs' in lockstep


class Counting(TorchDispatchMode):
    """Counts dispatched operations: views (metadata only, no kernel) apart from the rest, by name."""

    def __init__(self):
        super().__init__()
        self.ops, self.views = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def plain_autocast():
    """The step as plain autocast runs it (the module docstring's "as a plain autocast step")."""
    saved = (FederatedLM.adapter_autocast, FederatedLM._live_adapter_products, multi_lora._for_products)
    FederatedLM.adapter_autocast = lambda self: torch.autocast(self.device.type, dtype=torch.bfloat16)
    FederatedLM._live_adapter_products = lambda self, tokens: contextlib.nullcontext()
    multi_lora._for_products = lambda tokens, a: tokens.to(a.dtype)
    try:
        yield
    finally:
        FederatedLM.adapter_autocast, FederatedLM._live_adapter_products, multi_lora._for_products = saved


def toy_model(name: str) -> FederatedLM:
    from gpu import ARCHS as SPECS
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = {k: v for k, v in SPECS[name].items() if k != "family"}
    spec.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**spec)).to(torch.bfloat16)
    lm = FederatedLM.from_base(base, None, LoraSettings(r=16, alpha=32), seed=0, device="cpu")
    lm.autocast = True
    return lm


def count(name: str) -> dict:
    lm = toy_model(name)
    gen = torch.Generator().manual_seed(0)

    def batch() -> dict:
        ids = torch.randint(3, 512, (BATCH, TOKENS), generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.masked_fill(ids < 200, -100)}

    batches = [batch() for _ in range(max(CLIENTS))]
    adapters = [{n: p.detach().clone().requires_grad_(True) for n, p in lm.lora.items()} for _ in range(max(CLIENTS))]
    steps = {"one_client": lambda: lm.loss_and_grads(batches[0], unpadded=False)}
    for k in CLIENTS:
        steps[f"{k}_clients_one_pass"] = lambda k=k: lm.routed_loss_and_grads(batches[:k], adapters[:k], unpadded=False)
    row = {"lora_tensors": len(lm.lora)}
    for key, step in steps.items():
        got = {}
        for way, context in (("now", contextlib.nullcontext), ("plain_autocast", plain_autocast)):
            with context():
                step()
                counting = Counting()
                with counting:
                    step()
            got[way] = {"ops": sum(counting.ops.values()), "views": counting.views,
                        "casts": counting.ops["_to_copy"]}
        got["ops_now_over_plain"] = got["now"]["ops"] / got["plain_autocast"]["ops"]
        row[key] = got
        print(f"{name:14s} {key:20s} {got['plain_autocast']['ops']:6,d} -> {got['now']['ops']:6,d} operations"
              f" ({got['ops_now_over_plain'] - 1:+.1%}; casts {got['plain_autocast']['casts']} -> {got['now']['casts']}),"
              f" views {got['plain_autocast']['views']:,d} -> {got['now']['views']:,d}", flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step-ops.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    saved = P.FLAT_DEVICES
    P.FLAT_DEVICES = {"cpu", "cuda"}
    try:
        report = {"doc": __doc__, "clients": CLIENTS, "batch": BATCH, "tokens": TOKENS, "torch": torch.__version__}
        for name in ARCHS:
            report[name] = count(name)
    finally:
        P.FLAT_DEVICES = saved
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
