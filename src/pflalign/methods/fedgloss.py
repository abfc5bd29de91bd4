"""FedGloSS (Caldarola, Cagnasso, Caputo & Ciccone, CVPR 2025, "Beyond Local
Sharpness: Communication-Efficient Global Sharpness-aware Minimization for
Federated Learning"): SAM on the server, whose ascent direction is the
previous round's pseudo-gradient (no extra communication), plus an ADMM
(FedDyn-like) correction that keeps local and global models consistent.

We follow the official implementation, github.com/pietrocagnasso/fedgloss
(linked from the paper; `FedGloSSServer`, `FedGloSSClient`, `FedGloSSOpt`),
step for step. Round t (0-based), N clients in all, participants S,
p_k = |D_k| / Σ_{j∈S} |D_j|, all norms joint over every trainable tensor.

Server state: σ = 0 and the perturbation ε̃ = 0 (persistent).
Client state: σ_k = 0 (persistent).

Server, start of round t (`broadcast`; the code's `ascent_step`):

    ε̃^t = ρ_s(t) d^{t−1} / ‖d^{t−1}‖     (ε̃^0 = 0; also 0 when d^{t−1} = 0)
    sends w^t and ε̃^t; the clients start from w̃^t = w^t + ε̃^t

Client k (`FedGloSSOpt`: SAM with the ADMM terms in the descent step), from
w = w̃^t, T steps (both gradients of a step on the same minibatch):

    g   = ∇f_k(w)                               (loss reported: f_k(w))
    e   = ρ_l(t) g / ‖g‖                         (0 when ρ_l = 0 or g = 0)
    g_e = ∇f_k(w + e)
    w  ← w − η (g_e − σ_k + (w − w̃^t) / β)
    end: σ_k ← σ_k − (w_{k,T} − w̃^t) / β;  it sends w_{k,T}

Server, end of round t (`update_model`):

    Δ_k     = w_{k,T} − w̃^t
    σ      ← σ − (1 / (β N |S|)) Σ_{k∈S} Δ_k
    d^t     = − Σ_k p_k Δ_k                     (pseudo-gradient, taken at w̃^t)
    w^{t+1} = w^t − η_s d^t − β σ               (SAM: the step taken at w̃ is applied at w^t)
    ε̃^{t+1} = ρ_s(t+1) d^t / ‖d^t‖               (stored for the next broadcast)

Mapping to the paper's Algorithm 1 (server SAM with the previous global
pseudo-gradient as the ascent direction, clients running local SAM or SGD,
ADMM dual variables σ, σ_k with penalty 1/β): the equations above are that
algorithm as the official code computes it; we checked them line by line
against the code only (its README shows the Algorithm as an image). Points
where the code is the authority: the server's dual update divides
Σ_{k∈S} Δ_k by β N |S| (FedDyn's analogue divides by β N), N being all
clients; the pseudo-gradient is the |D_k|-weighted mean while the dual
update is unweighted; d^t is the pseudo-gradient itself (not scaled by η_s).

Radius schedule (the code's `T_s`, `rho0`): with W = warmup_rounds ≥ 1,
ρ(t) = ρ0 + (ρ − ρ0) · min(t, W) / W for both ρ_s and ρ_l; W = 0: constant.
The code builds the server's list from the client's final radius (a slip,
`self.rhos_l[-1] + delta`); we apply the intended linear ramp to both.

Defaults: the official repository's commands for the paper's CIFAR-10
experiments (`paper_experiments/cnn_cifar10.sh`): ρ_s = 0.15, ρ_l = 0.15,
β = 10, η_s = 1 (server SGD, no momentum). Their warm-up (T_s = 2000 of
10 000 rounds) is off by default here (warmup_rounds = 0) because our runs
have tens of rounds; ρ0 = 0.001 is the code's default. The code's client
weight decay (4e-4) is not applied, like in every other method here; its
`eta` (ASAM) is unused by FedGloSS. SAM's ε uses ‖g‖ with a zero guard where
the code adds 1e-16 to ‖g‖ (a ~1e-16 relative difference).

Reductions: `admm=False` drops σ, σ_k and the proximal term. Then with
ρ_s = 0 a round is FedSAM's (η_s = 1), and with ρ_s = ρ_l = 0, η_s = 1 it is
FedAvg's. With ADMM on and ρ_s = 0 it is FedSAM plus the FedDyn-style
correction above. Personalized model of client k: its local model w_{k,T}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import (GradFn, Message, Method, Params, RoundContext, Scratch, State, StepContext, aligned_named, clone,
                   aligned, detached, in_order, mapped, zeros_like)
from .fedsam import joint_norm as _joint_norm
from .fedsam import sam_gradient


@dataclass
class FedGloSSArgs:
    rho: float = 0.15  # ρ_s, server-side SAM radius
    rho_local: float = 0.15  # ρ_l, client-side SAM radius (0: plain SGD on the clients)
    beta: float = 10.0  # ADMM penalty β (the proximal weight is 1/β)
    server_lr: float = 1.0  # η_s
    admm: bool = True  # False: no σ, σ_k, proximal term
    warmup_rounds: int = 0  # W: ρ_s, ρ_l ramp linearly from rho0 over W rounds (0: no ramp)
    rho0: float = 0.001  # ρ at round 0 when warmup_rounds > 0

    def __post_init__(self):
        for name in ("rho", "rho_local", "rho0"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0 (the updates divide by it), got {self.beta}")
        if self.server_lr <= 0:
            raise ValueError(f"server_lr must be > 0, got {self.server_lr}")
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")


class UpdateSum:
    """The running Σ_k weights[k] Δ_k, Δ_k = m_k["params"] − w̃^t, fed one message at a time in
    client order. Each term is multiplied, then added (not ``add_(alpha=)``, which rounds once):
    the order of operations this rule has always had, so its bits."""

    def __init__(self, start: Params, weights: list[float]):
        self.start, self.weights = start, weights
        self.total = zeros_like(start)

    def add(self, i: int, message: Message) -> None:
        for total, x, start in aligned(self.total, in_order(message["params"], self.total), self.start):
            total.add_(self.weights[i] * (x - start))  # (flat on CUDA)

    def result(self) -> Params:
        return self.total


def joint_norm(tensors: Params) -> float:
    """‖x‖ over all tensors together (accumulated in at least float32)."""
    return float(_joint_norm(tensors))


def fedgloss_direction(g: torch.Tensor, w: torch.Tensor, sigma_k: torch.Tensor, start: torch.Tensor,
                       beta: float) -> torch.Tensor:
    """d = g_e − σ_k + (w − w̃^t) / β: the client's descent direction (the official code's
    `FedGloSSOpt`: SAM's gradient g_e with the ADMM dual σ_k and the proximal pull 1/β towards
    the round's start w̃^t = w^t + ε̃^t; Caldarola et al., CVPR 2025)."""
    return g - sigma_k + (w - start) / beta


