"""Attention for packed training rows: each example attends only to itself.

On CPU, `FederatedLM.loss_and_grads` packs a batch's examples into rows
without padding. A 4-D block-diagonal mask would keep them apart, but the
kernel then computes the whole row's L×L scores and throws most away: four
FLAN examples of 90 tokens in one row cost 360² instead of 4·90² scores,
and attention was 15% of a FLAN step. Here a packed row carries the lengths
of its examples (`segment_lengths`, passed through the model's keyword
arguments down to the attention call) and SDPA runs causally on each
example's slice of the queries, keys and values: the same numbers, without
the masked-out work.

Every other call (no `segment_lengths`: padded batches, generation with a KV
cache) is plain transformers SDPA, unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "pflalign_segment_sdpa"


def segment_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 segment_lengths: list[int] | None = None, **kwargs):
    """SDPA per example of a packed row (query/key/value: batch 1, heads, tokens, head dim)."""
    if segment_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1 or query.shape[2] != key.shape[2] or sum(segment_lengths) != query.shape[2]:
        raise ValueError("segment_lengths needs one packed row of exactly that many tokens and no KV cache")
    outputs = [
        sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)[0]
        for q, k, v in zip(query.split(segment_lengths, 2), key.split(segment_lengths, 2),
                           value.split(segment_lengths, 2))
    ]
    return torch.cat(outputs, dim=1), None  # sdpa_attention_forward returns (batch, tokens, heads, head dim)


AttentionInterface.register(NAME, segment_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # padded batches and generation build SDPA's masks


def use_segment_attention(model) -> bool:
    """Switch a model that runs transformers' SDPA to the segment-aware version; False if it runs
    another attention (eager, flash...), which then gets the block-diagonal mask instead."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
