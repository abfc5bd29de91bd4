"""Evaluation's generation: batching and the merged adapter change speed, never the text."""

import pytest
import torch

from pflalign.data import Example
from pflalign.evaluate import generate
from pflalign.prompts import encode_prompt

PROMPTS = [Example(p, "") for p in ("Hi", "Sort these numbers: 5, 3, 9, 1", "Name a colour.",
                                     "Translate to French: the cat sits on the mat", "2+2=?", "Why?")]


@pytest.fixture
def trained_like(tiny_llama):
    """The tiny model with a nonzero adapter, restored afterwards."""
    saved = tiny_llama.get_lora()
    g = torch.Generator().manual_seed(1)
    tiny_llama.set_lora({n: t + 0.2 * torch.randn(t.shape, generator=g) for n, t in saved.items()})
    yield tiny_llama
    tiny_llama.set_lora(saved)


def _prompts(lm):
    prompts = [encode_prompt(lm.tokenizer, ex, 256)[0] for ex in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths: left padding is exercised
    return prompts


def test_batched_generation_equals_one_at_a_time(trained_like):
    lm = trained_like
    prompts = _prompts(lm)
    one = generate(lm.model, lm.tokenizer, prompts, 12, batch_size=1, progress=False)
    for batch_size in (3, 64):
        assert generate(lm.model, lm.tokenizer, prompts, 12, batch_size=batch_size, progress=False) == one
    assert any(one)  # not trivially all empty


def test_merged_adapter_gives_the_same_text_and_restores_the_backbone_exactly(trained_like):
    lm = trained_like
    prompts = _prompts(lm)
    backbone = {n: p.detach().clone() for n, p in lm.model.named_parameters() if "lora_" not in n}
    unmerged = generate(lm.model, lm.tokenizer, prompts, 12, batch_size=4, progress=False)
    with lm.merged():
        changed = [n for n in backbone if not torch.equal(lm.model.get_parameter(n), backbone[n])]
        merged = generate(lm.model, lm.tokenizer, prompts, 12, batch_size=4, progress=False)
    assert changed  # the adapter really was folded into the weights
    assert merged == unmerged
    assert all(torch.equal(lm.model.get_parameter(n), backbone[n]) for n in backbone)
    assert all(p.requires_grad for p in lm.lora.values())  # the adapter is live again
    with lm.model.disable_adapter():  # the base model is not the adapted one: the check above can fail
        assert generate(lm.model, lm.tokenizer, prompts, 12, batch_size=4, progress=False) != unmerged
