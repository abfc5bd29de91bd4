"""Adaptive federated optimisation (Reddi et al., ICLR 2021, "Adaptive Federated
Optimization"), Algorithm 2: FedAdam, FedYogi, FedAdagrad.

Clients: T steps of plain SGD from w^r (as FedAvg). Server, element-wise,
with the pseudo-gradient of the round

    Δ = Σ_k (|D_k| / Σ_j |D_j|) w_k − w^r
    m = β1 m + (1 − β1) Δ
    v = β2 v + (1 − β2) Δ²                    (FedAdam)
    v = v − (1 − β2) Δ² sign(v − Δ²)          (FedYogi)
    v = v + Δ²                                (FedAdagrad; β2 unused, so not an argument)
    w^{r+1} = w^r + η m / (√v + τ)

with m = 0 and v = τ² at the start (the paper's v_{−1} ≥ τ²), and no bias
correction (the paper has none).

Weighting: Algorithm 2 averages the client updates equally, Δ = (1/|S|) Σ_k Δ_k;
we weight them by |D_k| as every server rule here does (and Flower's FedOpt
strategies do), so that Δ is exactly FedAvg's step w̄ − w^r and FedOpt differs
from FedAvg only in the server optimizer. With equal |D_k| the two are the same.

Paper vs. code: Flower's strategies (whose structure we follow: one FedOpt base,
the variants differ only in the v update) start v at 0 rather than τ², and its
FedAdagrad fixes β1 = 0; we follow the paper's Algorithm 2 for both.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from typing import Callable

from .base import Params, RoundContext, State, aligned, in_order, mapped, zeros_like
from .fedavg import FedAvg


@dataclass
class FedOptArgs:
    server_lr: float = 1e-2  # η, the server's step size
    beta1: float = 0.9  # momentum of the pseudo-gradient
    tau: float = 1e-3  # adaptivity τ: v starts at τ², and √v + τ is the denominator

    def __post_init__(self):
        if self.server_lr <= 0:
            raise ValueError(f"server_lr must be > 0, got {self.server_lr}")
        if not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"beta1 must be in [0, 1), got {self.beta1}")
        if self.tau <= 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")


@dataclass
class FedAdamArgs(FedOptArgs):
    beta2: float = 0.99  # decay of the second moment v

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {self.beta2}")


def adam_second_moment_(v: torch.Tensor, delta_sq: torch.Tensor, beta2: float) -> None:
    """FedAdam: v ← β2 v + (1 − β2) Δ², in place (Reddi et al., Algorithm 2)."""
    v.mul_(beta2).add_(delta_sq, alpha=1 - beta2)


def yogi_second_moment_(v: torch.Tensor, delta_sq: torch.Tensor, beta2: float) -> None:
    """FedYogi: v ← v − (1 − β2) Δ² sign(v − Δ²), in place (Reddi et al., Algorithm 2): v moves
    towards Δ² by an additive (1 − β2) Δ², never multiplicatively."""
    v.sub_((1 - beta2) * delta_sq * torch.sign(v - delta_sq))


def adagrad_second_moment_(v: torch.Tensor, delta_sq: torch.Tensor) -> None:
    """FedAdagrad: v ← v + Δ², in place (Reddi et al., Algorithm 2)."""
    v.add_(delta_sq)


def fedopt_step_(w: torch.Tensor, delta: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float,
                 beta1: float, tau: float, update_v: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """The server's adaptive step on one tensor (Reddi et al., ICLR 2021, Algorithm 2), in place on
    m and v; returns w^{r+1}:

        m ← β1 m + (1 − β1) Δ
        v ← update_v(v, Δ²)                  (Adam, Yogi or Adagrad's second moment, above)
        w^{r+1} = w^r + η m / (√v + τ)

    Δ = w̄ − w^r is the round's pseudo-gradient, pointing where the clients went.
    """
    m.mul_(beta1).add_(delta, alpha=1 - beta1)
    update_v(v, delta * delta)
    return w + lr * m / (v.sqrt() + tau)


class FedOpt(FedAvg):
    """FedAvg's clients with an adaptive server optimiser; subclasses define `update_v`."""

    family = "Optimizer-based"
    Args = FedOptArgs

    def init_server_state(self, global_params: Params) -> State:
        v = zeros_like(global_params)  # v_0 = τ², one flat buffer as m
        for (piece,) in aligned(v):
            piece.fill_(self.args.tau ** 2)
        return {"m": zeros_like(global_params), "v": v}

    @abstractmethod
    def update_v(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        """The second-moment update, in place on v, given Δ² (one of the functions above)."""

    def finish_aggregation(self, global_params: Params, sums: dict[str, Params], weights: list[float],
                           server_state: State, ctx: RoundContext) -> Params:
        average = sums["params"]  # Σ_k p_k w_k (the default sum)
        beta1, lr, tau = self.args.beta1, self.args.server_lr, self.args.tau
        m, v = server_state["m"], server_state["v"]
        return mapped(lambda w, avg, m, v: fedopt_step_(w, avg - w, m, v, lr=lr, beta1=beta1, tau=tau,
                                                         update_v=self.update_v),
                      global_params, in_order(average, global_params), in_order(m, global_params),
                      in_order(v, global_params))


class FedAdam(FedOpt):
    name = "fedadam"
    label = "FedAdam"
    Args = FedAdamArgs

    def update_v(self, v, delta_sq):
        adam_second_moment_(v, delta_sq, self.args.beta2)


class FedYogi(FedOpt):
    name = "fedyogi"
    label = "FedYogi"
    Args = FedAdamArgs  # same hyperparameters as FedAdam, only the v update differs

    def update_v(self, v, delta_sq):
        yogi_second_moment_(v, delta_sq, self.args.beta2)


class FedAdagrad(FedOpt):
    name = "fedadagrad"
    label = "FedAdagrad"
    Args = FedOptArgs

    def update_v(self, v, delta_sq):
        adagrad_second_moment_(v, delta_sq)
