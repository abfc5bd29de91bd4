"""The training kernels against their unfused definitions: the LM head fused with
cross-entropy (model/head_loss.py), per-example attention for packed rows (model/attention.py),
the LoRA SwiGLU MLP that keeps fewer activations (model/lora_mlp.py) and RMSNorm with its
closed-form gradient (model/rms_norm.py)."""

import math
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pflalign.model.attention import segment_sdpa
from pflalign.model.head_loss import head_cross_entropy_sum
from pflalign.model.lora_mlp import LoraSwiGLU
from pflalign.model import FederatedLM, LoraSettings
from pflalign.prompts import IGNORE
from pflalign.model.rms_norm import LLAMA_NORMS, RMSNorm


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 40), vocab=st.integers(2, 300), chunk=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_fused_head_loss_and_gradient_equal_cross_entropy_of_logits(tokens, vocab, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, 16, generator=gen, dtype=torch.float64)
    hidden = torch.randn(tokens, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    ours = head_cross_entropy_sum(hidden, weight, targets, chunk)
    (g_ours,) = torch.autograd.grad(3.0 * ours, hidden) if tokens else (torch.zeros(0, 16),)
    reference = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    (g_ref,) = torch.autograd.grad(3.0 * reference, hidden) if tokens else (torch.zeros(0, 16),)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-12)


def test_fused_head_loss_hand_computed():
    """Two words, logits (0, ln 3): p = (1/4, 3/4); target 1 -> loss ln(4/3), dL/dlogits = (1/4, -1/4)."""
    weight = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    hidden = torch.tensor([[math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    loss = head_cross_entropy_sum(hidden, weight, torch.tensor([1]))
    loss.backward()
    assert loss.item() == pytest.approx(math.log(4 / 3), abs=1e-12)
    assert hidden.grad.item() == pytest.approx(0.25 * 0.0 + (-0.25) * 1.0, abs=1e-12)  # (p - onehot) @ W


def test_fused_head_loss_refuses_a_trainable_head():
    with pytest.raises(ValueError, match="frozen"):
        head_cross_entropy_sum(torch.randn(2, 4), torch.randn(5, 4, requires_grad=True), torch.tensor([0, 1]))


@pytest.mark.parametrize("kv_heads", [4, 2])  # plain multi-head and grouped-query attention
def test_segment_attention_equals_block_diagonal_masked_sdpa(kv_heads):
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    n, heads, dim = sum(lengths), 4, 8
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=heads // kv_heads, training=False)
    q = torch.randn(1, heads, n, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, n, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, n, dim, dtype=torch.float64, requires_grad=True)
    out, _ = segment_sdpa(module, q, k, v, None, scaling=0.3, segment_lengths=lengths)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))

    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=allowed, scale=0.3).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert out.shape == (1, n, heads, dim)
    torch.testing.assert_close(out, ref)
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs)


def test_segment_attention_rejects_lengths_that_do_not_cover_the_row():
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=1, training=False)
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="segment_lengths"):
        segment_sdpa(module, q, q, q, None, segment_lengths=[2, 2])


def _lora_mlp_reference(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, s):
    """PEFT's LoRA linear (W x + s B(A x)) three times, around LlamaMLP's silu(gate) * up."""
    def lora(v, w, a, b):
        return F.linear(v, w) + F.linear(F.linear(v, a), b) * s
    return lora(F.silu(lora(x, w_gate, a_gate, b_gate)) * lora(x, w_up, a_up, b_up), w_down, a_down, b_down)


def _fused(x, weights, scaling, recompute, runs=None, more=()):
    """LoraSwiGLU over `weights` in the reference's order (w, A, B of gate, up, down), adapter 0;
    `more`: further adapters' (A, B) × 3 in the same order, for `runs`."""
    factors = [weights[i] for i in (1, 2, 4, 5, 7, 8)] + [t for adapter in more for t in adapter]
    return LoraSwiGLU.apply(x, weights[0], weights[3], weights[6], scaling, recompute, runs, *factors)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 12), d=st.integers(1, 10), d_ff=st.integers(1, 14), r=st.integers(1, 4),
       scaling=st.floats(0.1, 4.0), frozen_a=st.booleans(), recompute=st.booleans(), seed=st.integers(0, 2**16))
