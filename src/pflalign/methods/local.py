"""Local training only: the no-collaboration baseline.

Every client keeps its own adapter w_k (at first the initial adapter w^0) and
continues from it each round it takes part: T steps of plain SGD from w_k,
then w_k ← w_{k,T}. Nothing is sent and nothing is aggregated, so the
"global" adapter stays w^0; the personalized model of client k is its w_k.
"""

from __future__ import annotations

from .base import Message, Params, RoundContext, Scratch, State, clone
from .fedavg import FedAvg


class Local(FedAvg):  # FedAvg's local step, from the client's own model, and no server
    name = "local"
    label = "Local"
    family = "Optimizer-based"

    def init_client_state(self, global_params: Params) -> State:
        return {"model": clone(global_params)}

    def client_start(self, global_params: Params, state: State, received: Message, scratch: Scratch) -> Params:
        return clone(state["model"])

    def client_end(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> Message:
        state["model"] = clone(params)
        return {}  # nothing leaves the client

    def aggregation_sums(self, global_params: Params, weights: list[float], server_state: State,
                         ctx: RoundContext) -> dict:
        return {}  # nothing was sent

    def finish_aggregation(self, global_params: Params, sums: dict[str, Params], weights: list[float],
                           server_state: State, ctx: RoundContext) -> Params:
        return clone(global_params)

    def needs_each_upload(self) -> str | None:
        return "it uploads nothing (local training only): there is no sum to protect"
