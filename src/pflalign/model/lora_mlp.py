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
LoRA (no dropout, no DoRA, not merged, not disabled), the model's own or, in a
shared pass of several clients (multi_lora.py), each run of tokens its client's:
the base projections once over all tokens, each run's rank-r terms with its own
factors. Anything else — generation, the merged adapter of evaluation — runs the
module as it was.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class LoraSwiGLU(torch.autograd.Function):
    """out = down(silu(gate(x)) · up(x)), each projection W·x + s·B_j(A_j(x)) with the adapter j
    of x's token.

    ``apply(x, w_gate, w_up, w_down, scaling, recompute, runs, *factors)``: `factors` are each
    adapter's six LoRA factors, (a_gate, b_gate, a_up, b_up, a_down, b_down) of adapter 0, then of
    adapter 1, ...; `runs` says whose tokens are which, ((j, n), ...) over x's tokens in order
    (multi_lora.Routing's runs), or None: every token takes adapter 0. The base projections run
    once over all tokens; each run adds its own adapter's term.

    Tensors are handled as (tokens, features). The LoRA term is scaled on its rank-r side and
    accumulated into the base projection's output by the same GEMM (``addmm_``), so no
    d_out-wide pass is spent on ``· scaling`` or on the sum, forward or backward.
    """

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, scaling, recompute, runs, *factors):
        x2 = x.reshape(-1, x.shape[-1])
        spans = _spans(runs, x2.shape[0])
        g = x2 @ w_gate.T
        xa_gate = _add_lora(g, x2, spans, factors, 0, scaling)  # s·A x, (tokens, r)
        u = x2 @ w_up.T
        xa_up = _add_lora(u, x2, spans, factors, 2, scaling)
        h = F.silu(g).mul_(u)
        out = h @ w_down.T
        ha_down = _add_lora(out, h, spans, factors, 4, scaling)
        kept = (None, None) if recompute else (g, u)  # recompute: g and u again from x in backward
        ctx.save_for_backward(x2, *kept, xa_gate, xa_up, ha_down, w_gate, w_up, w_down, *factors)
        ctx.scaling, ctx.x_shape, ctx.spans = scaling, x.shape, spans
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, d_out):
        x2, g, u, xa_gate, xa_up, ha_down, w_gate, w_up, w_down, *factors = ctx.saved_tensors
        s, spans = ctx.scaling, ctx.spans
        need = ctx.needs_input_grad[7:]  # of each factor
        grads: list[torch.Tensor | None] = [None] * len(factors)

        def keep(i: int, grad: torch.Tensor) -> None:  # an adapter may own several runs
            grads[i] = grad if grads[i] is None else grads[i].add_(grad)

        if g is None:  # the forward's operations on the same inputs: the same values
            g = x2 @ w_gate.T
            _add_lora(g, x2, spans, factors, 0, s, xa_gate)
            u = x2 @ w_up.T
            _add_lora(u, x2, spans, factors, 2, s, xa_up)
        d_out = d_out.reshape(-1, d_out.shape[-1])

        # down: out = h W_dᵀ + (s·h A_dᵀ) B_dᵀ
        silu_g = F.silu(g)
        d_h = d_out @ w_down
        if _batched(spans):
            _lora_backward_batched(d_out, lambda: silu_g * u, ha_down, d_h, spans, factors, 4, s, need, keep)
        else:
            for j, lo, hi in spans:
                i = 6 * j + 4
                d_ha = (d_out[lo:hi] @ factors[i + 1]).mul_(s)  # d(h A_dᵀ)
                if need[i + 1]:
                    keep(i + 1, d_out[lo:hi].T @ ha_down[lo:hi])
                if need[i]:
                    keep(i, d_ha.T @ (silu_g[lo:hi] * u[lo:hi]))  # h, recomputed
                d_h[lo:hi].addmm_(d_ha, factors[i])
        del d_out

        # h = silu(g) · u
        d_u = d_h * silu_g
        del silu_g
        d_g = torch.ops.aten.silu_backward(d_h.mul_(u), g)
        del d_h

        # gate and up: y = x Wᵀ + (s·x Aᵀ) Bᵀ
        d_x = (d_g @ w_gate).addmm_(d_u, w_up)
        if _batched(spans):
            for d_y, xa, first in ((d_g, xa_gate, 0), (d_u, xa_up, 2)):
                _lora_backward_batched(d_y, lambda: x2, xa, d_x, spans, factors, first, s, need, keep)
        else:
            for j, lo, hi in spans:
                for d_y, xa, i in ((d_g, xa_gate, 6 * j), (d_u, xa_up, 6 * j + 2)):
                    d_xa = (d_y[lo:hi] @ factors[i + 1]).mul_(s)
                    if need[i + 1]:
                        keep(i + 1, d_y[lo:hi].T @ xa[lo:hi])
                    if need[i]:
                        keep(i, d_xa.T @ x2[lo:hi])
                    d_x[lo:hi].addmm_(d_xa, factors[i])
        d_x = d_x.view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return (d_x, None, None, None, None, None, None, *grads)


def _spans(runs, tokens: int) -> list[tuple[int, int, int]]:
    """(adapter j, first token, end) of each run; None: one run of adapter 0 over all tokens."""
    if runs is None:
        return [(0, 0, tokens)]
    spans, start = [], 0
    for j, n in runs:
        spans.append((j, start, start + n))
        start += n
    if start != tokens:
        raise ValueError(f"routing covers {start} tokens, the call has {tokens}")
    return spans


