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

How many clients share one pass is chosen to fit the device's memory (`shared_pass`): all of
them, and where the device runs out of memory, half of them per pass, and so on; the size that
fit is kept (`PassSize`) for the rest of the run. On a CPU rows are packed and one row's
activations live at a time, so memory hardly grows with the clients: all share one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .client import ClientRound, LocalRound
from ..errors import TrainingDiverged, UserError
from ..methods.base import Message, Method, Params, State
from ..params import clone, copy_into, detached, empty_like, in_order


def own_adapter(like: Params, copy: bool = True) -> Params:
    """A client's live adapter for the shared pass: a copy of `like` (one flat buffer: its tensors
    share one version counter) whose tensors are leaves that collect their gradient; with
    copy=False shaped as `like` only, uninitialised (for `member`: `LocalRound` loads the round's
    start into it before any step, so a copy would be a copy per tensor for nothing)."""
    live = clone(like) if copy else empty_like(detached(like))
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
        # one copy over flat buffers on CUDA; a start that is not one (FedSA-LoRA's own B with the
        # global A): one multi-tensor copy there
        copy_into(live, params)
    return load


@dataclass
class PassSize:
    """The most clients one shared pass takes on this device (None: all of them), lowered when a
    pass runs out of the device's memory and kept for the run's later passes."""

    clients: int | None = None


def shared_pass(lm, batches: list[dict], adapters: list[Params], size: PassSize) -> list[float]:
    """`lm.routed_loss_and_grads(batches, adapters)` in passes of at most `size.clients` clients;
    a pass that runs out of the device's memory is run again as two halves (and `size` lowered to
    the half's), down to one client, whose running out of memory is the caller's. Each client's
    loss and gradient are its own whichever pass it is in."""
    limit = len(batches) if size.clients is None else size.clients
    losses: list[float] = []
    start = 0
    while start < len(batches):
        group = slice(start, start + limit)
        try:
            if len(batches[group]) == 1:  # one client: its own pass, with the one-adapter kernels
                losses.append(alone(lm, batches[start], adapters[start]))
            else:
                losses += lm.routed_loss_and_grads(batches[group], adapters[group])
        except torch.OutOfMemoryError:
            if limit == 1:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the failed pass's blocks, before the smaller one
            limit = size.clients = (min(limit, len(batches) - start) + 1) // 2
            continue  # the same clients again, fewer per pass (their gradients are zeroed first)
        start += limit
    return losses


@dataclass
class Member:
    """One client in a lockstep: its round of its method's rule (`LocalRound`, on `live`), its
    minibatches, its name (in a divergence's message) and its group: the run it belongs to, when
    several runs train in lockstep (`--batch runs`), else 0."""

    round: LocalRound
    live: Params
    batches: list[dict]
    name: str
    group: int = 0


def member(method: Method, state: State, global_params: Params, received: Message, batches: list[dict],
           lr: float, round_index: int, name: str, optimizer=None, like: Params | None = None,
           group: int = 0) -> Member:
    """A client's `Member`: its live adapter (a copy of `like`, the model's adapter's names and
    shapes) loaded with its round's start (`LocalRound`)."""
    if any(not isinstance(b, dict) for b in batches):  # engine.check_batch refuses it before a run starts
        raise UserError("batched clients do not take gradient accumulation yet "
                        "(optimizer.grad_accumulation > 1): run without --batch")
    live = own_adapter(like, copy=False)
    with _named(name):
        steps = LocalRound(method, state, global_params, received, len(batches), lr, round_index, optimizer,
                           live, _loader(live))
    return Member(steps, live, batches, name, group)


def lockstep(lm, members: list[Member], on_step: Callable[[int, int, float], None] | None = None,
             size: PassSize | None = None, isolate: bool = False) -> dict[int, TrainingDiverged]:
    """Local steps t = 0, 1, ... of every member, step t of all in shared passes (`shared_pass`);
    `on_step(i, t, loss)` after member i's step. A member that diverges: its `TrainingDiverged`,
    named, is raised; with `isolate` its group's members leave the lockstep instead (the other
    groups go on) and the result maps each such group to its error."""
    size = PassSize() if size is None else size
    failed: dict[int, TrainingDiverged] = {}
    for t in range(max(len(m.batches) for m in members)):
        active = [i for i, m in enumerate(members) if t < len(m.batches) and m.group not in failed]
        if not active:
            break
        with torch.enable_grad():
            losses = shared_pass(lm, [members[i].batches[t] for i in active], [members[i].live for i in active], size)
        for i, loss in zip(active, losses):
            m = members[i]
            if m.group in failed:  # a member of its group diverged earlier in this step
                continue
            try:
                with _named(m.name):
                    loss = m.round.step(t, _gradient(lm, m.live, m.batches[t], loss))
            except TrainingDiverged as exc:
                if not isolate:
                    raise
                failed[m.group] = exc
                continue
            if on_step is not None:
                on_step(i, t, loss)
    return failed


