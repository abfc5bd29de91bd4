"""The LM head and cross-entropy in one step, in chunks, for a frozen head.

The usual `cross_entropy(hidden @ Wᵀ, targets)` keeps the logits, their
log-softmax and then their gradient alive: three (tokens × vocabulary)
tensors, 3 × 177 MB for a 900-token Dolly response with SmolLM2's 49,152
words. The head's weight is frozen (LoRA never adapts it), so backward needs
only dL/dhidden = (softmax − onehot) @ W, and the forward pass can compute it
chunk by chunk while each chunk's logits are at hand. Only that gradient
(tokens × hidden) is kept for backward. The FLOPs are those of the unfused
loss: one logits product forward and one hidden-gradient product.
"""

from __future__ import annotations

import torch


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        accum = torch.promote_types(hidden.dtype, torch.float32)  # bf16 logits are upcast, as F.cross_entropy(x.float())
        total = torch.zeros((), dtype=accum, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (hidden[rows] @ weight.t()).to(accum)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[rows, None]).squeeze(1)
            total += (lse - picked).sum()
            if grad is not None:
                probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                probs[torch.arange(probs.shape[0], device=probs.device), targets[rows]] -= 1.0
                grad[rows] = (probs.to(weight.dtype) @ weight)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None


def head_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           chunk: int = 256) -> torch.Tensor:
    """Σ_i cross_entropy(hidden_i @ weightᵀ, targets_i) for hidden (tokens × d), weight (vocab × d),
    targets (tokens,); differentiable in `hidden` only (the head must be frozen)."""
    if weight.requires_grad:
        raise ValueError("head_cross_entropy_sum needs a frozen head weight")
    return _HeadCrossEntropy.apply(hidden, weight, targets, chunk)