def _batched(spans) -> bool:
    """Runs of one size, each its own adapter (a GPU's padded pass of clients with equal batches):
    the runs' rank-r terms go in batched products over the stacked factors (torch.bmm), two
    launches a term where the loop over runs takes two a run."""
    owners = [j for j, _, _ in spans]
    return len(spans) > 1 and len({hi - lo for _, lo, hi in spans}) == 1 and len(set(owners)) == len(owners)


def _stacked(spans, factors, index: int) -> torch.Tensor:
    """Factor `index` (0-5, module docstring) of every run's adapter, stacked: (runs, ...)."""
    return torch.stack([factors[6 * j + index] for j, _, _ in spans])


def _by_run(t: torch.Tensor, spans) -> torch.Tensor:
    """(tokens, f) → (runs, tokens of a run, f): the runs are consecutive and of one size."""
    return t.view(len(spans), -1, t.shape[-1])


def _lora_backward_batched(d_y, v_of, va, d_v, spans, factors, first: int, s: float, need, keep) -> None:
    """The loop's backward of y = v Wᵀ + (s·v A_jᵀ) B_jᵀ for every run at once (`_batched` runs):
    B_j's gradient d_yᵀ (s·v A_jᵀ), A_j's (s·d_y B_j)ᵀ v where wanted (v_of() gives v), and
    d_v += (s·d_y B_j) A_j."""
    d_y3 = _by_run(d_y.contiguous(), spans)
    a, b = _stacked(spans, factors, first), _stacked(spans, factors, first + 1)
    d_va = torch.bmm(d_y3, b).mul_(s)  # d(v A_jᵀ) of each run
    idx = [(k, 6 * j + first) for k, (j, _, _) in enumerate(spans)]
    if any(need[i + 1] for _, i in idx):
        grad_b = torch.bmm(d_y3.transpose(1, 2), _by_run(va, spans))
        for k, i in idx:
            if need[i + 1]:
                keep(i + 1, grad_b[k])
    if any(need[i] for _, i in idx):
        grad_a = torch.bmm(d_va.transpose(1, 2), _by_run(v_of().contiguous(), spans))
        for k, i in idx:
            if need[i]:
                keep(i, grad_a[k])
    _by_run(d_v, spans).baddbmm_(d_va, a)


def _add_lora(y, v, spans, factors, first: int, scaling: float, kept: torch.Tensor | None = None) -> torch.Tensor:
    """y[run] += (s·v[run] A_jᵀ) B_jᵀ for each run of adapter j, A_j and B_j its factors
    `first` and `first + 1`; returns the rank-r s·v A_jᵀ of every token (or takes them `kept`)."""
    if _batched(spans):
        a, b = _stacked(spans, factors, first), _stacked(spans, factors, first + 1)
        va = torch.bmm(_by_run(v.contiguous(), spans), a.transpose(1, 2)).mul_(scaling) if kept is None \
            else _by_run(kept, spans)
        _by_run(y, spans).baddbmm_(va, b.transpose(1, 2))
        return kept if kept is not None else va.view(-1, va.shape[-1])
    parts = []
    for j, lo, hi in spans:
        a, b = factors[6 * j + first], factors[6 * j + first + 1]
        va = (v[lo:hi] @ a.T).mul_(scaling) if kept is None else kept[lo:hi]
        y[lo:hi].addmm_(va, b.T)
        parts.append(va)
    if kept is not None:
        return kept
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _plain_lora(layer) -> bool:
    """A PEFT LoRA linear whose forward is exactly W x + s B(A(x)) with the 'default' adapter
    (or, under a routing, with each run's own adapter in its place: multi_lora.py)."""
    from peft.tuners.lora import Linear as LoraLinear

    return (
        isinstance(layer, LoraLinear) and not layer.disable_adapters and not layer.merged
        and list(layer.active_adapters) == ["default"] and not layer.lora_variant
        and isinstance(layer.lora_dropout["default"], torch.nn.Identity)
        and layer.get_base_layer().bias is None
    )


def _factors(projections, x) -> tuple[tuple | None, list[torch.Tensor]] | None:
    """(runs, factors) for `LoraSwiGLU`: the layers' own adapter, or under a routing every routed
    adapter's factors and the routing's runs; None where the fused path does not apply (layers
    routed apart, an adapter in another dtype than x)."""
    from .multi_lora import routing_of

    routings = {id(routing_of(p)) for p in projections}
    routing = routing_of(projections[0])
    if len(routings) != 1:
        return None
    if routing is None:
        factors = [t for p in projections for t in (p.lora_A["default"].weight, p.lora_B["default"].weight)]
        return (None, factors) if factors[0].dtype == x.dtype else None
    names = [n for p in projections for n in p._pflalign_names]
    factors = [adapter[n] for adapter in routing.adapters for n in names]
    return (tuple(routing.runs), factors) if all(f.dtype == x.dtype for f in factors) else None


def _fused_forward(mlp, x):
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    # not under autocast (a bf16 base on CUDA), whose adapters' bf16 copies would now match x's
    # dtype: the function is tuned and timed for float32 runs, never measured there
    if (not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)
            or not all(_plain_lora(p) for p in projections)):
        return mlp._pflalign_unfused_forward(x)
    scalings = {p.scaling["default"] for p in projections}
    found = _factors(projections, x)
    if len(scalings) != 1 or found is None or len({x.dtype, *(p.get_base_layer().weight.dtype for p in projections)}) != 1:
        return mlp._pflalign_unfused_forward(x)
    runs, factors = found
    limit = mlp._pflalign_recompute_above
    recompute = limit is not None and x.numel() // x.shape[-1] > limit
    return LoraSwiGLU.apply(x, *(p.get_base_layer().weight for p in projections), scalings.pop(), recompute, runs,
                            *factors)


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