def finish(m: Member) -> ClientRound:
    """The member's round's end (`LocalRound.finish`), a divergence named."""
    with _named(m.name):
        return m.round.finish()


def alone(lm, batch: dict, adapter: Params) -> float:
    """One client's loss, its gradient left in `adapter`'s ``.grad``: the sequential engine's pass
    (`loss_and_grads` on the model's own adapter, loaded with `adapter`'s values), whose fused
    one-adapter kernels (model/lora_mlp.py) a routed pass cannot use."""
    lm.set_lora(adapter)
    loss, grads = lm.loss_and_grads(batch)
    if any(p.grad is None for p in adapter.values()):  # its first gradient: one buffer, as the model's
        for p, g in zip(adapter.values(), clone(in_order(grads, adapter)).values()):
            p.grad = g
    else:
        copy_into({n: p.grad for n, p in adapter.items()}, grads)  # (one copy on CUDA)
    return loss


def lockstep_round(lm, method: Method, states: list[State], global_params: Params, received: Message,
                   batches: list[list[dict]], lr: float, round_index: int, names: list[str],
                   on_step: Callable[[int, int, float], None] | None = None,
                   optimizer=None, size: PassSize | None = None) -> list[ClientRound]:
    """Round `round_index` of the clients whose method states are `states` (updated in place)
    and whose minibatches are `batches[i]`, in lockstep (module docstring): their `ClientRound`s,
    in order. `names[i]` names client i in a divergence's message; `on_step(i, t, loss)` after
    each client's step; `size`: how many clients one pass takes (`shared_pass`; None: all, lowered
    on running out of memory for this round only)."""
    members = [member(method, state, global_params, received, bs, lr, round_index, name, optimizer, lm.lora)
               for state, bs, name in zip(states, batches, names)]
    lockstep(lm, members, on_step, size)
    return [finish(m) for m in members]


def _gradient(lm, live: Params, batch: dict, shared_loss: float) -> Callable[[], tuple[float, Params]]:
    """A step's `gradient()` for one client: the shared pass's at first, then its own (module docstring)."""
    at = _version(live)
    fresh = [True]

    def gradient() -> tuple[float, Params]:
        if fresh[0] and _version(live) == at:
            fresh[0] = False
            return shared_loss, {n: p.grad for n, p in live.items()}
        fresh[0] = False
        loss = alone(lm, batch, live)  # this client alone, at its weights now
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


BATCH_MODES = ("auto", "none", "clients", "runs")  # runs: a sweep's runs together (run/together.py)


def resolve_batch(batch: str, workers: int, cfg, device: str) -> str:
    """`auto` (the default): a round's clients in lockstep on CUDA, one at a time elsewhere. On one
    H200 a shared pass of 4 clients' steps ran 1.08-1.81x the tokens/s of one client's at
    SmolLM2-135M and 1.25-1.95x at LLaMA-3.2-1B, FLAN- and Dolly-shaped, in two calls (benchmarks/
    results/gpu-batched.json, gpu-batched-profile.json), about 3x at SmolLM2 with the batched LoRA
    products (gpu-batched-bmm.json); on this 2-core CPU it is 1.0x (batched-cpu.json), and one at a time keeps
    the CPU's pinned results bit for bit. Not with workers or gradient accumulation (`check_batch`).
    The training only: `Federation.score_together` keeps `auto`'s scoring one model at a time."""
    if batch != "auto":
        return batch
    lockstep_fits = workers == 1 and cfg.optimizer.grad_accumulation == 1
    return "clients" if device.startswith("cuda") and lockstep_fits else "none"


def check_batch(batch: str, workers: int, cfg) -> None:
    """Refuse a `batch` mode that is not one, or that cannot run with these settings."""
    if batch not in BATCH_MODES:
        raise UserError(f"--batch must be one of {', '.join(BATCH_MODES)}, got {batch!r}")
    if batch != "none" and workers > 1:
        raise UserError(f"--batch {batch} trains clients together in one process; use --workers 1 (got {workers})")
    if batch != "none" and cfg.optimizer.grad_accumulation > 1:
        raise UserError(f"--batch {batch} does not take gradient accumulation yet "
                        f"(optimizer.grad_accumulation={cfg.optimizer.grad_accumulation}); run without --batch")
