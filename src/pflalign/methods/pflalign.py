"""pFLAlign (Kim & Lee, 2026, "Personalized Federated Learning for Gradient Alignment"),
Algorithm 1, element-wise on every trainable (LoRA) tensor of client k.

Persistent on the client across rounds: Δ_k = 0, v = 0, P = 0 (at first).
Start of round r:  m = 0;  w_{k,0} = w^r + Δ_k.
For t = 0 … T−1, with ε = 1e-12 and β (default 0.9; the paper does not state it):

    g = ∇ f_k(w_{k,t}; minibatch)
    m = β m + (1−β) g
    v = β v + (1−β) g²
    α = 1 − (1−β) g² / (v + ε)                                  # moving factor
    γ = 0.5 − 0.5 · erf(|m| / √(2 max(v − m², 0) + ε)) · sign(−m · Δ_k)
    P = α P + (1−β) m² / (v + ε)                                # preconditioner
    w_{k,t+1} = w_{k,t} − η P g − (1/T) γ Δ_k

End of round: Δ_k = w_{k,T} − w^r; the client sends w_{k,T}; the server
averages the clients' models weighted by |D_k| (as FedAvg). The
personalized model of client k is its w_{k,T} of the last round.

The paper defines no ablations. The five variants below are ours: the same
rule with one component switched off (`precondition`, `gamma`,
`personal_init`), so each differs from the full method exactly in that
component, to measure what the component is worth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import GradFn, Method, Message, Params, State, StepContext, clone, zeros_like

GAMMA_RULES = ("erf", "zero", "const", "hard")


@dataclass
class PFLAlignArgs:
    beta: float = 0.9
    eps: float = 1e-12
    precondition: bool = True  # False: P ≡ 1 (plain SGD step on g)
    gamma: str = "erf"  # erf (paper) | zero (no correction) | const (0.5) | hard (0.5 + 0.5 sign(m·Δ))
    personal_init: bool = True  # False: w_{k,0} = w^r and no correction term

    def __post_init__(self):
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {self.beta}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.gamma not in GAMMA_RULES:
            raise ValueError(f"gamma must be one of {', '.join(GAMMA_RULES)}, got {self.gamma!r}")


def gamma_erf(m: torch.Tensor, v: torch.Tensor, delta: torch.Tensor, eps: float) -> torch.Tensor:
    """γ = 0.5 − 0.5 erf(|m| / √(2 max(v − m², 0) + ε)) sign(−m Δ): the probability-like gate.

    |m| / √(v − m²) is a signal-to-noise ratio of the gradient; when the
    momentum agrees with the personal direction Δ (m·Δ > 0) γ grows towards 1,
    when it opposes it γ shrinks towards 0; a weak signal keeps γ near 0.5.
    """
    spread = (v - m * m).clamp_min_(0.0).mul_(2.0).add_(eps).sqrt_()
    gate = m.abs().div_(spread).erf_()
    # 0.5 − 0.5·erf·sign(−mΔ) = 0.5 + 0.5·erf·sign(mΔ); in place, few passes (see local_step)
    return gate.mul_(torch.sign(m * delta)).mul_(0.5).add_(0.5)


class PFLAlign(Method):
    name = "pflalign"
    label = "pFLAlign"
    family = "pFLAlign"
    Args = PFLAlignArgs
    refuses_adamw = "its preconditioner P (with m and v) is its optimizer"

    def init_client_state(self, global_params: Params) -> State:
        return {"delta": zeros_like(global_params), "v": zeros_like(global_params), "P": zeros_like(global_params)}

    def client_start(self, global_params: Params, state: State, received: Message) -> Params:
        state["m"] = zeros_like(global_params)  # m is reset every round, v and P are not
        if not self.args.personal_init:
            return clone(global_params)
        return {n: w + state["delta"][n] for n, w in global_params.items()}

    def _gamma(self, m, v, delta):
        rule = self.args.gamma
        if rule == "erf":
            return gamma_erf(m, v, delta, self.args.eps)
        if rule == "hard":
            return 0.5 + 0.5 * torch.sign(m * delta)
        return torch.full_like(m, 0.5 if rule == "const" else 0.0)

    @torch.no_grad()
    def local_step(self, params: Params, grad_fn: GradFn, state: State, ctx: StepContext) -> float:
        loss, grads = grad_fn()
        beta, eps, T = self.args.beta, self.args.eps, ctx.num_steps
        first = next(iter(params.values()))
        one = torch.ones((), dtype=first.dtype, device=first.device)
        # Tensor by tensor, in place, with 1/(v+ε) shared by α and P: each small LoRA
        # tensor stays in cache through its update (flat multi-tensor ops would stream
        # all of them through memory once per operation).
        for n, w in params.items():
            g = grads[n]
            m, v, P, delta = state["m"][n], state["v"][n], state["P"][n], state["delta"][n]
            m.mul_(beta).add_(g, alpha=1 - beta)
            v.mul_(beta).addcmul_(g, g, value=1 - beta)
            if self.args.precondition:
                inverse = v.add(eps).reciprocal_()
                alpha = torch.addcmul(one, g * g, inverse, value=-(1 - beta))  # 1 − (1−β) g²/(v+ε)
                P.mul_(alpha).addcmul_(m * m, inverse, value=1 - beta)  # α P + (1−β) m²/(v+ε)
                w.addcmul_(P, g, value=-ctx.lr)
            else:
                w.sub_(g, alpha=ctx.lr)
            if self.args.personal_init:
                w.addcmul_(self._gamma(m, v, delta), delta, value=-1.0 / T)
        return loss

    def client_end(self, global_params: Params, params: Params, state: State) -> Message:
        del state["m"]
        for n, w in params.items():  # in place: Δ_k stays one flat buffer (params.empty_like)
            torch.sub(w.detach(), global_params[n], out=state["delta"][n])
        return {"params": clone(params)}


# ---- our variants (not the paper's): one component switched off each ------
@dataclass
class NoPrecondArgs(PFLAlignArgs):
    precondition: bool = False


@dataclass
class NoCorrectionArgs(PFLAlignArgs):
    gamma: str = "zero"


@dataclass
class ConstGammaArgs(PFLAlignArgs):
    gamma: str = "const"


@dataclass
class HardGammaArgs(PFLAlignArgs):
    gamma: str = "hard"


@dataclass
class NoPersonalInitArgs(PFLAlignArgs):
    personal_init: bool = False


class PFLAlignNoPrecond(PFLAlign):
    """pFLAlign with P ≡ 1: the step is w ← w − η g − (1/T) γ Δ_k."""

    name = "pflalign-no-precond"
    Args = NoPrecondArgs


class PFLAlignNoCorrection(PFLAlign):
    """pFLAlign with γ = 0: personalized start, no correction towards w^r."""

    name = "pflalign-no-correction"
    Args = NoCorrectionArgs


class PFLAlignConstGamma(PFLAlign):
    """pFLAlign with a constant γ = 0.5."""

    name = "pflalign-const-gamma"
    Args = ConstGammaArgs


class PFLAlignHardGamma(PFLAlign):
    """pFLAlign with the hard gate γ = 0.5 + 0.5 sign(m·Δ_k) instead of erf."""

    name = "pflalign-hard-gamma"
    Args = HardGammaArgs


class PFLAlignNoPersonalInit(PFLAlign):
    """pFLAlign with w_{k,0} = w^r and no correction term (preconditioning only)."""

    name = "pflalign-no-personal-init"
    Args = NoPersonalInitArgs
