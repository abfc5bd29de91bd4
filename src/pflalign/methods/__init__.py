"""The registry of federated methods: name → class. `pflalign methods` lists it.

Adding a method = one module with a `Method` subclass, plus one line here.
"""

from __future__ import annotations

import difflib

from ..errors import UserError
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

# The paper's two families of baselines, then pFLAlign and its ablations.
OPTIMIZER_BASED = (FedAvg, FedProx, FedSAM, Scaffold, FedDyn, FedAdam, FedYogi, FedAdagrad, FedGloSS, Local)
LORA_MODULATION = (FFALoRA, FedSALoRA, FedSVD)
PFLALIGN = (
    PFLAlign,
    PFLAlignNoPrecond,
    PFLAlignNoCorrection,
    PFLAlignConstGamma,
    PFLAlignHardGamma,
    PFLAlignNoPersonalInit,
)

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (*PFLALIGN, *OPTIMIZER_BASED, *LORA_MODULATION)}


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        close = difflib.get_close_matches(name, METHODS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"unknown method {name!r}{hint}; run `pflalign methods` for the list")
    return METHODS[name]
