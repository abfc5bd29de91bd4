"""FedDyn (Acar et al., ICLR 2021, "Federated Learning Based on Dynamic
Regularization"), Algorithm 1.

State: λ_k = 0 on every client (persistent), h = 0 on the server.
Client k, from w_{k,0} = w^r, T steps of SGD on the dynamically regularised loss

    R_k(w) = f_k(w) − ⟨λ_k, w⟩ + (α/2) ‖w − w^r‖²
    w ← w − η (g − λ_k + α (w − w^r))

then λ_k ← λ_k − α (w_{k,T} − w^r) and it sends w_{k,T}.
Server, participants S of N clients (unweighted, as in the paper):

    h       ← h − α (1/N) Σ_{k∈S} (w_{k,T} − w^r)
    w^{r+1} = (1/|S|) Σ_{k∈S} w_{k,T} − h / α

Mapping: λ_k is the paper's ∇L_k(θ_k) (its linear term is −⟨∇L_k, θ⟩ and its
update ∇L_k ← ∇L_k − α(θ_k − θ^{t−1})); the official code
(github.com/alpemreacar/FedDyn) stores s_k = −λ_k / α = Σ_rounds (w_k − w^r)
and adds α⟨s_k, w⟩, and its server model mean_S(w_k) + mean_all(s_k) is ours,
since h = (1/N) Σ_all λ_k. We use the paper's unweighted means and ignore
|D_k| (the fixed point is then the optimum of (1/N) Σ_k f_k); the official code
instead scales α per client by Σ_j|D_j| / (N |D_k|), which is 1 for balanced
clients. The paper's weight decay is left to the user (none here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import (GradFn, Message, Method, Params, RoundContext, Scratch, State, StepContext, WeightedSum, clone,
                   aligned, aligned_named, detached, equal_weights, in_order, mapped, zeros_like)


@dataclass
class FedDynArgs:
    alpha: float = 0.01  # regularisation strength α

    def __post_init__(self):
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0 (the server divides by it), got {self.alpha}")


def feddyn_direction(g: torch.Tensor, w: torch.Tensor, w_global: torch.Tensor, lam: torch.Tensor,
                     alpha: float) -> torch.Tensor:
    """∇R_k(w) = g − λ_k + α (w − w^r): the gradient of the dynamically regularised local loss
    R_k(w) = f_k(w) − ⟨λ_k, w⟩ + (α/2) ‖w − w^r‖² (Acar et al., ICLR 2021, Algorithm 1), g = ∇f_k(w)."""
    return g - lam + alpha * (w - w_global)


def feddyn_dual_update_(lam: torch.Tensor, w: torch.Tensor, w_global: torch.Tensor, alpha: float) -> None:
    """λ_k ← λ_k − α (w_{k,T} − w^r), in place (Algorithm 1's update of ∇L_k)."""
    lam.sub_(w - w_global, alpha=alpha)


def feddyn_server_step_(h: torch.Tensor, mean: torch.Tensor, w_global: torch.Tensor, alpha: float,
                        participants: int, num_clients: int) -> torch.Tensor:
    """h ← h − α (1/N) Σ_{k∈S} (w_{k,T} − w^r), in place, and w^{r+1} = mean_S(w_{k,T}) − h / α
    (Acar et al., Algorithm 1), from the unweighted mean of the participants' models, using
    Σ_{k∈S} (w_k − w^r) = |S| (mean_S w_k − w^r)."""
    h.sub_(mean - w_global, alpha=alpha * participants / num_clients)
    return mean - h / alpha


class FedDyn(Method):
    name = "feddyn"
    label = "FedDyn"
    family = "Optimizer-based"
    Args = FedDynArgs

    def init_client_state(self, global_params: Params) -> State:
        return {"lambda": zeros_like(global_params)}

    @torch.no_grad()
    def local_step(self, params: Params, grad_fn: GradFn, state: State, ctx: StepContext) -> float:
        loss, grads = grad_fn()
        alpha, lam = self.args.alpha, state["lambda"]
        for n, (w, g, w_r, lam_n) in aligned_named(params, grads, ctx.global_params, lam):  # flat on CUDA
            ctx.descend(n, w, feddyn_direction(g, w, w_r, lam_n, alpha))
        return loss

    def client_end(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> Message:
        for lam, w, w_r in aligned(in_order(state["lambda"], params), detached(params), in_order(global_params, params)):
            feddyn_dual_update_(lam, w, w_r, self.args.alpha)  # (flat on CUDA)
        return {"params": clone(params)}

    def init_server_state(self, global_params: Params) -> State:
        return {"h": zeros_like(global_params)}

    def aggregation_sums(self, global_params: Params, weights: list[float], server_state: State,
                         ctx: RoundContext) -> dict:
        return {"mean": WeightedSum(equal_weights(len(weights)))}  # (1/|S|) Σ_{k∈S} w_{k,T}

    def finish_aggregation(self, global_params: Params, sums: dict[str, Params], weights: list[float],
                           server_state: State, ctx: RoundContext) -> Params:
        alpha, participants, mean_params = self.args.alpha, len(weights), sums["mean"]
        h = server_state["h"]
        return mapped(lambda h, mean, w_r: feddyn_server_step_(h, mean, w_r, alpha, participants, ctx.num_clients),
                      h, in_order(mean_params, h), in_order(global_params, h))

    def needs_each_upload(self) -> str | None:
        return ("its server rule averages the uploads with equal weights and counts the participants; "
                "Flower's SecAgg+ and DP clipping give one data-weighted sum")
