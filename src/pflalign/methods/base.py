"""The interface every federated method implements, and the helpers they share.

A method is three things, nothing more (like a `torch.optim` optimizer is its
state plus `step`):

* its **client rule**: how a client starts a round (`client_start`), how it
  takes one local step (`local_step`), and what it sends back (`client_end`);
* its **server rule**: how the server turns the clients' messages into the
  next global adapter: the running sums over the messages it needs
  (`aggregation_sums`) and what it makes of them (`finish_aggregation`);
* its **state**: per client (`init_client_state`, kept across rounds on the
  client) and on the server (`init_server_state`).

Like `torch.optim`, which keeps `Adam.step` (find each parameter's state) apart from
`_single_tensor_adam` (the arithmetic), a method's update rule is a plain function over
tensors in its module, with the equation and its source in the docstring (e.g.
`fedprox.proximal_direction`, `pflalign.pflalign_step_`); its `local_step` looks up the
state and calls it.

Two kinds of client data, kept apart:

* `State`: what the client keeps across rounds (pFLAlign's Δ_k, v, P; SCAFFOLD's c_k).
  It is checkpointed, so its group names are a file format.
* `Scratch`: what one round needs from its start to its end (pFLAlign's m, SCAFFOLD's
  c and Σ_t η, FedGloSS's w̃). The client runner makes an empty one as the round starts
  (`new_scratch`), hands it to `client_start`, to every `local_step` (as
  ``ctx.scratch``), to `round_metrics` and `client_end`, and drops it when the round
  ends: it is never part of `State`, so it cannot reach a checkpoint or the next round.

`Method` is abstract: it declares the hooks and the defaults that do nothing
(no state, nothing broadcast, w_{k,0} = w^r). `FedAvg` (fedavg.py) is the
simplest complete method, and a method that changes only part of FedAvg
subclasses it (``FedProx(FedAvg)`` changes the local step, ``FedOpt(FedAvg)``
the server step), as Flower's strategies do.

A local step moves each trained tensor with ``ctx.descend(name, w, d)`` along its descent
direction d; the round's optimizer (`pflalign.optim`: SGD, the default, w ← w − η d, or
AdamW on d) takes the step, so "SGD" in a method's docstring is the default optimizer's
step, and a method that cannot run under AdamW says why in `refuses_adamw`.

All parameters are `Params`: LoRA tensors by name. State is a `State`: named
`Params` groups (e.g. pFLAlign's ``{"delta", "v", "P"}``), so it checkpoints
with `torch.save` and travels as Flower ArrayRecords unchanged. The engine
knows nothing method-specific: it only calls these hooks.

Aggregation streams: the weights p_k = |D_k| / Σ_j |D_j| of a round's
participants are known before they train, so the server keeps running sums
and adds each reply as it comes (`start_aggregation`, then `Aggregation.add`
per reply, then `Aggregation.finish`), holding one adapter per sum and never
the replies themselves: its memory does not grow with the participants.
`aggregate` runs the same three steps over a list.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar

import torch

from ..optim import SGD, AdamW
from ..params import (Params, aligned, aligned_named, clone, detached, empty_like, in_order, mapped,  # noqa: F401
                      zeros_like)  # (the methods' helpers too)

State = dict[str, Params]
Message = dict[str, Params]
GradFn = Callable[[], tuple[float, Params]]
# one client round's working values, by name (see the module docstring): never checkpointed
Scratch = dict[str, Any]


@dataclass
class StepContext:
    """What a local step may know besides its parameters and state."""

    round: int  # 0-based round index r
    step: int  # 0-based local step t
    num_steps: int  # T, local steps per round
    lr: float  # η (of this round: optimizer.schedule)
    global_params: Params  # w^r, read-only
    # the client's optimizer for this round (optimizer.name; fresh every round): `descend` steps with it
    optimizer: SGD | AdamW = field(default_factory=SGD)
    # this client round's scratch (`Method.new_scratch`; the one `client_start` filled), not its state
    scratch: Scratch = field(default_factory=dict)

    def descend(self, name: str, w: torch.Tensor, direction: torch.Tensor) -> None:
        """One optimizer step on tensor `name` along the method's descent direction, in place:
        w ← w − η d with SGD (bit for bit the methods' step before optimizers were a choice),
        AdamW's step on d with adamw (pflalign.optim)."""
        self.optimizer.descend(name, w, direction, self.lr)

    def descend_each(self, pieces: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """`descend` on each (name, w, direction): with SGD on CUDA one multi-tensor update
        (`SGD.descend_each`; the tensors a method trains when it trains only some, FFA-LoRA's B)."""
        self.optimizer.descend_each(pieces, self.lr)


@dataclass
class RoundContext:
    """What the server knows when it aggregates round r."""

    round: int
    num_clients: int  # N, all clients, participating or not
    client_ids: list[int]  # the participants, in message order


@dataclass
class NoArgs:
    """A method without hyperparameters of its own."""


def data_weights(sizes: list[int]) -> list[float]:
    """The aggregation weights of a round's participants: |D_k| / Σ_j |D_j|."""
    total = sum(sizes)
    return [n / total for n in sizes]


def add_weighted(total: Params, item: Params, weight: float) -> None:
    """total += weight · item, tensor by tensor (flat on CUDA), in place. Every weighted sum of messages adds
    through here, from zeros and in client order, so a running sum has `weighted_average`'s
    bits (``add_`` with ``alpha`` rounds once: it is not ``total + weight * item``)."""
    for s, t in aligned(total, item):  # (one operation over flat buffers on CUDA)
        s.add_(t, alpha=weight)


def weighted_average(items: list[Params], weights: list[float]) -> Params:
    """Σ_k weights[k] · items[k], per tensor (weights are expected to sum to 1)."""
    out = zeros_like(items[0])
    for item, w in zip(items, weights):
        add_weighted(out, item, w)
    return out


class WeightedSum:
    """The running Σ_k weights[k] · m_k[group] over a round's messages m_k, fed one at a time
    in order (`Aggregation` checks it): `weighted_average`'s additions, so its bits."""

    def __init__(self, weights: list[float], group: str = "params"):
        self.weights, self.group = weights, group
        self.total: Params | None = None  # zeros shaped like the first message's group

    def add(self, i: int, message: Message) -> None:
        item = message[self.group]
        if self.total is None:
            self.total = zeros_like(item)
        add_weighted(self.total, item, self.weights[i])

    def result(self) -> Params:
        return self.total


def equal_weights(count: int) -> list[float]:
    """1/|S| for each of |S| participants (the unweighted mean of SCAFFOLD's Δc, FedDyn's models)."""
    return [1.0 / count] * count


class Aggregation:
    """One round's server rule fed one reply at a time: `add(i, message)` for the i-th
    participant (in client order, i = 0, 1, ...), then `finish()` → w^{r+1}. It holds the
    method's running sums (`Method.aggregation_sums`), one adapter each, and no message; the
    server state changes only in `finish` (a round that stops midway leaves it as it was)."""

    def __init__(self, method: Method, global_params: Params, weights: list[float], server_state: State,
                 ctx: RoundContext):
        self.method, self.global_params, self.weights = method, global_params, weights
        self.server_state, self.ctx = server_state, ctx
        self.sums = method.aggregation_sums(global_params, weights, server_state, ctx)
        self.added = 0
        self.finished = False

    def add(self, i: int, message: Message) -> None:
        # in order, each once: the order of the additions decides the sums' last bits
        if i != self.added:
            raise ValueError(f"aggregation: reply {i} added, expected reply {self.added} "
                             f"(replies are added once each, in client order)")
        if i >= len(self.weights):
            raise ValueError(f"aggregation: reply {i} added, but the round has {len(self.weights)} participants")
        for running in self.sums.values():
            running.add(i, message)
        self.added += 1

    def finish(self) -> Params:
        """w^{r+1}; updates the server state in place."""
        if self.added != len(self.weights) or self.finished:
            raise ValueError(f"aggregation: finished with {self.added} of {len(self.weights)} replies added"
                             + (", a second time" if self.finished else ""))
        self.finished = True  # the server state is updated once
        sums = {name: running.result() for name, running in self.sums.items()}
        return self.method.finish_aggregation(self.global_params, sums, self.weights, self.server_state, self.ctx)


class Method(ABC):
    """The interface: a method's client rule, server rule and state (module docstring).

    Abstract: a method defines its local step (`local_step`), its message (`client_end`) and
    its server rule (`aggregation_sums`, `finish_aggregation`), usually by subclassing
    `FedAvg` and overriding only what differs. The other hooks default to doing nothing.
    """

    name: ClassVar[str]  # the registry's name (`--set method=...`, run folders, results.json)
    # the paper's spelling in tables and figures (None: `name`); not inherited: an ablation
    # (a subclass) is called by its own name
    label: ClassVar[str | None] = None
    family: ClassVar[str] = "Other"  # the row group of the report's table (FAMILIES in methods/__init__.py)
    Args: ClassVar[type] = NoArgs
    # the groups of `client_end`'s message that hold adapter weights (the Flower server measures
    # an update's size against w^r there; other groups, like SCAFFOLD's delta_c, as they are)
    weight_groups: ClassVar[tuple[str, ...]] = ("params",)
    # arguments that choose only which model is evaluated, not how it trains (`pflalign rescore`
    # may change them on a finished run)
    evaluation_args: ClassVar[tuple[str, ...]] = ()
    # why optimizer.name=adamw is not defined for the method (None: AdamW runs on the
    # direction its `local_step` hands `ctx.descend`); docs/methods.md lists each method's
    refuses_adamw: ClassVar[str | None] = None

    def __init__(self, args=None):
        self.args = args if args is not None else self.Args()

    @classmethod
    def display_name(cls) -> str:
        return cls.__dict__.get("label") or cls.name

    @classmethod
    def arg_names(cls) -> list[str]:
        return [f.name for f in fields(cls.Args)]

    def trains(self, name: str) -> bool:
        """Whether the client rule updates tensor `name` (False for a frozen one, like
        FFA-LoRA's A): the round's gradient statistics (GSNR) cover trained tensors only."""
        return True

    # ---- client side -------------------------------------------------------
    def init_client_state(self, global_params: Params) -> State:
        return {}

    @staticmethod
    def new_scratch() -> Scratch:
        """An empty scratch for one client round: whoever runs the round makes it before
        `client_start` and drops it after `client_end` (client.local_round)."""
        return {}

    def client_start(self, global_params: Params, state: State, received: Message, scratch: Scratch) -> Params:
        """The client's starting weights w_{k,0} for this round (default: w^r).

        `received` is what the server broadcast besides w^r (see `broadcast`); what the
        round needs of it, or of its own, until `client_end` goes into `scratch`, not
        `state` (SCAFFOLD keeps c there, pFLAlign its momentum m).
        """
        return clone(global_params)

    @abstractmethod
    def local_step(self, params: Params, grad_fn: GradFn, state: State, ctx: StepContext) -> float:
        """One local step, in place on the live `params`; returns the minibatch loss.

        `grad_fn()` computes (loss, gradients) at the current `params`, with
        autograd on (the caller's closure turns it on, as `torch.optim` does
        around its closure, so that the step itself runs without it); a
        method may call it more than once (SAM). The round's scratch is
        ``ctx.scratch``. Implementations run under ``torch.no_grad()``.
        """

    def start_warning(self, lr: float, num_steps: int) -> str | None:
        """One line a run of this method prints as it starts when its settings will not train as a
        user expects (pFLAlign: a β that caps its step far below the lr's); None: nothing to say."""
        return None

    def round_metrics(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> dict[str, float]:
        """What only the method can measure of the client's round just taken (pFLAlign: its
        preconditioner and gate), as numbers for the round's `client_round` metrics line; called
        after the T local steps, before `client_end`. Default: nothing."""
        return {}

    @abstractmethod
    def client_end(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> Message:
        """What the client sends to the server after its T local steps; updates `state`."""

    def personalized(self, global_params: Params, params: Params, state: State) -> Params:
        """The client's personalized model after this round (default: its local model w_{k,T})."""
        return clone(params)

    def personalized_after_aggregation(self, global_params: Params, personalized: Params, state: State) -> Params:
        """The personalized model that is evaluated (and exported): called with the newest global
        adapter, after the server aggregated. Default: `personalized` as the last round left it.
        FedSA-LoRA overrides it (the aggregated A with the client's own B)."""
        return personalized

    # ---- server side -------------------------------------------------------
    def init_server_state(self, global_params: Params) -> State:
        return {}

    def broadcast(self, global_params: Params, server_state: State) -> Message:
        """What the server sends every participant besides w^r (e.g. SCAFFOLD's c); default nothing."""
        return {}

    @abstractmethod
    def aggregation_sums(self, global_params: Params, weights: list[float], server_state: State,
                         ctx: RoundContext) -> dict:
        """The running sums over the round's messages that `finish_aggregation` needs, by name:
        objects with ``add(i, message)`` and ``result()`` (`WeightedSum`). `weights` are
        |D_k| / Σ|D_j| over the participants (FedAvg: w̄ = Σ_k p_k m_k["params"])."""

    @abstractmethod
    def finish_aggregation(self, global_params: Params, sums: dict[str, Params], weights: list[float],
                           server_state: State, ctx: RoundContext) -> Params:
        """The next global adapter w^{r+1} from the finished sums; updates `server_state` in place."""

    def start_aggregation(self, global_params: Params, weights: list[float], server_state: State,
                          ctx: RoundContext) -> Aggregation:
        """Round ctx.round's aggregation, to be fed each participant's message as it arrives."""
        return Aggregation(self, global_params, weights, server_state, ctx)

    def aggregate(
        self, global_params: Params, messages: list[Message], weights: list[float],
        server_state: State, ctx: RoundContext,
    ) -> Params:
        """The next global adapter w^{r+1} from a list of messages (`start_aggregation` over it);
        `weights` are |D_k| / Σ|D_j| over participants."""
        aggregation = self.start_aggregation(global_params, weights, server_state, ctx)
        for i, message in enumerate(messages):
            aggregation.add(i, message)
        return aggregation.finish()

    def needs_each_upload(self) -> str | None:
        """Why `aggregate` needs more than the weighted sum Σ_k weights[k]·messages[k] of the
        uploads (None: that sum is all it needs: its `aggregation_sums` are data-weighted
        `WeightedSum`s, one per message group at most).

        When it needs only that sum, ``aggregate(w, [Σ_k p_k m_k], [1.0], ...)`` equals
        ``aggregate(w, messages, weights, ...)``, so the Flower server can run the method on
        a sum it never sees the terms of (SecAgg+) or on a noised sum (differential privacy:
        the method's rule is then post-processing of a private release). A method whose rule
        looks at each upload, weighs them otherwise or counts them says why here, and the
        Flower app refuses those options for it (pflalign.flower.privacy)."""
        return None
