"""The untrained base model's generations, kept across runs.

The base model's evaluation is the same for every method and seed of one data
split: same weights, same prompts, greedy decoding. A Table 1 grid would
regenerate it 33 times (about 2 of a FLAN run's 33 minutes), so it is cached in
``$PFLALIGN_CACHE/base-eval/`` (``~/.cache/pflalign``), one JSON file per client
test split.

The key covers everything the generations depend on: the base weights (a hash
of every tensor that is not LoRA), the prompts' token ids (data, tokenizer,
chat template, truncation), max_new_tokens and the eval batch size (padding),
dtype and device, the torch and transformers versions and this package's own
source (the model code generation runs through). Any change there misses the
cache and generates afresh; a damaged entry is regenerated.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Callable

import torch

from .. import checkpoint as ckpt


# Subpackages generation does not run through: the data (the prompts' token ids are in the key),
# the methods (the base model has no adapter update) and the Flower engine.
NOT_DIGESTED = ("data", "methods", "flower")


def digested_sources() -> list[Path]:
    """The modules `package_source_digest` covers: every module of this package but those of
    `NOT_DIGESTED`, wherever it sits (the model, its kernels, evaluate, prompts, ...)."""
    root = Path(__file__).parents[1]
    return sorted(p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in NOT_DIGESTED)


@functools.cache  # read once per process: the source does not change under a running run
def package_source_digest() -> str:
    h = hashlib.sha256()
    root = Path(__file__).parents[1]
    for path in digested_sources():  # the path from the package root: the bare name for a top-level module
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def base_weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and bytes of every non-LoRA tensor (about 1 s for 135M)."""
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "lora_" in name:
            continue
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def cache_key(lm, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> str:
    import transformers

    digest = getattr(lm, "_base_digest", None)
    if digest is None:  # once per loaded model: its base weights never change
        digest = lm._base_digest = base_weights_digest(lm.model)
    h = hashlib.sha256(json.dumps({
        "base": digest, "prompts": prompts, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
        "dtype": str(lm.dtype), "device": str(lm.device), "torch": torch.__version__,
        "transformers": transformers.__version__, "source": package_source_digest(),
    }).encode())
    return h.hexdigest()


def base_generations(lm, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                     generate: Callable[[], list[str]]) -> list[str]:
    """The base model's generations for `prompts`: from the cache, else `generate()` (then cached)."""
    from .base import cache_dir

    path = cache_dir() / "base-eval" / f"{cache_key(lm, prompts, max_new_tokens, batch_size)}.json"
    try:
        outputs = json.loads(path.read_text())
        if isinstance(outputs, list) and len(outputs) == len(prompts) and all(isinstance(o, str) for o in outputs):
            return outputs
    except (OSError, ValueError):
        pass  # not cached yet, or damaged: generate
    outputs = generate()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(path, outputs)
    except OSError:
        pass  # a read-only or full cache costs time, never the run
    return outputs
