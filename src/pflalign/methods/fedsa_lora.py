"""FedSA-LoRA (Guo et al., ICLR 2025, "Selective Aggregation for Low-Rank
Adaptation in Federated Learning"): share A, keep B.

The paper's finding: the A matrices learn general knowledge and the B
matrices client-specific knowledge, so only A is aggregated. For every LoRA
pair (A_l, B_l):

Client k keeps its own B_k across rounds (state "B", initially the initial
B^0 = 0 of every client). Round r:

    start:  A ← A^r (from the server),  B ← B_k
    T steps of plain SGD on both A and B
    end:    B_k ← B;  it uploads A_k (and every other non-B tensor)

Server (weighted by |D_k|, as FedAvg; the official code, FederatedScope with
`personalization.local_param: ['lora_B']`, does the same):

    A^{r+1} = Σ_k p_k A_k,     p_k = |D_k| / Σ_j |D_j|

B is never averaged into training: no client ever starts from anything but
its own B_k.

Personalized model of client k, argument `personalized`:

    "after_aggregation" (default): the aggregated A^{r+1} with the client's own
        B_k, i.e. the model the client holds once the server round is done.
        This is what the official code evaluates (FederatedScope-LLM keeps
        `local_param: ['lora_B']` on the client and loads every other tensor
        from the server's model before evaluating), and what other public
        re-implementations do; the Table 1 runs use it.
    "before_aggregation": its local model after its last round, its own
        trained A_k and B_k (this project's rule before issue 19).

Global model for evaluation (FedSA-LoRA itself has no global B; the engine
needs a full adapter), argument `global_b`:

    "mean" (default): A^{r+1} with B̄ = Σ_k p_k B_k, the weighted mean of the
        participants' B's. The clients upload their B for this evaluation-only
        average; it is never sent back nor used in training.
    "init": A^{r+1} with the initial B^0 (nothing of B leaves a client; with
        PEFT's B^0 = 0 the global model is then the base model).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..params import is_lora_b
from .base import Message, Params, RoundContext, Scratch, State, WeightedSum, clone
from .fedavg import FedAvg

GLOBAL_B_RULES = ("mean", "init")
PERSONALIZED_RULES = ("after_aggregation", "before_aggregation")


@dataclass
class FedSALoRAArgs:
    global_b: str = "mean"  # the B of the global (evaluation) model: mean | init
    personalized: str = "after_aggregation"  # the personalized model: global A + own B | own A and B

    def __post_init__(self):
        if self.global_b not in GLOBAL_B_RULES:
            raise ValueError(f"global_b must be one of {', '.join(GLOBAL_B_RULES)}, got {self.global_b!r}")
        if self.personalized not in PERSONALIZED_RULES:
            raise ValueError(f"personalized must be one of {', '.join(PERSONALIZED_RULES)}, "
                             f"got {self.personalized!r}")


class FedSALoRA(FedAvg):  # FedAvg's local step; only A is shared
    name = "fedsa-lora"
    label = "FedSA-LoRA"
    family = "LoRA-modulation"
    Args = FedSALoRAArgs
    evaluation_args = ("personalized",)
    weight_groups = ("shared", "eval_B")

    def init_client_state(self, global_params: Params) -> State:
        return {"B": clone({n: w for n, w in global_params.items() if is_lora_b(n)})}

    def client_start(self, global_params: Params, state: State, received: Message, scratch: Scratch) -> Params:
        # (copies made as one concatenation on CUDA: params.clone)
        return clone({n: state["B"][n] if is_lora_b(n) else w for n, w in global_params.items()})

    def client_end(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> Message:
        own_b = clone({n: w for n, w in params.items() if is_lora_b(n)})
        state["B"] = own_b
        message = {"shared": clone({n: w for n, w in params.items() if not is_lora_b(n)})}
        if self.args.global_b == "mean":
            message["eval_B"] = clone(own_b)  # evaluation-only upload, see the module docstring
        return message

    def personalized_after_aggregation(self, global_params: Params, personalized: Params, state: State) -> Params:
        if self.args.personalized == "before_aggregation":
            return personalized
        return {n: state["B"][n] if is_lora_b(n) else w for n, w in global_params.items()}

    def aggregation_sums(self, global_params: Params, weights: list[float], server_state: State,
                         ctx: RoundContext) -> dict:
        sums = {"shared": WeightedSum(weights, "shared")}  # A^{r+1} = Σ_k p_k A_k
        if self.args.global_b == "mean":
            sums["eval_B"] = WeightedSum(weights, "eval_B")  # B̄ = Σ_k p_k B_k, for evaluation only
        return sums

    def finish_aggregation(self, global_params: Params, sums: dict[str, Params], weights: list[float],
                           server_state: State, ctx: RoundContext) -> Params:
        new = dict(sums["shared"])
        if self.args.global_b == "mean":
            new.update(sums["eval_B"])
        else:
            new.update(clone({n: w for n, w in global_params.items() if is_lora_b(n)}))  # B^0, never changed
        return {n: new[n] for n in global_params}  # the engine's order of names
