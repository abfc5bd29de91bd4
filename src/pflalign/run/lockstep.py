"""A round's clients in lockstep: local step t of every client in one forward and backward.

Every client of a round trains the same frozen base with its own adapter, so their minibatches
of step t can share one pass through the base (`FederatedLM.routed_loss_and_grads`,
model/multi_lora.py): each client holds its adapter in tensors of its own, the pass leaves each
client's gradient in its own tensors, and then each client's `LocalRound` (run/client.py, the
sequential engine's) takes its step with that gradient, through its method's unchanged
`local_step`. Methods stay plain functions over tensors; nothing here knows one.

What a method's `grad_fn()` returns:

* its first call in a step, when the client's tensors are still those of the shared pass (their
  version counter says so): that pass's loss and gradient;
* any other call (SAM's gradient at w + ε, FedSAM and FedGloSS; a method that moved its
  weights before asking): a forward and backward of that client's minibatch alone, at its
  weights then. Correct for every method; such a second gradient is not shared yet.

So every method computes what the sequential engine computes, up to the rounding of sums taken
in another order (each row holds other examples beside the client's; tested against the
sequential engine for every method). A client whose round has fewer steps drops out of the
shared pass after its last.
"""

from __future__ import annotations

from typing import Callable

import torch

from .client import ClientRound, LocalRound
from ..errors import TrainingDiverged, UserError
from ..methods.base import Message, Method, Params, State
from ..params import clone


def own_adapter(like: Params) -> Params:
    """A client's live adapter for the shared pass: a copy of `like` (one flat buffer: its
    tensors share one version counter) whose tensors are leaves that collect their gradient."""
    live = clone(like)
    for t in live.values():
        t.requires_grad_(True)
    return live


def _version(live: Params) -> int:
    """The version counter of the client's flat buffer: it moves with every in-place change."""
    return next(iter(live.values()))._version


def _loader(live: Params) -> Callable[[Params], None]:
    @torch.no_grad()
    def load(params: Params) -> None:
        if params.keys() != live.keys():
            raise ValueError("adapter keys differ from the model's")
        for n, p in live.items():
            p.copy_(params[n])
    return load


def lockstep_round(lm, method: Method, states: list[State], global_params: Params, received: Message,
                   batches: list[list[dict]], lr: float, round_index: int, names: list[str],
                   on_step: Callable[[int, int, float], None] | None = None,
                   optimizer=None) -> list[ClientRound]:
    """Round `round_index` of the clients whose method states are `states` (updated in place)
    and whose minibatches are `batches[i]`, in lockstep (module docstring): their `ClientRound`s,
    in order. `names[i]` names client i in a divergence's message; `on_step(i, t, loss)` after
    each client's step."""
    if any(not isinstance(b, dict) for bs in batches for b in bs):
        raise UserError("batched clients do not take gradient accumulation yet "
                        "(optimizer.grad_accumulation > 1): run without --batch clients")
    live = [own_adapter(lm.lora) for _ in states]
    rounds = []
    for i, state in enumerate(states):
        with _named(names[i]):
            rounds.append(LocalRound(method, state, global_params, received, len(batches[i]), lr, round_index,
                                     optimizer, live[i], _loader(live[i])))
    for t in range(max(len(bs) for bs in batches)):
        active = [i for i, bs in enumerate(batches) if t < len(bs)]
        with torch.enable_grad():
            losses = lm.routed_loss_and_grads([batches[i][t] for i in active], [live[i] for i in active])
        for i, loss in zip(active, losses):
            with _named(names[i]):
                loss = rounds[i].step(t, _gradient(lm, live[i], batches[i][t], loss))
            if on_step is not None:
                on_step(i, t, loss)
    done = []
    for i, steps in enumerate(rounds):
        with _named(names[i]):
            done.append(steps.finish())
    return done


def _gradient(lm, live: Params, batch: dict, shared_loss: float) -> Callable[[], tuple[float, Params]]:
    """A step's `gradient()` for one client: the shared pass's at first, then its own (module docstring)."""
    at = _version(live)
    fresh = [True]

    def gradient() -> tuple[float, Params]:
        if fresh[0] and _version(live) == at:
            fresh[0] = False
            return shared_loss, {n: p.grad for n, p in live.items()}
        fresh[0] = False
        loss = lm.routed_loss_and_grads([batch], [live])[0]  # this client alone, at its weights now
        return loss, {n: p.grad for n, p in live.items()}

    return gradient


class _named:
    """Prefix a divergence's message with the client it happened to."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is TrainingDiverged:
            raise TrainingDiverged(f"client {self.name}: {exc}") from None
        return False
