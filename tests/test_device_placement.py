"""No silent CPU tensors in a CUDA run (issue 39), checked on CPU.

This CPU has no second device, so the check is on the code that creates tensors: a torch
factory call (torch.zeros, torch.tensor, torch.full, ...) made from pflalign's own code without a
`device=` argument makes a CPU tensor whatever the model's device. A TorchFunctionMode records
every such call during tiny runs (training, per-round and final evaluation, stateful methods),
by file and function; only the host-side batches, which are moved to the model's device before
use, may do it. `*_like`, `new_*`, stack/cat and arithmetic inherit their inputs' device.
(The Flower ClientApp runs the same client code: `pflalign.run.client`.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pflalign.config import build_config
from pflalign.run.engine import run

from test_engine import TINY

SRC = Path(__file__).resolve().parents[1] / "src" / "pflalign"
FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.rand,
             torch.randn, torch.randint, torch.eye, torch.linspace, torch.as_tensor, torch.from_numpy}
# host batches, moved to the model's device before use: a training batch (loss_and_grads) and a
# group of prompts in greedy decoding (greedy_ids: `ids.to(device)`)
HOST_BATCHES = {("prompts.py", "collate_train"), ("evaluate.py", "greedy_ids")}


class FactoryCalls(TorchFunctionMode):
    """Records (file under src/pflalign, function) of every factory call without device=."""

    def __init__(self):
        super().__init__()
        self.sites: set[tuple[str, str]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None and Path(frame.f_code.co_filename).is_relative_to(SRC):
                self.sites.add((str(Path(frame.f_code.co_filename).relative_to(SRC)), frame.f_code.co_name))
        return func(*args, **kwargs)


@pytest.mark.parametrize("method", ["pflalign", "scaffold", "fedadam"])
def test_only_host_batches_are_made_without_the_models_device(method, tmp_path):
    cfg = build_config(None, {**json.loads(json.dumps(TINY)), "method": method, "rounds": 1,
                              "eval": {**TINY["eval"], "every": 1, "every_max_test": 1}})
    with FactoryCalls() as calls:
        run(cfg, tmp_path / "run", progress=False)
    assert ("prompts.py", "collate_train") in calls.sites  # the check sees pflalign's calls
    assert calls.sites <= HOST_BATCHES, sorted(calls.sites - HOST_BATCHES)
