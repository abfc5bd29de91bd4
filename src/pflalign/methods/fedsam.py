"""FedSAM (Caldarola et al., ECCV 2022, "Improving Generalization in Federated
Learning by Seeking Flat Minima"; Qu et al., ICML 2022, "Generalized Federated
Learning via Sharpness Aware Minimization"): FedAvg whose clients take local
SAM steps (Foret et al., ICLR 2021).

Client, one local step at w (all trainable tensors together):

    g   = ∇f_k(w)                          (loss reported: f_k(w))
    ε   = ρ g / ‖g‖,   ‖g‖² = Σ_tensors Σ g²  (one joint norm, not per tensor)
    g_ε = ∇f_k(w + ε)                       (same minibatch)
    w   ← w − η g_ε

When ‖g‖ = 0 (or ρ = 0) then ε = 0 and the step is the plain SGD step on g,
without a second evaluation.
Server: w^{r+1} = Σ_k (|D_k| / Σ_j |D_j|) w_k (as FedAvg).

Paper vs. code: SAM's reference implementation divides by ‖g‖ + 1e-12; we
follow the papers' ε = ρ g / ‖g‖ with the explicit zero guard instead, so that
a step is exactly the stated formula (the two differ by ~1e-12 relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import params as params_module
from .base import GradFn, Params, State, StepContext, aligned, aligned_named, clone
from .fedavg import FedAvg


@dataclass
class FedSAMArgs:
    rho: float = 0.05  # neighbourhood radius ρ

    def __post_init__(self):
        if self.rho < 0:
            raise ValueError(f"rho must be >= 0, got {self.rho}")


def joint_norm(tensors: Params) -> torch.Tensor:
    """‖g‖ over all tensors together, accumulated in at least float32 (LoRA grads may be bf16): the
    norm of the per-tensor norms (on CUDA in one multi-tensor launch: `params.FLAT_DEVICES`; a flat
    buffer's one norm would round otherwise than these, and flat updates train bit for bit)."""
    values = list(tensors.values())
    if values and values[0].device.type in params_module.FLAT_DEVICES and len({t.dtype for t in values}) == 1:
        norms = torch._foreach_norm(values, 2, dtype=torch.promote_types(values[0].dtype, torch.float32))
    else:
        norms = [torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32)) for t in values]
    return torch.linalg.vector_norm(torch.stack(norms))


@torch.no_grad()
def sam_gradient(params: Params, grads: Params, grad_fn: GradFn, rho: float) -> Params:
    """SAM's gradient g_ε = ∇f(w + ε), ε = ρ g / ‖g‖ with one joint ‖g‖ over all tensors
    (Foret et al., ICLR 2021, eq. 2 and 3), on the same minibatch as g = `grads`.

    It moves the live `params` to w + ε, calls `grad_fn` there, and puts w back exactly (a copy,
    not w + ε − ε). With ρ = 0 or g = 0, ε = 0: returns `grads` without a second evaluation.
    """
    norm = float(joint_norm(grads))
    if not (rho > 0 and norm > 0):
        return grads
    scale = rho / norm
    start = clone(params)
    for w, g in aligned(params, grads):  # (flat on CUDA)
        w.add_(g, alpha=scale)  # climb to w + ε ...
    _, grads = grad_fn()  # ... take the gradient there ...
    for w, w0 in aligned(params, start):
        w.copy_(w0)  # ... and step from w itself
    return grads


class FedSAM(FedAvg):  # FedAvg with another client step: the server rule is inherited
    name = "fedsam"
    label = "FedSAM"
    family = "Optimizer-based"
    Args = FedSAMArgs

    @torch.no_grad()
    def local_step(self, params: Params, grad_fn: GradFn, state: State, ctx: StepContext) -> float:
        loss, grads = grad_fn()
        grads = sam_gradient(params, grads, grad_fn, self.args.rho)
        for n, (w, g) in aligned_named(params, grads):  # (flat on CUDA)
            ctx.descend(n, w, g)  # w ← w − η g_ε
        return loss