def test_lora_swiglu_equals_the_unfused_mlp(tokens, d, d_ff, r, scaling, frozen_a, recompute, seed):
    """Output and every gradient (input, A and B of the three projections) equal autograd
    through the unfused composition, in float64; a frozen A (FFA-LoRA) gets no gradient."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    x = rand(2, tokens, d).requires_grad_()
    weights = []
    for d_in, d_out in ((d, d_ff), (d, d_ff), (d_ff, d)):
        weights += [rand(d_out, d_in), rand(r, d_in).requires_grad_(not frozen_a), rand(d_out, r).requires_grad_()]
    trainable = [x] + [w for w in weights if w.requires_grad]
    upstream = rand(2, tokens, d)
    ours = _fused(x, weights, scaling, recompute)
    reference = _lora_mlp_reference(x, *weights, scaling)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    for g_ours, g_ref in zip(torch.autograd.grad(ours, trainable, upstream),
                             torch.autograd.grad(reference, trainable, upstream)):
        torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-12)
    if frozen_a:
        ours = _fused(x, weights, scaling, recompute)
        ours.backward(upstream)
        assert all(weights[i].grad is None for i in (1, 4, 7))


@settings(max_examples=25, deadline=None)
@given(owners=st.lists(st.integers(0, 2), min_size=1, max_size=6), d=st.integers(1, 8), d_ff=st.integers(1, 10),
       r=st.integers(1, 3), frozen_a=st.booleans(), recompute=st.booleans(), seed=st.integers(0, 2**16))
def test_lora_swiglu_routed_gives_each_run_its_own_adapter(owners, d, d_ff, r, frozen_a, recompute, seed):
    """Runs of tokens with adapters 0..2 (an adapter may own several runs, one none): output and
    gradients equal, run by run, the unfused MLP at that run's adapter, in float64; an adapter
    that owns no token gets a zero gradient (or none), never another's."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 5, (len(owners),), generator=gen).tolist()
    _check_routed_swiglu(owners, sizes, d, d_ff, r, frozen_a, recompute, gen)


@pytest.mark.parametrize("frozen_a", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_lora_swiglu_takes_equal_runs_of_distinct_adapters_in_batched_products(frozen_a, recompute, monkeypatch):
    """A GPU's padded pass of clients with equal batches: runs of one size, each its own adapter.
    Their rank-r terms go through torch.bmm over the stacked factors (forward and backward), with
    the same output and gradients as the unfused MLP run by run, in float64."""
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(a[0].shape[0]) or real_bmm(*a, **k))
    _check_routed_swiglu([2, 0, 1], [4, 4, 4], 5, 7, 3, frozen_a, recompute, torch.Generator().manual_seed(3))
    assert calls and set(calls) == {3}


def _check_routed_swiglu(owners, sizes, d, d_ff, r, frozen_a, recompute, gen):
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    x = rand(sum(sizes), d).requires_grad_()
    bases = [rand(d_ff, d), rand(d_ff, d), rand(d, d_ff)]
    adapters = []  # per adapter: (A, B) of gate, up, down
    for _ in range(3):
        adapters.append([t for d_in, d_out in ((d, d_ff), (d, d_ff), (d_ff, d))
                         for t in (rand(r, d_in).requires_grad_(not frozen_a), rand(d_out, r).requires_grad_())])
    upstream = rand(sum(sizes), d)
    ours = LoraSwiGLU.apply(x, *bases, 1.5, recompute, tuple(zip(owners, sizes)), *[t for a in adapters for t in a])
    pieces = [_lora_mlp_reference(piece, bases[0], *adapters[j][0:2], bases[1], *adapters[j][2:4], bases[2],
                                  *adapters[j][4:6], 1.5) for j, piece in zip(owners, x.split(sizes))]
    reference = torch.cat(pieces)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    trainable = [x] + [t for a in adapters for t in a if t.requires_grad]
    for g_ours, g_ref in zip(torch.autograd.grad(ours, trainable, upstream, allow_unused=True),
                             torch.autograd.grad(reference, trainable, upstream, allow_unused=True)):
        if g_ref is None:  # an adapter that owns no token
            assert g_ours is None or not g_ours.any()
        else:
            torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-12)


def _unfused(lm, monkeypatch):
    for module in lm.model.modules():
        if hasattr(module, "_pflalign_unfused_forward"):
            monkeypatch.setattr(module, "forward", module._pflalign_unfused_forward)


def _packed_row(lm):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, len(lm.tokenizer), (1, 24), generator=gen)
    labels = ids.clone()
    labels[:, :6] = IGNORE
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _count_forward_calls(monkeypatch, function) -> list:
    """A list that grows by one at every forward of the autograd `function`."""
    calls, forward = [], function.forward
    monkeypatch.setattr(function, "forward", staticmethod(lambda ctx, *args: calls.append(1) or forward(ctx, *args)))
    return calls


def _step_and_kept_bytes(lm, batch):
    """(loss, a copy of the LoRA gradients, bytes of the tensors autograd kept for backward,
    parameters not counted) of one training step on `batch`."""
    saved = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss, grads = lm.loss_and_grads(batch)
    params = {p.untyped_storage().data_ptr() for p in lm.model.parameters()}
    return loss, {n: g.clone() for n, g in grads.items()}, sum(v for k, v in saved.items() if k not in params)


