"""The two training kernels against their unfused definitions: the LM head fused with
cross-entropy (head_loss.py) and per-example attention for packed rows (attention.py)."""

import math
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pflalign.attention import segment_sdpa
from pflalign.head_loss import head_cross_entropy_sum


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
