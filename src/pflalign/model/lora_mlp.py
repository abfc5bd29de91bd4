"""Llama's gated MLP with LoRA on its three projections, as one autograd function
that keeps less for backward.

With PEFT, ``down(silu(gate(x)) * up(x))`` keeps four d_ff-wide tensors per
token for backward: the gate and up outputs g and u, silu(g), and the product
h (the input of the down projection's LoRA A). With SmolLM2 that is 60% of
the activations of a training step (40 KB per token and layer), and what
decides the peak memory of a long Dolly example. This function keeps x, g, u
and the rank-r LoRA intermediates, and recomputes silu(g) and h in backward
from g and u (two element-wise passes, no matmul): the same numbers, 29%
fewer activations.

It also spends fewer element-wise passes: the LoRA term is scaled on its
rank-r side and accumulated into the base projection's output by the GEMM
itself (``addmm_``). Outputs and gradients equal the unfused module's to
rounding (tested in float64; in float32 they differ in the last bits, as
s·(xA)Bᵀ and ((xA)Bᵀ)·s round differently). Gradients of frozen LoRA
factors (FFA-LoRA freezes A) are not computed.

For rows longer than a limit (on CPU: single examples over the 512-token
packing size) it keeps only x and recomputes g and u in backward too: two
more GEMMs on those tokens for 41% fewer activations, which is what keeps a
Dolly round's peak memory down.

`use_fused_lora_mlp` switches the MLPs of a PEFT Llama-family model. The fused
path runs only when gradients are wanted and the adapter is a plain active
LoRA (one adapter, no dropout, no DoRA, not merged, not disabled, not routed to
several clients' adapters: multi_lora.py); anything else — generation, the merged
adapter of evaluation — runs the module as it was.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class LoraSwiGLU(torch.autograd.Function):
    """out = down(silu(gate(x)) · up(x)), each projection W·x + s·B(A(x)).

    Tensors are handled as (tokens, features). The LoRA term is scaled on its
    rank-r side and accumulated into the base projection's output by the same
    GEMM (``addmm_``), so no d_out-wide pass is spent on ``· scaling`` or on the
    sum, forward or backward.
    """

    @staticmethod
    def forward(ctx, x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, scaling, recompute=False):
        x2 = x.reshape(-1, x.shape[-1])
        xa_gate = (x2 @ a_gate.T).mul_(scaling)  # s·A x, (tokens, r)
        xa_up = (x2 @ a_up.T).mul_(scaling)
        g = (x2 @ w_gate.T).addmm_(xa_gate, b_gate.T)
        u = (x2 @ w_up.T).addmm_(xa_up, b_up.T)
        h = F.silu(g).mul_(u)
        ha_down = (h @ a_down.T).mul_(scaling)
        out = (h @ w_down.T).addmm_(ha_down, b_down.T)
        kept = (None, None) if recompute else (g, u)  # recompute: g and u again from x in backward
        ctx.save_for_backward(x2, *kept, xa_gate, xa_up, ha_down, w_gate, a_gate, b_gate, w_up, a_up, b_up,
                              w_down, a_down, b_down)
        ctx.scaling, ctx.x_shape = scaling, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, d_out):
        (x2, g, u, xa_gate, xa_up, ha_down, w_gate, a_gate, b_gate, w_up, a_up, b_up,
         w_down, a_down, b_down) = ctx.saved_tensors
        s, need = ctx.scaling, ctx.needs_input_grad
        grads = [None] * 12
        if g is None:  # the forward's operations on the same inputs: the same values
            g = (x2 @ w_gate.T).addmm_(xa_gate, b_gate.T)
            u = (x2 @ w_up.T).addmm_(xa_up, b_up.T)
        d_out = d_out.reshape(-1, d_out.shape[-1])

        # down: out = h W_dᵀ + (s·h A_dᵀ) B_dᵀ
        d_ha = (d_out @ b_down).mul_(s)  # d(h A_dᵀ)
        if need[9]:
            grads[9] = d_out.T @ ha_down
        silu_g = F.silu(g)
        if need[8]:
            grads[8] = d_ha.T @ (silu_g * u)  # h, recomputed
        d_h = (d_out @ w_down).addmm_(d_ha, a_down)
        del d_out, d_ha

        # h = silu(g) · u
        d_u = d_h * silu_g
        del silu_g
        d_g = torch.ops.aten.silu_backward(d_h.mul_(u), g)
        del d_h

        # gate and up: y = x Wᵀ + (s·x Aᵀ) Bᵀ
        d_x = (d_g @ w_gate).addmm_(d_u, w_up)
        for d_y, xa, a, b, ia, ib in ((d_g, xa_gate, a_gate, b_gate, 2, 3), (d_u, xa_up, a_up, b_up, 5, 6)):
            d_xa = (d_y @ b).mul_(s)
            if need[ib]:
                grads[ib] = d_y.T @ xa
            if need[ia]:
                grads[ia] = d_xa.T @ x2
            d_x.addmm_(d_xa, a)
        grads[0] = d_x.view(ctx.x_shape) if need[0] else None
        return tuple(grads)


def _plain_lora(layer) -> bool:
    """A PEFT LoRA linear whose forward is exactly W x + s B(A(x)) with the 'default' adapter."""
    from peft.tuners.lora import Linear as LoraLinear

    from .multi_lora import is_routed

    return (
        isinstance(layer, LoraLinear) and not is_routed(layer) and not layer.disable_adapters and not layer.merged
        and list(layer.active_adapters) == ["default"] and not layer.lora_variant
        and isinstance(layer.lora_dropout["default"], torch.nn.Identity)
        and layer.get_base_layer().bias is None
    )


def _fused_forward(mlp, x):
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    if not torch.is_grad_enabled() or not all(_plain_lora(p) for p in (gate, up, down)):
        return mlp._pflalign_unfused_forward(x)
    scalings = {p.scaling["default"] for p in (gate, up, down)}
    if len(scalings) != 1 or len({x.dtype, gate.lora_A["default"].weight.dtype, gate.get_base_layer().weight.dtype}) != 1:
        return mlp._pflalign_unfused_forward(x)
    weights = []
    for p in (gate, up, down):
        weights += [p.get_base_layer().weight, p.lora_A["default"].weight, p.lora_B["default"].weight]
    limit = mlp._pflalign_recompute_above
    recompute = limit is not None and x.numel() // x.shape[-1] > limit
    return LoraSwiGLU.apply(x, *weights, scalings.pop(), recompute)


def use_fused_lora_mlp(model, recompute_above: int | None = None) -> int:
    """Route the SiLU-gated MLPs of `model` (PEFT LoRA on gate/up/down) through `LoraSwiGLU`
    while gradients are on; returns how many modules were switched (0 for other families).

    A call on more than `recompute_above` tokens keeps only x and recomputes g and u in
    backward (two more GEMMs on those tokens, 41% fewer activations than the fused
    function's usual 29%): for the long single examples that set the peak memory."""
    switched = 0
    for module in model.modules():
        if not all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            continue
        act = module.act_fn
        if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
            continue
        if hasattr(module, "_pflalign_unfused_forward"):
            continue
        module._pflalign_unfused_forward = module.forward
        module._pflalign_recompute_above = recompute_above
        module.forward = types.MethodType(_fused_forward, module)
        switched += 1
    return switched
