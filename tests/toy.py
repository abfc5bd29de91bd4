"""A model-free driver of the `Method` hooks for toy problems (quadratics, small
matrices): the same call order as the engine's round loop, without a language model."""

from __future__ import annotations

from typing import Callable

import torch

from pflalign.methods.base import Method, Params, RoundContext, StepContext, clone


def quadratic(a: torch.Tensor, c: torch.Tensor):
    """f(w) = ½ Σ a (w − c)² on a single tensor named "w": returns grad_of(params)."""
    def grad_of(params: Params):
        w = params["w"]
        return float((0.5 * a * (w - c) ** 2).sum()), {"w": a * (w - c)}
    return grad_of


def simulate(method: Method, init: Params, grad_of: list[Callable[[Params], tuple[float, Params]]],
             weights: list[float], rounds: int, steps: int, lr: float):
    """Run `rounds` rounds with every client participating; returns (global, personalized, client states)."""
    n = len(grad_of)
    server_state = method.init_server_state(init)
    states = [method.init_client_state(init) for _ in range(n)]
    glob, personal = clone(init), [None] * n
    for r in range(rounds):
        received = method.broadcast(glob, server_state)
        messages = []
        for k in range(n):
            scratch = method.new_scratch()  # this client round's scratch, as client.local_round makes it
            params = method.client_start(glob, states[k], received, scratch)
            for t in range(steps):
                ctx = StepContext(round=r, step=t, num_steps=steps, lr=lr, global_params=glob, scratch=scratch)
                method.local_step(params, lambda: grad_of[k](params), states[k], ctx)
            messages.append(method.client_end(glob, params, states[k], scratch))
            personal[k] = method.personalized(glob, params, states[k])
        glob = method.aggregate(glob, messages, weights, server_state, RoundContext(r, n, list(range(n))))
    return glob, personal, states
