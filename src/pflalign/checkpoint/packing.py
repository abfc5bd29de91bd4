"""One record per adapter-shaped dict: a checkpoint's tensors saved fast and loaded as views.

A run checkpoint holds ~17 dicts of 420 LoRA tensors each (global, client
states, personalized adapters). Pickled tensor by tensor that is ~7,000
records and ~36,000 small writes: 2.1 s of a FLAN round. Each such dict is
stored as one flat tensor with its names and shapes instead (`pack_tensors`),
and rebuilt as views of it at load (`unpack_tensors`). `save_checkpoint` and
`load_checkpoint` write and read one such file (atomically: `atomic`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..params import flat_buffer, views_of
from .atomic import _atomic_write

PACKED = "__pflalign_packed__"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _packable(d: dict, shared: set[int]) -> bool:
    """All values plain tensors of one dtype and device, none sharing memory with another
    tensor of the payload or of this dict (sharing would not survive the copy)."""
    values = list(d.values())
    if len(values) < 2 or not all(type(t) is torch.Tensor and not t.requires_grad and t.numel() > 0
                                  and t.layout == torch.strided for t in values):
        return False
    if len({(t.dtype, t.device) for t in values}) != 1 or any(_storage(t) in shared for t in values):
        return False
    spans = sorted((_storage(t), t.storage_offset() * t.element_size(),
                    t.storage_offset() * t.element_size() + t.numel() * t.element_size(), t.is_contiguous())
                   for t in values)
    return all(contiguous for *_, contiguous in spans) and all(
        a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))


def _is_tensor_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _collect(obj, groups: list, loose: list) -> None:
    """The payload's dicts of tensors (`groups`) and its other tensors (`loose`)."""
    if isinstance(obj, torch.Tensor):
        loose.append(obj)
    elif _is_tensor_dict(obj):
        groups.append(obj)
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            _collect(v, groups, loose)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors one after the other as one 1-D tensor: their own buffer when they are
    already its consecutive views and fill it (params.empty_like), else a copy.
    (A copy of every adapter of 8 clients at once was +0.6 GB at the save.)"""
    flat = flat_buffer(dict(enumerate(tensors)))
    if (flat is not None and flat.storage_offset() == 0
            and flat.numel() * flat.element_size() == flat.untyped_storage().nbytes()):
        return flat
    return torch.cat([t.reshape(-1) for t in tensors])


def pack_tensors(payload):
    """`payload` with each packable dict of tensors replaced by one flat tensor plus its names and shapes."""
    groups: list[dict] = []
    loose: list[torch.Tensor] = []
    _collect(payload, groups, loose)
    seen, shared = set(), set()
    for storages in [{_storage(t) for t in g.values()} for g in groups] + [{_storage(t)} for t in loose]:
        shared |= storages & seen
        seen |= storages
    packed = {id(g) for g in groups if _packable(g, shared)}

    def walk(obj):
        if isinstance(obj, dict):
            if id(obj) in packed:
                return {PACKED: _flat(list(obj.values())),
                        "names": list(obj), "shapes": [list(t.shape) for t in obj.values()]}
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj
    return walk(payload)


def unpack_tensors(obj):
    """The inverse of `pack_tensors`: each packed dict becomes views of its flat tensor."""
    if isinstance(obj, dict):
        if PACKED in obj:
            return views_of(obj[PACKED], dict(zip(obj["names"], obj["shapes"])))
        return {k: unpack_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(unpack_tensors(v) for v in obj)
    return obj


def save_checkpoint(path: Path, payload: dict) -> None:
    _atomic_write(path, lambda f: torch.save(pack_tensors(payload), f))


def load_checkpoint(path: Path) -> dict:
    """A file of `save_checkpoint` or `save_run_checkpoint`, its tensor dicts unpacked."""
    return unpack_tensors(torch.load(path, map_location="cpu", weights_only=True))
