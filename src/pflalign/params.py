"""Adapter-sized dicts of tensors (`Params`: LoRA tensors by name), their copies,
and the names of a LoRA pair's tensors.

Below both the model and the methods: `FederatedLM.get_lora` and every
method's state use the same allocation (one flat buffer per copy, see
`empty_like`). `methods.base` re-exports these for the methods.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

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
    return views_of(flat, {n: t.shape for n, t in params.items()})


# Where an adapter-sized update runs as one operation over its flat buffer instead of one per tensor:
# CUDA, where each operation is a kernel launch (pFLAlign's step is ~42 operations on each of
# SmolLM2's 420 LoRA tensors, ~17.6k launches a client step). The CPU keeps tensor by tensor: a small
# tensor stays in cache through all its operations, and a flat pass was no faster there (46-120 ms
# against 45 ms a pFLAlign step, benchmarks/README.md).
FLAT_DEVICES = {"cuda"}


def on_flat_device(params: Params) -> bool:
    """Whether `params` (non-empty) lie on a device of `FLAT_DEVICES`, judged by their first tensor."""
    return bool(params) and next(iter(params.values())).device.type in FLAT_DEVICES


def flat_buffer(params: Params) -> torch.Tensor | None:
    """The 1-D tensor whose consecutive pieces are `params`' tensors, in order (as `empty_like`
    makes them), detached; None when they are not such views (separately allocated tensors)."""
    tensors = list(params.values())
    if not tensors:
        return None
    first = tensors[0]
    start = offset = first.storage_offset()
    where = first.untyped_storage().data_ptr()
    for t in tensors:  # no operation per tensor (these are its metadata): a step pays for the flat view only
        if (not t.is_contiguous() or t.dtype != first.dtype or t.untyped_storage().data_ptr() != where
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    return first.detach().as_strided((offset - start,), (1,), start)


def flat_buffers(*dicts: Params) -> list[torch.Tensor] | None:
    """Each dict's `flat_buffer`, when every one has one, the dicts hold the same names in the same
    order with the same shapes (so that their flat buffers align coordinate by coordinate) and they
    lie on a device of `FLAT_DEVICES`; else None (update tensor by tensor)."""
    first = dicts[0]
    if not on_flat_device(first):
        return None
    names = list(first)
    if any(list(d) != names or any(d[n].shape != first[n].shape for n in names) for d in dicts[1:]):
        return None
    flats = [flat_buffer(d) for d in dicts]
    return None if any(f is None for f in flats) else flats


FLAT_PIECE = "(flat)"  # the name of the one piece of `aligned_named` over flat buffers


def aligned_named(*dicts: Params) -> list[tuple[str, tuple[torch.Tensor, ...]]]:
    """The dicts' tensors as named pieces to update one after another, each a tuple of one tensor
    per dict, coordinate by coordinate aligned: their flat buffers as the one piece `FLAT_PIECE`
    where `flat_buffers` gives them (CUDA), else a piece per name of the first dict. (A piece's name
    keys per-tensor state such as AdamW's moments: the same all round, as are the buffers.)"""
    flats = flat_buffers(*dicts)
    if flats is not None:
        return [(FLAT_PIECE, tuple(flats))]
    return [(n, tuple(d[n] for d in dicts)) for n in dicts[0]]


def aligned(*dicts: Params) -> list[tuple[torch.Tensor, ...]]:
    """`aligned_named`'s pieces without their names."""
    return [piece for _, piece in aligned_named(*dicts)]


def mapped(fn, *dicts: Params) -> Params:
    """`fn`, an element-wise function of aligned tensors (one per dict), over the dicts: a dict with
    the first dict's names, `fn` applied once to their flat buffers where `flat_buffers` gives them
    (CUDA: the result is views of its one output), else once per name (w + Δ_k: `mapped(torch.add,
    w, delta)`). The same arithmetic coordinate by coordinate either way."""
    flats = flat_buffers(*dicts)
    if flats is not None:
        return views_of(fn(*flats), {n: t.shape for n, t in dicts[0].items()})
    return {n: fn(*(d[n] for d in dicts)) for n in dicts[0]}


def in_order(params: Params, names) -> Params:
    """`params` keyed in the order of `names` (a dict's order decides whether it aligns with another's
    flat buffer, and the order of a sum over it its last bits)."""
    return {n: params[n] for n in names}


@torch.no_grad()
def copy_each(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """targets[i] ← sources[i] for every i: one multi-tensor copy (`torch._foreach_copy_`) on a
    device of `FLAT_DEVICES`, where a copy per tensor is a launch each (the model's own adapter,
    which PEFT allocates tensor by tensor, is no flat buffer to copy once); else one by one."""
    if targets and targets[0].device.type in FLAT_DEVICES:
        torch._foreach_copy_(list(targets), list(sources))
        return
    for t, s in zip(targets, sources, strict=True):
        t.copy_(s)


def copy_into(targets: Params, sources: Params) -> None:
    """targets[n] ← sources[n] for every name of `targets`: one copy between flat buffers where they
    align (`aligned`), else one multi-tensor copy on CUDA (`copy_each`), else one by one."""
    pieces = aligned(targets, in_order(sources, targets))
    copy_each([t for t, _ in pieces], [s for _, s in pieces])


def detached(params: Params) -> Params:
    """`params`' tensors detached from autograd (views: an adapter's live leaves as plain tensors)."""
    return {n: t.detach() for n, t in params.items()}


def flat_where_it_helps(params: Params) -> Params:
    """`params` as views of one flat buffer in their order on a device of `FLAT_DEVICES` (a copy
    unless they already are), so that the updates that read them run flat; elsewhere as they are."""
    if not on_flat_device(params) or flat_buffer(params) is not None:
        return params
    return clone(params)


def views_of(flat: torch.Tensor, shapes: Mapping[str, Sequence[int]]) -> Params:
    """`flat`'s consecutive pieces, one per name of `shapes`, each shaped as it says (what
    `empty_like` and `moved` hand out, and what a checkpoint's packed dict becomes again)."""
    out, offset = {}, 0
    for n, shape in shapes.items():
        size = math.prod(shape)
        out[n] = flat[offset:offset + size].view(shape)
        offset += size
    return out


def moved(params: Params, device: torch.device | str) -> Params:
    """A copy of `params` on `device` as views of one flat buffer, in their order: one transfer
    between host and device for the lot (one per tensor costs a synchronisation each) when they
    are, or are first copied into, one flat buffer of one dtype."""
    if not params:
        return {}
    flat = flat_buffer(params)
    if flat is None:  # first one flat copy where they lie (mixed dtypes stay tensor by tensor)
        params = clone(params)
        flat = flat_buffer(params)
        if flat is None:
            return {n: t.to(device) for n, t in params.items()}
        if flat.device == torch.device(device):
            return params
    elif flat.device == torch.device(device):
        return clone(params)
    return views_of(flat.to(device, copy=True), {n: t.shape for n, t in params.items()})


def clone(params: Params) -> Params:
    """A copy of `params` as views of one flat buffer (`empty_like`). On a device of `FLAT_DEVICES`,
    tensors that are not one flat buffer already (a subset of an adapter: FedSA-LoRA's B, FFA-LoRA's
    B) are copied by one concatenation rather than one copy each."""
    if len(params) > 1 and flat_buffer(params) is None:
        values = [t.detach() for t in params.values()]
        first = values[0]
        if first.device.type in FLAT_DEVICES and all(t.dtype == first.dtype and t.device == first.device
                                                     for t in values):
            return views_of(torch.cat([t.reshape(-1) for t in values]), {n: t.shape for n, t in params.items()})
    out = empty_like(params)
    for o, t in aligned(out, params):  # (one copy on CUDA when `params` is flat too)
        o.copy_(t.detach())
    return out


def zeros_like(params: Params, dtype: torch.dtype | None = None) -> Params:
    out = empty_like(params, dtype)
    for (t,) in aligned(out):
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
