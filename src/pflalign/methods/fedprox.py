"""FedProx (Li et al., MLSys 2020, "Federated Optimization in Heterogeneous Networks").

Client k minimises its loss plus a proximal term that keeps it near the round's
global adapter w^r:

    h_k(w) = f_k(w) + (μ/2) ‖w − w^r‖²,   ∇h_k(w) = g + μ (w − w^r)

Client: T steps of plain SGD on h_k, w ← w − η (g + μ (w − w^r)), from w^r.
Server: w^{r+1} = Σ_k (|D_k| / Σ_j |D_j|) w_k (as FedAvg).
With μ = 0 this is FedAvg step for step. The paper's inexact-solver tolerance γ
and its dropping of stragglers are system aspects the engine does not model:
every client takes exactly T steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import GradFn, Params, State, StepContext, aligned_named
from .fedavg import FedAvg


@dataclass
class FedProxArgs:
    mu: float = 0.01  # proximal coefficient μ

    def __post_init__(self):
        if self.mu < 0:
            raise ValueError(f"mu must be >= 0, got {self.mu}")


def proximal_direction(g: torch.Tensor, w: torch.Tensor, w_global: torch.Tensor, mu: float) -> torch.Tensor:
    """∇h_k(w) = g + μ (w − w^r): the gradient of FedProx's local objective
    h_k(w) = f_k(w) + (μ/2) ‖w − w^r‖² (Li et al., MLSys 2020, eq. 2), g = ∇f_k(w)."""
    return g + mu * (w - w_global)


class FedProx(FedAvg):  # FedAvg with another client step: the server rule is inherited
    name = "fedprox"
    label = "FedProx"
    family = "Optimizer-based"
    Args = FedProxArgs

    @torch.no_grad()
    def local_step(self, params: Params, grad_fn: GradFn, state: State, ctx: StepContext) -> float:
        loss, grads = grad_fn()
        for n, (w, g, w_r) in aligned_named(params, grads, ctx.global_params):  # flat on CUDA
            # FedAvg's step on ∇h_k, so μ = 0 is bit-identical
            ctx.descend(n, w, proximal_direction(g, w, w_r, self.args.mu))
        return loss
