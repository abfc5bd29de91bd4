"""The clients' local optimizer, the learning rate across rounds, and gradient accumulation
(`optimizer.*` config keys; issue 42).

A method's local step computes its *descent direction* d for each trained tensor (plain
SGD's d is the minibatch gradient g; FedProx's g + μ(w − w^r); FedSAM's g at w + ε; ...)
and hands it to the round's optimizer with `StepContext.descend`:

* ``sgd`` (the paper's, the default): w ← w − η d, exactly the operation every method ran
  before this module existed, so SGD results are bit-identical.
* ``adamw`` (Loshchilov & Hutter, ICLR 2019; `torch.optim.AdamW`'s rule, which is what
  OpenFedLLM and FlowerTune run through the Hugging Face Trainer), per coordinate, at the
  t-th step of the round (t = 1, 2, ...):

      w ← w − η λ w                          (decoupled weight decay λ)
      m ← β1 m + (1 − β1) d,   v ← β2 v + (1 − β2) d²
      w ← w − η (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + ε)

  Its moments live on the client for one round only: m = v = 0 and t = 0 at the start of
  every round, as FlowerTune's and OpenFedLLM's clients build a fresh optimizer (a new
  Trainer) in every round. Nothing of it is checkpointed or sent.
  Defaults: β1 = 0.9, β2 = 0.999, ε = 1e-8 (torch's and the Trainer's) and λ = 0 (the
  Trainer's `weight_decay`; torch.optim.AdamW's own default is 0.01).

Learning rate of round r (0-based, of R rounds), constant through the round's T steps:
``constant``: η_r = lr; ``cosine``: torch's `CosineAnnealingLR` with T_max = R, stepped once
a round,

    η_r = min_lr + ½ (lr − min_lr) (1 + cos(π r / R))

so the first round runs at lr and min_lr would be reached one round after the last: no round
trains at min_lr, and with the default min_lr = 0 none at lr 0 (issue 56: FlowerTune's
`cosine_annealing` counts rounds from 1, so its last round runs at min_lr, and a one-round
smoke test at min_lr 0 trained nothing). The last round's η is min_lr + ½ (lr − min_lr)
(1 + cos(π (R − 1) / R)): lr itself for R = 1, ½ lr for R = 2, 0.024 lr for R = 10.

Gradient accumulation (`optimizer.grad_accumulation` = k): a local step draws
batch_size × k examples (the same examples as one batch of batch_size × k) and computes
their gradient as k microbatches of batch_size, weighting each microbatch's mean-token
gradient by its share of the step's response tokens: the sum is the gradient of the
mean loss over all the step's response tokens, i.e. the big batch's gradient up to float
error (tests/test_local_optim.py), with the activations of one microbatch alive at a time.
"""

from __future__ import annotations

import math

import torch

from . import params as params_module
from .settings import OPTIMIZERS, SCHEDULES


def round_lr(lr: float, schedule: str, min_lr: float, rounds: int, round_index: int) -> float:
    """η_r, the clients' learning rate in round `round_index` (0-based) of `rounds`."""
    if schedule == "constant":
        return lr  # the very float: constant runs are bit-identical to runs before the schedule
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * round_index / rounds))
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


class SGD:
    """w ← w − η d."""

    def descend(self, name: str, w: torch.Tensor, d: torch.Tensor, lr: float) -> None:
        w.add_(d, alpha=-lr)

    def descend_each(self, pieces: list[tuple[str, torch.Tensor, torch.Tensor]], lr: float) -> None:
        """`descend` on each (name, w, d): one multi-tensor update where each operation is a kernel
        launch (a device of `params.FLAT_DEVICES`: tensors that are not one flat buffer, FFA-LoRA's
        B), the same arithmetic; else one by one."""
        if len(pieces) > 1 and pieces[0][1].device.type in params_module.FLAT_DEVICES:
            torch._foreach_add_([w for _, w, _ in pieces], [d for _, _, d in pieces], alpha=-lr)
            return
        for name, w, d in pieces:
            self.descend(name, w, d, lr)


class AdamW:
    """AdamW on the method's descent direction, per tensor by name; one instance per client round."""

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0):
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.state: dict[str, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}  # name → m, v, [t]

    def descend(self, name: str, w: torch.Tensor, d: torch.Tensor, lr: float) -> None:
        if name not in self.state:
            self.state[name] = (torch.zeros_like(w), torch.zeros_like(w), [0])
        m, v, count = self.state[name]
        count[0] += 1
        t = count[0]
        if self.weight_decay:
            w.mul_(1 - lr * self.weight_decay)
        m.mul_(self.beta1).add_(d, alpha=1 - self.beta1)
        v.mul_(self.beta2).addcmul_(d, d, value=1 - self.beta2)
        # torch.optim.AdamW's single-tensor arithmetic, so the two agree to the last bits or nearly
        step_size = lr / (1 - self.beta1 ** t)
        denominator = (v.sqrt() / math.sqrt(1 - self.beta2 ** t)).add_(self.eps)
        w.addcdiv_(m, denominator, value=-step_size)

    def descend_each(self, pieces: list[tuple[str, torch.Tensor, torch.Tensor]], lr: float) -> None:
        for name, w, d in pieces:  # per tensor: each has its moments by name
            self.descend(name, w, d, lr)


def make_optimizer(settings) -> SGD | AdamW:
    """A fresh optimizer for one client round, from `config.OptimizerConfig`."""
    if settings.name == "sgd":
        return SGD()
    if settings.name == "adamw":
        return AdamW(settings.beta1, settings.beta2, settings.eps, settings.weight_decay)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {settings.name!r}")
