"""FedSVD (Lee et al., 2025, "FedSVD: Adaptive Orthogonalization for Private
Federated Learning with LoRA"): FFA-LoRA whose server re-factorises every
LoRA pair by an SVD, so that A adapts over rounds and stays orthonormal.

Client k (as FFA-LoRA): A is fixed within the round at the A^r the server
sent; T steps of plain SGD on B only, B ← B − η ∇_B f_k(A^r, B); it uploads B.

Server, per LoRA pair (A_l, B_l) of rank r, in round t (0-based):

    B̄ = Σ_k p_k B_k,  p_k = |D_k| / Σ_j |D_j|       (A^r is kept, not averaged)
    if (t + 1) % refactor_every == 0:
        B̄ A^r = U S Vᵀ                                 (rank ≤ r: truncation to r is exact)
        A^{r+1} = Vᵀ   (r × in, orthonormal rows: A Aᵀ = I)
        B^{r+1} = U S  (out × r)
    else:
        A^{r+1} = A^r,  B^{r+1} = B̄

so B^{r+1} A^{r+1} = B̄ A^r: the re-factorisation leaves the global adapter
unchanged and only changes the basis the clients train B in next round.
With refactor_every = 1 (the default, and the paper's setting) it happens
after every round; the official code (github.com/sw-programmer/FedSVD,
`reinit_lora`, run when (round + 1) % recalculate_svd_period == 0) uses the
same schedule, which we follow.

Computation: the SVD of the out × in product is taken through its factors,
B̄ = Q_B R_B and A^rᵀ = Q_A R_A (thin QR), R_B R_Aᵀ = U' S V'ᵀ (r × r), so
U = Q_B U' and V = Q_A V'. This is the SVD of B̄ A^r (not an approximation)
at O((out + in) r²) cost instead of O(out · in · min(out, in)). It runs in
float64 and is cast back to the adapter's dtype.

We implement the non-private version: the paper's DP-SGD on B (clipping and
noise) is not part of this rule. The official code's `svd_warmup_steps`
(default 0) is not exposed.
Personalized model of client k: its local model (A^r, B_k) of the last round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..params import is_lora_a, lora_b_name
from .base import Params, RoundContext, State
from .ffa_lora import FFALoRA


@dataclass
class FedSVDArgs:
    refactor_every: int = 1  # re-factorise after rounds t with (t + 1) % refactor_every == 0

    def __post_init__(self):
        if self.refactor_every < 1:
            raise ValueError(f"refactor_every must be >= 1, got {self.refactor_every}")


def svd_refactor(B: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U S, Vᵀ) of the SVD of B A, with as many columns / rows as B and A have (r).

    When r exceeds min(out, in) the product has fewer singular triplets than r;
    the missing rows of A and columns of B are zero, which keeps B A exact.
    """
    r = A.shape[0]
    q_b, r_b = torch.linalg.qr(B.double())  # B = Q_B R_B
    q_a, r_a = torch.linalg.qr(A.double().T)  # Aᵀ = Q_A R_A
    u_small, s, vh_small = torch.linalg.svd(r_b @ r_a.T, full_matrices=False)
    u, vh = q_b @ u_small, vh_small @ q_a.T
    k = s.shape[0]
    new_b = torch.zeros(B.shape[0], r, dtype=torch.float64, device=B.device)
    new_a = torch.zeros(r, A.shape[1], dtype=torch.float64, device=A.device)
    new_b[:, :k] = u * s
    new_a[:k] = vh
    return new_b.to(B.dtype), new_a.to(A.dtype)


class FedSVD(FFALoRA):
    name = "fedsvd"
    label = "FedSVD"
    Args = FedSVDArgs

    def finish_aggregation(self, global_params: Params, sums: dict[str, Params], weights: list[float],
                           server_state: State, ctx: RoundContext) -> Params:
        new = super().finish_aggregation(global_params, sums, weights, server_state, ctx)  # B averaged, A kept
        if (ctx.round + 1) % self.args.refactor_every == 0:
            for a_name in [n for n in new if is_lora_a(n)]:
                b_name = lora_b_name(a_name)
                new[b_name], new[a_name] = svd_refactor(new[b_name], new[a_name])
        return new
