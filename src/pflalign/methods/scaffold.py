"""SCAFFOLD (Karimireddy et al., ICML 2020, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning"), Algorithm 1 with option II and global
step size η_g = 1.

State: server control c = 0; client controls c_k = 0 (persistent on client k).
The server broadcasts c with w^r. Client k, from w_{k,0} = w^r, K = T steps:

    w ← w − η (g − c_k + c)                         # drift-corrected SGD
    c_k⁺ = c_k − c + (w^r − w_{k,K}) / (K η)        # option II
    sends w_{k,K} and Δc_k = c_k⁺ − c_k;  c_k ← c_k⁺

Server, participants S of N clients:

    w^{r+1} = Σ_{k∈S} (|D_k| / Σ_{j∈S} |D_j|) w_{k,K}     (as FedAvg; η_g = 1)
    c      ← c + (|S|/N) · (1/|S|) Σ_{k∈S} Δc_k            (unweighted, as in the paper)

The paper averages the model updates unweighted too; we weight them by data
size like every other method here, and keep c's update as in the paper. With
unequal |D_k| the fixed point is still the optimum of the unweighted mean
(1/N) Σ_k f_k: there every c_k = ∇f_k(w) and c = (1/N) Σ_k c_k = 0.
K η is accumulated as Σ_t η over the round's steps (equal to K η for a constant
η), because `client_end` does not see the step context.
Local optimizer: SGD only (`refuses_adamw`): option II reads the client's mean
gradient off its SGD displacement (w^r − w_K) / (K η); after AdamW steps that
quotient is a mean Adam update, in other units than g. OpenFedLLM runs SCAFFOLD
with AdamW by applying the correction −η(c − c_k) outside the optimizer; that
variant is not implemented here.
"""

from __future__ import annotations

import torch

from .base import (GradFn, Message, Method, Params, RoundContext, Scratch, State, StepContext, WeightedSum, clone,
                   aligned, detached, equal_weights, in_order, mapped, zeros_like)


def scaffold_direction(g: torch.Tensor, c_k: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """d = g − c_k + c: the drift-corrected gradient of SCAFFOLD's local step w ← w − η d
    (Karimireddy et al., ICML 2020, Algorithm 1, the local update)."""
    return g - c_k + c


def scaffold_control(c_k: torch.Tensor, c: torch.Tensor, w_global: torch.Tensor, w: torch.Tensor,
                     lr_sum: float) -> torch.Tensor:
    """c_k⁺ = c_k − c + (w^r − w_{k,K}) / (K η): the client's new control variate, option II of
    Algorithm 1 (`lr_sum` is K η, accumulated as Σ_t η)."""
    return c_k - c + (w_global - w) / lr_sum


class Scaffold(Method):
    name = "scaffold"
    label = "SCAFFOLD"
    family = "Optimizer-based"
    refuses_adamw = ("option II's control variate c_k⁺ = c_k − c + (w^r − w_K) / (K η) estimates the client's "
                     "mean gradient only when its steps are SGD steps")

    # ---- client ---------------------------------------------------------------
    def init_client_state(self, global_params: Params) -> State:
        return {"c": zeros_like(global_params)}

    def client_start(self, global_params: Params, state: State, received: Message, scratch: Scratch) -> Params:
        scratch["server_c"] = clone(received["c"])
        # Σ_t η, on the adapter's device: no CPU tensor (and host op per step) in a CUDA run
        scratch["lr_sum"] = torch.zeros((), dtype=torch.float64, device=next(iter(global_params.values())).device)
        return clone(global_params)

    @torch.no_grad()
    def local_step(self, params: Params, grad_fn: GradFn, state: State, ctx: StepContext) -> float:
        loss, grads = grad_fn()
        client_c, server_c = state["c"], ctx.scratch["server_c"]
        for w, g, c_k, c in aligned(params, grads, client_c, server_c):  # flat on CUDA
            w.add_(scaffold_direction(g, c_k, c), alpha=-ctx.lr)  # SGD (refuses_adamw)
        ctx.scratch["lr_sum"] += ctx.lr
        return loss

    def client_end(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> Message:
        lr_sum = float(scratch["lr_sum"])  # K η
        # in the adapter's order, so that on CUDA each line below is one operation over flat buffers
        c_k, c = in_order(state["c"], params), in_order(scratch["server_c"], params)
        c_new = mapped(lambda c_k, c, w_r, w: scaffold_control(c_k, c, w_r, w, lr_sum),
                       c_k, c, in_order(global_params, params), detached(params))
        delta_c = mapped(torch.sub, c_new, c_k)
        for old, new in aligned(c_k, c_new):  # in place: c_k stays one flat buffer
            old.copy_(new)
        return {"params": clone(params), "delta_c": delta_c}

    # ---- server ---------------------------------------------------------------
    def init_server_state(self, global_params: Params) -> State:
        return {"c": zeros_like(global_params)}

    def broadcast(self, global_params: Params, server_state: State) -> Message:
        return {"c": clone(server_state["c"])}

    def aggregation_sums(self, global_params: Params, weights: list[float], server_state: State,
                         ctx: RoundContext) -> dict:
        # w_k by data size; Δc_k unweighted, as in the paper
        return {"params": WeightedSum(weights), "delta_c": WeightedSum(equal_weights(len(weights)), "delta_c")}

    def finish_aggregation(self, global_params: Params, sums: dict[str, Params], weights: list[float],
                           server_state: State, ctx: RoundContext) -> Params:
        participants = len(weights)
        c = server_state["c"]
        for c_piece, delta_c in aligned(c, in_order(sums["delta_c"], c)):
            c_piece.add_(delta_c, alpha=participants / ctx.num_clients)
        return sums["params"]

    def needs_each_upload(self) -> str | None:
        return ("its server rule needs two sums with different weights (w_k by data size, delta_c equally) "
                "and the number of participants; Flower's SecAgg+ and DP clipping give one data-weighted sum")
