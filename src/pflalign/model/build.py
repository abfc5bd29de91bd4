"""`build_model`: the run's model from its config, on its device and dtype: the one constructor
every engine uses."""

from __future__ import annotations

import torch

from ..errors import UserError
from .federated_lm import FederatedLM


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but no CUDA device is available")
    return name


def build_model(cfg, device: str | None = None, in_memory: bool = False) -> "FederatedLM":
    """The run's model with its seeded LoRA adapter w^0 (on `device`; None: the config's, where
    it trains): the one constructor every engine uses. `in_memory`: the base weights are copied
    out of their memory-mapped file (`hold_in_memory`): for the one process that trains."""
    if device is None:
        device = resolve_device(cfg.device)
        check_dtype(cfg.dtype, device)
    # on a GPU the move to the device already takes the weights out of the mapping: a CPU copy first
    # would only cost time and a second host-memory copy of the base
    in_memory = in_memory and torch.device(device).type == "cpu"
    return FederatedLM.build(cfg.model, cfg.lora, cfg.seed, dtype=getattr(torch, cfg.dtype), device=device,
                             in_memory=in_memory)


def check_dtype(dtype: str, device: str) -> None:
    """Refuse float16 on a CPU: CPUs have no float16 arithmetic worth the name (SmolLM2 in float16
    did not finish a round in 300 s), and the tiny test models ignore the dtype.
    The ServerApp's copy of w^0 is built on its CPU with `device` given, and is not checked."""
    if dtype == "float16" and torch.device(device).type == "cpu":
        raise UserError("dtype=float16 on the CPU: CPUs compute float16 far slower than float32 (a SmolLM2 "
                        "round did not finish in 300 s); use dtype=float32 there, float16 or bfloat16 on a GPU")
