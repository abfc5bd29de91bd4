"""The server half of a federated run, written once for both engines.

A `Server` holds what a federated server holds: the method (its server rule), the global adapter
w^r and the method's server state (SCAFFOLD's c, FedDyn's h, FedOpt's moments). A round on it:

    received = server.broadcast()                   # sent to every participant besides w^r
    plan = server.start_round(r, chosen, sizes)     # weights p_k = |D_k| / Σ_j |D_j|, the method's sums
    for i, message in enumerate(messages):          # in client order, one at a time (memory flat in |S|)
        plan.add(i, message)
    record = server.finish_round(plan, results)     # w^{r+1} and what the run folder records of the round

The in-process engine (`pflalign.run.engine.Federation`) and the Flower strategy
(`pflalign.flower.strategy.MethodStrategy`) both run their rounds through it, so a third engine
would too; `state_dict` / `load_state_dict` are the checkpoint's ``global`` and ``server_state``.
Like torch.optim's optimizers (`Optimizer.step`, `state_dict`), the server state changes only in
`finish_round` and `load_state_dict`: a round that stops midway leaves it as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..methods.base import Aggregation, Message, Method, Params, RoundContext, State, data_weights
from ..params import flat_where_it_helps

if TYPE_CHECKING:  # a type only: the server needs no client code (tests/test_layers.py)
    from .client import ClientRound


@dataclass
class RoundPlan:
    """One round's aggregation as `Server.start_round` planned it: feed it each participant's
    message with `add(i, message)`, in client order, then hand it to `Server.finish_round`."""

    ctx: RoundContext  # the round, N, the participants in message order
    weights: list[float]  # the participants' p_k = |D_k| / Σ_j |D_j|
    aggregation: Aggregation  # the method's running sums

    def add(self, i: int, message: Message) -> None:
        self.aggregation.add(i, message)


@dataclass
class RoundRecord:
    """What one round produced: w^{r+1}, and what the run folder records of the round (the
    participants' results for the metrics lines and the round's line)."""

    global_params: Params  # w^{r+1}
    clients: list[int]  # the clients whose updates were aggregated, in message order
    results: list[ClientRound]  # theirs, same order (their messages already summed and dropped)
    weights: list[float]  # their aggregation weights
    extra: dict = field(default_factory=dict)  # more fields of the round's line (Flower: bytes, missing clients)

    @property
    def mean_loss(self) -> float:
        """The mean of the participants' local-step losses (the round's line, the progress bar)."""
        return float(np.mean([loss for res in self.results for loss in res.losses]))


class Server:
    """The method's server rule, the global adapter w^r and the server state (module docstring)."""

    def __init__(self, method: Method, global_params: Params, num_clients: int):
        self.method = method
        self.num_clients = num_clients  # N, participating or not (RoundContext)
        self.global_params = global_params  # w^r: sent to the participants and scored
        self.state: State = method.init_server_state(global_params)

    def broadcast(self) -> Message:
        """What every participant of the next round gets besides w^r (`Method.broadcast`)."""
        return self.method.broadcast(self.global_params, self.state)

    def start_round(self, r: int, chosen: list[int], sizes: list[int], presummed: bool = False) -> RoundPlan:
        """Round r's aggregation over the participants `chosen` (client order) with |D_k| = `sizes`.

        `presummed`: the round's messages arrive as one, their data-weighted mean Σ_k p_k m_k
        (Flower's secure aggregation or its DP noise; `Method.needs_each_upload` says which
        methods allow it): the method's rule then runs on that mean with weight 1, fed with
        ``add(0, mean)``; `RoundPlan.weights` are still the p_k, to form that mean."""
        weights = data_weights(sizes)
        ctx = RoundContext(r, self.num_clients, list(chosen))
        aggregation = self.method.start_aggregation(self.global_params, [1.0] if presummed else weights,
                                                    self.state, ctx)
        return RoundPlan(ctx, weights, aggregation)

    def finish_round(self, plan: RoundPlan, results: list[ClientRound], extra: dict | None = None) -> RoundRecord:
        """w^{r+1} from the round's sums (the server state updated in place), and the round's record."""
        self.global_params = flat_where_it_helps(plan.aggregation.finish())  # (one buffer on CUDA: params.aligned)
        return RoundRecord(self.global_params, plan.ctx.client_ids, results, plan.weights, extra or {})

    # ---- checkpoint ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The checkpoint's server part: ``global`` (w^r) and ``server_state``."""
        return {"global": self.global_params, "server_state": self.state}

    def load_state_dict(self, saved: dict) -> None:
        """Back to a checkpoint's w^r and server state (`state_dict`; other keys are ignored)."""
        self.global_params = flat_where_it_helps(saved["global"])
        self.state = saved["server_state"]
