"""FedAvg (McMahan et al., AISTATS 2017, "Communication-Efficient Learning of Deep
Networks from Decentralized Data").

Client: T steps of plain SGD, w ← w − η g (no momentum), from w^r.
Server: w^{r+1} = Σ_k (|D_k| / Σ_j |D_j|) w_k.
Personalized model of client k: its locally trained w_k of the last round.

The simplest complete `Method`, and the base of the methods that change one part of it:
FedProx, FedSAM and pFLAlign its local step; FedAdam, FedYogi and FedAdagrad its server
step; FFA-LoRA (and FedSVD) what is trained and sent, FedSA-LoRA what is shared, Local
that nothing is.
"""

from __future__ import annotations

import torch

from .base import (GradFn, Message, Method, Params, RoundContext, Scratch, State, StepContext, WeightedSum,
                   aligned_named, clone)


class FedAvg(Method):
    name = "fedavg"
    label = "FedAvg"
    family = "Optimizer-based"

    # ---- client ---------------------------------------------------------------
    @torch.no_grad()
    def local_step(self, params: Params, grad_fn: GradFn, state: State, ctx: StepContext) -> float:
        """The optimizer's step along the minibatch gradient d = g (SGD: w ← w − η g), on every
        tensor the method trains (`trains`: all of them, except FFA-LoRA's A); on CUDA once over
        the flat buffers when it trains them all (`aligned_named`)."""
        loss, grads = grad_fn()
        trained = {n: w for n, w in params.items() if self.trains(n)}
        ctx.descend_each([(n, w, g) for n, (w, g) in aligned_named(params if len(trained) == len(params) else trained,
                                                                    grads)])
        return loss

    def client_end(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> Message:
        return {"params": clone(params)}  # w_{k,T}

    # ---- server ---------------------------------------------------------------
    def aggregation_sums(self, global_params: Params, weights: list[float], server_state: State,
                         ctx: RoundContext) -> dict:
        return {"params": WeightedSum(weights)}  # w̄ = Σ_k p_k w_k

    def finish_aggregation(self, global_params: Params, sums: dict[str, Params], weights: list[float],
                           server_state: State, ctx: RoundContext) -> Params:
        return sums["params"]
