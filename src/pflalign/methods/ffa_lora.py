"""FFA-LoRA (Sun et al., ICLR 2024, "Improving LoRA in Privacy-preserving
Federated Learning"): federated freeze-A LoRA.

Every LoRA pair (A_l, B_l) of the adapter ΔW_l = (α/r) B_l A_l:

    A_l is frozen at its random initialisation A_l^0 (never updated, never
        averaged: the server copies it through bit for bit);
    B_l starts at 0 (PEFT's init) and is the only trained tensor.

Client k, from w^r, T steps of plain SGD on B only:

    B ← B − η ∇_B f_k(A^0, B)          (A stays A^0; its gradient is ignored)

and it sends its B's only (half of LoRA's upload). Server:

    B^{r+1} = Σ_k (|D_k| / Σ_j |D_j|) B_k,      A^{r+1} = A^r = A^0.

Since all clients share A^0, averaging B averages the adapters B A^0 exactly,
which is the paper's point (no aggregation error, and DP noise on B only;
we implement the non-private version, without DP-SGD). The paper also advises
a larger LoRA α for FFA-LoRA; that is the user's `lora.alpha`, not set here.
Personalized model of client k: its local model (A^0, B_k) of the last round.
Tensors that are not LoRA A's (B's, and anything else trainable) are trained
and averaged as in FedAvg.
"""

from __future__ import annotations

import torch

from ..params import is_lora_a
from .base import Message, Params, RoundContext, Scratch, State, clone
from .fedavg import FedAvg


class FFALoRA(FedAvg):  # FedAvg's step (which skips what `trains` freezes) on B only
    name = "ffa-lora"
    label = "FFA-LoRA"
    family = "LoRA-modulation"

    def trains(self, name: str) -> bool:
        return not is_lora_a(name)  # A is frozen: FedAvg's local step leaves it as it is

    def client_end(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> Message:
        return {"params": clone({n: w for n, w in params.items() if not is_lora_a(n)})}  # (one concatenation on CUDA)

    def finish_aggregation(self, global_params: Params, sums: dict[str, Params], weights: list[float],
                           server_state: State, ctx: RoundContext) -> Params:
        averaged = sums["params"]  # Σ_k p_k B_k (FedAvg's sum: the uploads hold no A)
        # A is copied, not averaged: Σ_k p_k A could differ from A in the last bit.
        frozen_a = clone({n: w for n, w in global_params.items() if is_lora_a(n)})
        return {n: frozen_a[n] if is_lora_a(n) else averaged[n] for n in global_params}
