"""The registry of federated methods: name → class. `pflalign methods` lists it.

Adding a method = one module with a `Method` subclass, plus one line here.
"""

from __future__ import annotations

import difflib

from ..errors import UserError
from .base import Method
from .fedavg import FedAvg
from .pflalign import (
    PFLAlign,
    PFLAlignConstGamma,
    PFLAlignHardGamma,
    PFLAlignNoCorrection,
    PFLAlignNoPersonalInit,
    PFLAlignNoPrecond,
)

METHODS: dict[str, type[Method]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        PFLAlign,
        PFLAlignNoPrecond,
        PFLAlignNoCorrection,
        PFLAlignConstGamma,
        PFLAlignHardGamma,
        PFLAlignNoPersonalInit,
    )
}


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        close = difflib.get_close_matches(name, METHODS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"unknown method {name!r}{hint}; run `pflalign methods` for the list")
    return METHODS[name]
