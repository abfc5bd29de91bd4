"""pFLAlign (Kim & Lee, 2026, "Personalized Federated Learning for Gradient Alignment"),
Algorithm 1, element-wise on every trainable (LoRA) tensor of client k.

Persistent on the client across rounds: Δ_k = 0, v = 0, P = 0 (at first).
Start of round r:  m = 0;  w_{k,0} = w^r + Δ_k.
For t = 0 … T−1, with ε = 1e-12 and β (the paper does not state it; a config without β
runs at 0.9, the paper presets' and every run's before issue 56; a new run at 0.5 with lr 0.16,
the library's defaults, `settings.resolve_defaults`):

    g = ∇ f_k(w_{k,t}; minibatch)
    m = β m + (1−β) g
    v = β v + (1−β) g²
    α = 1 − (1−β) g² / (v + ε)                                  # moving factor
    γ = 0.5 − 0.5 · erf(|m| / √(2 max(v − m², 0) + ε)) · sign(−m · Δ_k)
    P = α P + (1−β) m² / (v + ε)                                # preconditioner
    w_{k,t+1} = w_{k,t} − η P g − (1/T) γ Δ_k

End of round: Δ_k = w_{k,T} − w^r; the client sends w_{k,T}; the server
averages the clients' models weighted by |D_k| (as FedAvg).

The personalized model of client k (argument `personalized`; the paper's
experiments do not say which model they score):

    "w_kT" (default): its w_{k,T} of the last round, before the server's last
        aggregation (this project's choice since the first Table 1 runs).
    "after_aggregation": w^R + Δ_k, the model it would start a next round from
        (the paper's "W + ΔW_k" once the server has aggregated).

Measured every round for the metrics line (`round_metrics`; they change no
update): the distribution of P at the round's end (`P_mean`, `P_median`,
`P_p90`, `P_max`), the mean over steps of ‖P⊙g‖/‖g‖ (`step_ratio`: the
step's length against plain SGD's at the same η), the step lengths
η‖P⊙g‖ (`step_norm`) and ‖γ⊙Δ_k‖/T (`correction_norm`), the mean gate
(`gamma_mean`) and ‖Δ_k‖ as the round started (`delta_norm`).

The paper defines no ablations. The five variants below are ours: the same
rule with one component switched off (`precondition`, `gamma`,
`personal_init`), so each differs from the full method exactly in that
component, to measure what the component is worth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import (GradFn, Message, Params, Scratch, State, StepContext, aligned, clone, detached, in_order, mapped,
                   zeros_like)
from .fedavg import FedAvg

GAMMA_RULES = ("erf", "zero", "const", "hard")
PERSONALIZED_RULES = ("w_kT", "after_aggregation")


@dataclass
class PFLAlignArgs:
    beta: float = 0.9
    eps: float = 1e-12
    precondition: bool = True  # False: P ≡ 1 (plain SGD step on g)
    gamma: str = "erf"  # erf (paper) | zero (no correction) | const (0.5) | hard (0.5 + 0.5 sign(m·Δ))
    personal_init: bool = True  # False: w_{k,0} = w^r and no correction term
    personalized: str = "w_kT"  # the model scored as personalized: w_kT | after_aggregation (w^R + Δ_k)

    def __post_init__(self):
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {self.beta}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.gamma not in GAMMA_RULES:
            raise ValueError(f"gamma must be one of {', '.join(GAMMA_RULES)}, got {self.gamma!r}")
        if self.personalized not in PERSONALIZED_RULES:
            raise ValueError(f"personalized must be one of {', '.join(PERSONALIZED_RULES)}, "
                             f"got {self.personalized!r}")


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


def gate(rule: str, m: torch.Tensor, v: torch.Tensor, delta: torch.Tensor, eps: float) -> torch.Tensor:
    """γ by `rule`: "erf" (the paper's, `gamma_erf`), "hard" (0.5 + 0.5 sign(m Δ)), "const" (0.5)
    or "zero" (no correction); the last three are our variants."""
    if rule == "erf":
        return gamma_erf(m, v, delta, eps)
    if rule == "hard":
        return 0.5 + 0.5 * torch.sign(m * delta)
    return torch.full_like(m, 0.5 if rule == "const" else 0.0)


@torch.no_grad()
def pflalign_step_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, P: torch.Tensor,
                   delta: torch.Tensor, *, lr: float, beta: float, eps: float, num_steps: int,
                   precondition: bool = True, gamma: str = "erf", personal_init: bool = True,
                   one: torch.Tensor | None = None) -> torch.Tensor | None:
    """One local step of pFLAlign (Kim & Lee, 2026, Algorithm 1) on one tensor, in place on
    w, m, v and P; returns γ (None without the correction, personal_init=False):

        m ← β m + (1−β) g
        v ← β v + (1−β) g²
        α = 1 − (1−β) g² / (v + ε)
        P ← α P + (1−β) m² / (v + ε)                   (precondition=False: P ≡ 1, P untouched)
        γ = gate(gamma, m, v, Δ_k)
        w ← w − η P g − (1/T) γ Δ_k                   (T = num_steps)

    In place, with 1/(v+ε) computed once for α and P: a small LoRA tensor stays in cache
    through its whole update. `one` is a 0-dim 1 of w's dtype (made here if not given; the
    caller makes it once per step).
    """
    m.mul_(beta).add_(g, alpha=1 - beta)
    v.mul_(beta).addcmul_(g, g, value=1 - beta)
    if precondition:
        if one is None:
            one = torch.ones((), dtype=w.dtype, device=w.device)
        inverse = v.add(eps).reciprocal_()
        alpha = torch.addcmul(one, g * g, inverse, value=-(1 - beta))  # 1 − (1−β) g²/(v+ε)
        P.mul_(alpha).addcmul_(m * m, inverse, value=1 - beta)  # α P + (1−β) m²/(v+ε)
        w.addcmul_(P, g, value=-lr)
    else:
        w.sub_(g, alpha=lr)
    if not personal_init:
        return None
    gamma_t = gate(gamma, m, v, delta, eps)
    w.addcmul_(gamma_t, delta, value=-1.0 / num_steps)
    return gamma_t


def step_ratio_cap(beta: float, num_steps: int, eps: float = 1e-12, rounds: int = 300) -> tuple[float, float]:
    """How far P lets pFLAlign step, for a gradient g that never changes: (P on a round's last step,
    its cap; the mean of P over a round's steps, the round's ‖P⊙g‖/‖g‖), in P's steady cycle. A
    scalar run of Algorithm 1's m, v and P with g = 1 (m restarts every round, v and P do not):
    β 0.5, 0.8, 0.9 at T = 5 give caps 0.854, 0.287, 0.089 and means 0.679, 0.242, 0.081
    (tests/test_pflalign.py checks them against the method itself). Real gradients vary, so a run's
    `step_ratio` is lower (FLAN at β 0.8: 0.07–0.16); the cap is the most its β allows."""
    v = P = 0.0
    for _ in range(rounds):
        m, ratios = 0.0, []
        for _ in range(num_steps):
            m = beta * m + (1 - beta)
            v = beta * v + (1 - beta)
            inverse = 1 / (v + eps)
            P = (1 - (1 - beta) * inverse) * P + (1 - beta) * m * m * inverse
            ratios.append(P)
    return ratios[-1], sum(ratios) / len(ratios)


# a pFLAlign run whose cap is below this share of SGD's step gets one line as it starts (issue 56)
SHORT_STEP = 0.2


class PFLAlign(FedAvg):  # FedAvg's server rule, its own client rule
    """pFLAlign (Kim & Lee, 2026), Algorithm 1: P-preconditioned steps from w^r + Δ_k with an erf-gated pull −γΔ_k/T. P is capped by β (`step_ratio_cap`): under 0.09× SGD's step at β 0.9, 0.29× at β 0.8, 0.85× at β 0.5. The library's defaults, β 0.5 at lr 0.16 (settings.resolve_defaults), step about as far as FedAvg's 0.04; the paper presets keep β 0.9 (the paper states none) at 0.04. For 50 rounds on FLAN β 0.8 at lr 0.33 did best (measured: docs/results/pflalign-analysis).

    The update rule, the variants and the measurements are in the module's docstring.
    """

    name = "pflalign"
    label = "pFLAlign"
    family = "pFLAlign"
    Args = PFLAlignArgs
    evaluation_args = ("personalized",)
    refuses_adamw = "its preconditioner P (with m and v) is its optimizer"

    def start_warning(self, lr: float, num_steps: int) -> str | None:
        if not self.args.precondition:
            return None
        cap, _ = step_ratio_cap(self.args.beta, num_steps, self.args.eps)
        if cap >= SHORT_STEP:
            return None
        return (f"pFLAlign at beta {self.args.beta:g} steps at most {cap:.3f} x SGD's step at the same lr (its P is "
                f"capped by beta; docs/methods.md): like SGD at lr {lr * cap:.2g} or less, so it may barely leave the "
                f"base model; beta 0.5 at lr 0.16 (the library's default) steps about as far as FedAvg at 0.04")

    def init_client_state(self, global_params: Params) -> State:
        return {"delta": zeros_like(global_params), "v": zeros_like(global_params), "P": zeros_like(global_params)}

    def client_start(self, global_params: Params, state: State, received: Message, scratch: Scratch) -> Params:
        scratch["m"] = zeros_like(global_params)  # m is reset every round, v and P are not
        # for `round_metrics`: summed over the round's steps without a host sync
        first = next(iter(global_params.values()))
        scratch["round_stats"] = {key: torch.zeros((), dtype=torch.float64, device=first.device) for key in
                                  ("steps", "step_ratio", "step_norm", "correction_norm", "gamma_sum", "gamma_count")}
        # in the adapter's order: a state read back from a file may hold its tensors in another, and
        # the order of a sum decides its last bits
        delta = in_order(state["delta"], global_params)
        scratch["round_stats"]["delta_norm"] = _norm(t for (t,) in aligned(delta))  # (flat on CUDA)
        if not self.args.personal_init:
            return clone(global_params)
        return mapped(torch.add, global_params, delta)  # w^r + Δ_k

    @torch.no_grad()
    def local_step(self, params: Params, grad_fn: GradFn, state: State, ctx: StepContext) -> float:
        loss, grads = grad_fn()
        args = self.args
        first = next(iter(params.values()))
        one = torch.ones((), dtype=first.dtype, device=first.device)
        m, v, P, delta = ctx.scratch["m"], state["v"], state["P"], state["delta"]
        stats = ctx.scratch.get("round_stats")
        sums = torch.zeros(3, dtype=torch.float64, device=first.device)  # ‖g‖², ‖P⊙g‖², ‖γ⊙Δ‖² of this step
        # tensor by tensor on the CPU (a small tensor stays in cache through its ~27 operations); where each
        # operation is a kernel launch (CUDA), once over the flat buffers the tensors are views of
        # (params.aligned): the same arithmetic coordinate by coordinate, 420x fewer launches at SmolLM2
        for w, g, m_n, v_n, P_n, delta_n in aligned(params, grads, m, v, P, delta):
            gamma = pflalign_step_(w, g, m_n, v_n, P_n, delta_n, lr=ctx.lr, beta=args.beta, eps=args.eps,
                                   num_steps=ctx.num_steps, precondition=args.precondition, gamma=args.gamma,
                                   personal_init=args.personal_init, one=one)
            if stats is not None:  # measurements only: the update above is done
                step = P_n * g if args.precondition else g
                correction = gamma * delta_n if gamma is not None else None
                sums += torch.stack([_square_sum(g), _square_sum(step),
                                     _square_sum(correction) if correction is not None else sums.new_zeros(())])
                if gamma is not None:
                    stats["gamma_sum"] += gamma.sum(dtype=torch.float64)
                    stats["gamma_count"] += gamma.numel()
        if stats is not None:
            norms = sums.sqrt()
            stats["steps"] += 1
            stats["step_ratio"] += norms[1] / norms[0].clamp_min(1e-300)
            stats["step_norm"] += ctx.lr * norms[1]
            stats["correction_norm"] += norms[2] / ctx.num_steps
        return loss

    def round_metrics(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> dict[str, float]:
        stats = scratch.get("round_stats")
        if stats is None or not stats["steps"]:
            return {}
        steps = stats["steps"]
        out = {"step_ratio": stats["step_ratio"] / steps, "step_norm": stats["step_norm"] / steps,
               "delta_norm": stats["delta_norm"]}
        if self.args.personal_init:
            out["correction_norm"] = stats["correction_norm"] / steps
            out["gamma_mean"] = stats["gamma_sum"] / stats["gamma_count"]
        if self.args.precondition:
            # in the adapter's order (above); one piece on CUDA
            P = torch.cat([t.detach().reshape(-1) for (t,) in aligned(in_order(state["P"], params))])
            k90 = max(1, math.ceil(0.9 * P.numel()))
            out.update(P_mean=P.mean(dtype=torch.float64), P_median=P.median(),
                       P_p90=P.kthvalue(k90).values, P_max=P.max())
        return {key: float(value) for key, value in out.items()}

    def client_end(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> Message:
        # in place: Δ_k stays one flat buffer (params.empty_like); one subtraction on CUDA
        for delta, w, w_r in aligned(in_order(state["delta"], params), detached(params), in_order(global_params, params)):
            torch.sub(w, w_r, out=delta)
        return {"params": clone(params)}

    def personalized_after_aggregation(self, global_params: Params, personalized: Params, state: State) -> Params:
        if self.args.personalized == "after_aggregation":  # w^R + Δ_k
            return mapped(torch.add, global_params, in_order(state["delta"], global_params))
        return personalized


def _square_sum(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


def _norm(tensors) -> torch.Tensor:
    """‖·‖ over tensors together (float64, a 0-dim tensor: no host sync)."""
    tensors = list(tensors)
    return torch.stack([_square_sum(t) for t in tensors]).sum().sqrt()


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