def test_fused_mlp_model_step_equals_peft_step_and_keeps_two_or_four_d_ff_tensors_fewer(monkeypatch):
    """On the tiny Llama: the same loss and LoRA gradients as PEFT's modules (float64), and
    per layer and token exactly silu(g) and h fewer activations kept for backward, or
    also g and u on a row over the recompute limit."""
    fused = FederatedLM.build("tiny-llama", LoraSettings(r=4, alpha=8), seed=0)
    assert fused.fused_mlps == fused.model.config.num_hidden_layers
    fused.model.double()
    with torch.no_grad():
        for p in fused.lora.values():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))  # B != 0: every gradient nonzero
    batch = _packed_row(fused)

    mlps = [m for m in fused.model.modules() if hasattr(m, "_pflalign_recompute_above")]
    assert {m._pflalign_recompute_above for m in mlps} == {512}  # CPU: rows over the packing size recompute
    loss_f, grads_f, kept_f = _step_and_kept_bytes(fused, batch)
    for m in mlps:
        monkeypatch.setattr(m, "_pflalign_recompute_above", 23)  # the 24-token row now recomputes g and u
    loss_r, grads_r, kept_r = _step_and_kept_bytes(fused, batch)
    _unfused(fused, monkeypatch)
    loss_u, grads_u, kept_u = _step_and_kept_bytes(fused, batch)
    assert loss_f == pytest.approx(loss_u, rel=1e-14) and loss_r == pytest.approx(loss_u, rel=1e-14)
    assert grads_f.keys() == grads_u.keys() == grads_r.keys()
    for n in grads_u:
        assert grads_u[n].abs().max() > 0
        torch.testing.assert_close(grads_f[n], grads_u[n], rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(grads_r[n], grads_u[n], rtol=1e-10, atol=1e-14)
    cfg = fused.model.config
    d_ff_bytes = cfg.num_hidden_layers * 24 * cfg.intermediate_size * 8  # one d_ff-wide float64 tensor per layer
    assert kept_u - kept_f == 2 * d_ff_bytes  # silu(g) and h
    assert kept_u - kept_r == 4 * d_ff_bytes  # and g and u


def test_fused_mlp_forward_equals_peft_in_float32_and_is_off_without_gradients(tiny_llama, monkeypatch):
    """The fused forward equals PEFT's modules to float32 rounding; with gradients off
    (generation, evaluation) the modules run unfused."""
    batch = _packed_row(tiny_llama)
    calls = _count_forward_calls(monkeypatch, LoraSwiGLU)
    with torch.no_grad():
        tiny_llama.model(input_ids=batch["input_ids"])
    assert not calls
    fused = tiny_llama.model(input_ids=batch["input_ids"]).logits
    assert calls
    monkeypatch.undo()
    _unfused(tiny_llama, monkeypatch)
    torch.testing.assert_close(fused, tiny_llama.model(input_ids=batch["input_ids"]).logits, rtol=1e-6, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 12), d=st.integers(1, 16), eps=st.sampled_from([0.0, 1e-6, 1e-5, 0.5]),
       seed=st.integers(0, 2**16))
def test_rms_norm_equals_autograd_through_its_definition(tokens, d, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, d, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(d, generator=gen, dtype=torch.float64) + 0.5
    upstream = torch.randn(2, tokens, d, generator=gen, dtype=torch.float64)
    ours = RMSNorm.apply(x, weight, eps)
    reference = weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    (g_ours,) = torch.autograd.grad(ours, x, upstream)
    (g_ref,) = torch.autograd.grad(reference, x, upstream)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-12)


def test_rms_norm_gradient_hand_computed():
    """x = (3, 4), w = 1, eps = 0: r = 1/sqrt(12.5); for dL/dy = (1, 0), dL/dx = r·((1, 0) − x·r²·3/2)
    = r·(0.64, −0.48)."""
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    y = RMSNorm.apply(x, torch.ones(2, dtype=torch.float64), 0.0)
    y.backward(torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    r = 1 / math.sqrt(12.5)
    assert y.tolist()[0] == pytest.approx([3 * r, 4 * r], abs=1e-15)
    assert x.grad.tolist()[0] == pytest.approx([0.64 * r, -0.48 * r], abs=1e-15)


def test_fused_rms_norm_model_step_has_the_same_loss_gradients_and_kept_tensors(monkeypatch):
    """On the tiny Llama in float32: the loss bit for bit (same operations forward), LoRA
    gradients to float32 rounding, the same bytes kept for backward (x and r, as
    autograd keeps through HF's module), and HF's module with gradients off."""
    lm = FederatedLM.build("tiny-llama", LoraSettings(r=4, alpha=8), seed=0)
    cfg = lm.model.config
    assert lm.fused_norms == 2 * cfg.num_hidden_layers + 1
    with torch.no_grad():
        for p in lm.lora.values():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    batch = _packed_row(lm)

    calls = _count_forward_calls(monkeypatch, RMSNorm)
    with torch.no_grad():
        lm.model(input_ids=batch["input_ids"])
    assert not calls
    loss_f, grads_f, kept_f = _step_and_kept_bytes(lm, batch)
    assert len(calls) == lm.fused_norms
    for module in lm.model.modules():
        if type(module).__name__ in LLAMA_NORMS:
            monkeypatch.setattr(module, "forward", module._pflalign_unfused_forward)
    loss_u, grads_u, kept_u = _step_and_kept_bytes(lm, batch)
    assert loss_f == loss_u
    for n in grads_u:
        assert grads_u[n].abs().max() > 0
        torch.testing.assert_close(grads_f[n], grads_u[n], rtol=1e-5, atol=1e-7)
    assert kept_f == kept_u