def fedgloss_dual_update_(sigma_k: torch.Tensor, w: torch.Tensor, start: torch.Tensor, beta: float) -> None:
    """σ_k ← σ_k − (w_{k,T} − w̃^t) / β, in place: the client's ADMM dual step at the round's end."""
    sigma_k.sub_((w - start) / beta)


class FedGloSS(Method):
    name = "fedgloss"
    label = "FedGloSS"
    family = "Optimizer-based"
    Args = FedGloSSArgs

    def radius(self, final: float, round_index: int) -> float:
        """ρ(t): the linear warm-up from rho0 to `final` over warmup_rounds rounds."""
        ramp = self.args.warmup_rounds
        if ramp == 0:
            return final
        return self.args.rho0 + (final - self.args.rho0) * min(round_index, ramp) / ramp

    # ---- client -------------------------------------------------------------
    def init_client_state(self, global_params: Params) -> State:
        return {"sigma": zeros_like(global_params)}

    def client_start(self, global_params: Params, state: State, received: Message, scratch: Scratch) -> Params:
        start = mapped(torch.add, global_params, in_order(received["perturbation"], global_params))  # w̃ = w + ε̃
        scratch["start"] = clone(start)
        return start

    @torch.no_grad()
    def local_step(self, params: Params, grad_fn: GradFn, state: State, ctx: StepContext) -> float:
        loss, grads = grad_fn()
        grads = sam_gradient(params, grads, grad_fn, self.radius(self.args.rho_local, ctx.round))  # g_e
        for n, (w, step, sigma, start) in aligned_named(params, grads, state["sigma"], ctx.scratch["start"]):
            if self.args.admm:  # (flat on CUDA)
                step = fedgloss_direction(step, w, sigma, start, self.args.beta)
            ctx.descend(n, w, step)
        return loss

    def client_end(self, global_params: Params, params: Params, state: State, scratch: Scratch) -> Message:
        if self.args.admm:
            for sigma, w, start in aligned(in_order(state["sigma"], params), detached(params),
                                           in_order(scratch["start"], params)):
                fedgloss_dual_update_(sigma, w, start, self.args.beta)  # (flat on CUDA)
        return {"params": clone(params)}

    # ---- server -------------------------------------------------------------
    def init_server_state(self, global_params: Params) -> State:
        return {"sigma": zeros_like(global_params), "perturbation": zeros_like(global_params)}

    def broadcast(self, global_params: Params, server_state: State) -> Message:
        return {"perturbation": server_state["perturbation"]}

    def aggregation_sums(self, global_params: Params, weights: list[float], server_state: State,
                         ctx: RoundContext) -> dict:
        start = mapped(torch.add, global_params, in_order(server_state["perturbation"], global_params))  # w̃^t
        sums = {"weighted": UpdateSum(start, weights)}  # Σ_k p_k Δ_k
        if self.args.admm:
            sums["unweighted"] = UpdateSum(start, [1.0] * len(weights))  # Σ_{k∈S} Δ_k
        return sums

    def finish_aggregation(self, global_params: Params, sums: dict[str, Params], weights: list[float],
                           server_state: State, ctx: RoundContext) -> Params:
        beta, sigma, perturbation = self.args.beta, server_state["sigma"], server_state["perturbation"]
        participants = len(weights)
        # each line one operation over flat buffers on CUDA (params.mapped / aligned), else one per tensor
        pseudo_grad = mapped(torch.neg, in_order(sums["weighted"], global_params))
        new = mapped(lambda w, d: w - self.args.server_lr * d, global_params, pseudo_grad)
        if self.args.admm:
            sigma = in_order(sigma, global_params)
            for s, total in aligned(sigma, in_order(sums["unweighted"], global_params)):
                s.sub_(total / (beta * ctx.num_clients * participants))
            new = mapped(lambda w, s: w - beta * s, new, sigma)
        # the next round's ascent: along the pseudo-gradient just computed
        rho, norm = self.radius(self.args.rho, ctx.round + 1), joint_norm(pseudo_grad)
        for e, d in aligned(in_order(perturbation, global_params), pseudo_grad):  # in place: ε stays one buffer
            if rho > 0 and norm > 0:
                torch.mul(d, rho / norm, out=e)
            else:
                e.zero_()
        return new

    def needs_each_upload(self) -> str | None:
        if self.args.admm:
            return ("with admm its server rule needs the unweighted sum of the uploads and the number of "
                    "participants besides the data-weighted sum; Flower's SecAgg+ and DP clipping give that one sum")
        return None
