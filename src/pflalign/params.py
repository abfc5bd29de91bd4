"""Adapter-sized dicts of tensors (`Params`: LoRA tensors by name), their copies,
and the names of a LoRA pair's tensors.

Below both the model and the methods: `FederatedLM.get_lora` and every
method's state use the same allocation (one flat buffer per copy, see
`empty_like`). `methods.base` re-exports these for the methods.
"""

from __future__ import annotations

import torch

Params = dict[str, torch.Tensor]


def empty_like(params: Params, dtype: torch.dtype | None = None) -> Params:
    """Uninitialised tensors shaped as `params`, as views of one flat buffer.

    Why one buffer: adapter-sized state (an adapter copy, a client's moments)
    lives across many steps. Hundreds of small tensors allocated between two
    steps land in the holes that the last step's freed activations left in
    the heap and keep them from merging again, so the next long example
    needs fresh memory; one large buffer is mapped on its own and is
    returned whole when freed. Each view is still an independent tensor.
    """
    if not params:
        return {}
    first = next(iter(params.values()))
    if any(t.dtype != first.dtype or t.device != first.device for t in params.values()):
        return {n: torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device) for n, t in params.items()}
    flat = torch.empty(sum(t.numel() for t in params.values()), dtype=dtype or first.dtype, device=first.device)
    views, offset = {}, 0
    for n, t in params.items():
        views[n] = flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
    return views


def clone(params: Params) -> Params:
    out = empty_like(params)
    for n, t in params.items():
        out[n].copy_(t.detach())
    return out


def zeros_like(params: Params, dtype: torch.dtype | None = None) -> Params:
    out = empty_like(params, dtype)
    for t in out.values():
        t.zero_()
    return out


# ---- a LoRA pair (A_l, B_l) by its tensors' names ----------------------------------
def is_lora_a(name: str) -> bool:
    """PEFT names A as `...lora_A.<adapter>.weight` (B likewise with lora_B)."""
    return "lora_A" in name


def is_lora_b(name: str) -> bool:
    return "lora_B" in name


def lora_b_name(a_name: str) -> str:
    """The B of the pair that A belongs to."""
    return a_name.replace("lora_A", "lora_B")
