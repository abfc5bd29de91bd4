"""The registry of federated methods: name → class. `pflalign methods` lists it.

Adding a method = one module with a `FedAvg` (or `Method`) subclass (its `name`, `label`
and `family` on the class, its update rules as plain functions its hooks call), plus its
line in `REGISTRY` here and its name in `pflalign.settings.METHOD_NAMES` (checked before
torch is imported; a test keeps the two equal) (docs/methods.md, "Adding a method").
"""

from __future__ import annotations

from ..settings import check_method_name
from .base import Method
from .fedavg import FedAvg
from .feddyn import FedDyn
from .fedgloss import FedGloSS
from .fedopt import FedAdagrad, FedAdam, FedYogi
from .fedprox import FedProx
from .fedsa_lora import FedSALoRA
from .fedsam import FedSAM
from .fedsvd import FedSVD
from .ffa_lora import FFALoRA
from .local import Local
from .pflalign import (
    PFLAlign,
    PFLAlignConstGamma,
    PFLAlignHardGamma,
    PFLAlignNoCorrection,
    PFLAlignNoPersonalInit,
    PFLAlignNoPrecond,
)
from .scaffold import Scaffold

# pFLAlign and its ablations, then the paper's two families of baselines (the order of `pflalign methods`)
REGISTRY: tuple[type[Method], ...] = (
    PFLAlign, PFLAlignNoPrecond, PFLAlignNoCorrection, PFLAlignConstGamma, PFLAlignHardGamma, PFLAlignNoPersonalInit,
    FedAvg, FedProx, FedSAM, Scaffold, FedDyn, FedAdam, FedYogi, FedAdagrad, FedGloSS, Local,
    FFALoRA, FedSALoRA, FedSVD,
)
METHODS: dict[str, type[Method]] = {cls.name: cls for cls in REGISTRY}
# The report's row groups, in the paper's order; methods of no family ("Other") come last.
FAMILIES = [(family, [c.name for c in REGISTRY if c.family == family])
            for family in ("LoRA-modulation", "Optimizer-based", "pFLAlign")]
OPTIMIZER_BASED = tuple(c for c in REGISTRY if c.family == "Optimizer-based")
LORA_MODULATION = tuple(c for c in REGISTRY if c.family == "LoRA-modulation")
PFLALIGN = tuple(c for c in REGISTRY if c.family == "pFLAlign")


def method_class(name: str) -> type[Method]:
    check_method_name(name)  # settings.METHOD_NAMES: the same names, checked without importing torch
    return METHODS[name]


def base_method(method: str) -> str:
    """The method of a sweep's grid point ("fedprox@mu=0.01" → "fedprox")."""
    return method.split("@", 1)[0]


def label(method: str) -> str:
    """The paper's spelling of a method name (the registry name when it has none, or is unknown);
    a grid point's arguments follow in parentheses."""
    base, _, args = method.partition("@")
    return (METHODS[base].display_name() if base in METHODS else base) + (f" ({args})" if args else "")


def family(method: str) -> str:
    base = base_method(method)
    return METHODS[base].family if base in METHODS else "Other"


def method_order(methods) -> list[str]:
    """Families in the paper's order, registry order inside a family (a method's grid points
    sorted after it), unknown names last (sorted)."""
    known = [m for _, members in FAMILIES for m in members]
    return sorted(set(methods), key=lambda m: (known.index(base_method(m)), m) if base_method(m) in known
                  else (len(known), m))
