"""Prompt formatting, loss masking, truncation and the minibatch stream."""

import pytest
import torch

from pflalign.data import Example
from pflalign.prompts import IGNORE, PLAIN_TEMPLATE, batch_indices, collate_train, encode_prompt, encode_train

EX = Example(prompt="Add 2 and 3.", response="5, of course")


def test_chat_template_prompt_tokens_carry_no_loss(tiny_llama):
    tok = tiny_llama.tokenizer
    enc = encode_train(tok, EX, max_len=512)
    prompt_ids, _ = encode_prompt(tok, EX, max_len=512)
    n = len(prompt_ids)
    assert enc.input_ids[:n] == prompt_ids  # training sequence = generation prompt + answer
    assert enc.labels[:n] == [IGNORE] * n
    assert enc.labels[n:] == enc.input_ids[n:]
    assert enc.labels[-1] == tok.eos_token_id
    assert tok.decode(enc.labels[n:-1]) == EX.response
    text = tok.decode(prompt_ids)
    assert text.startswith("<|user|>") and text.endswith("<|assistant|>")  # the chat template was used
    assert not enc.truncated


def test_plain_template_without_chat_template(tiny_opt):
    tok = tiny_opt.tokenizer
    prompt_ids, _ = encode_prompt(tok, EX, max_len=512)
    assert tok.decode(prompt_ids, skip_special_tokens=True) == PLAIN_TEMPLATE.format(prompt=EX.prompt)
    enc = encode_train(tok, EX, max_len=512)
    assert tok.decode([t for t in enc.labels if t != IGNORE], skip_special_tokens=True) == EX.response


def test_truncation_keeps_generation_prompt_and_half_for_response(tiny_llama):
    tok = tiny_llama.tokenizer
    long = Example(prompt="word " * 200, response="answer " * 100)
    enc = encode_train(tok, long, max_len=64)
    assert enc.truncated and len(enc.input_ids) == 64
    n_response = sum(t != IGNORE for t in enc.labels)
    assert n_response == 32  # response cut to max_len // 2
    prompt_ids, _ = encode_prompt(tok, long, max_len=10_000)
    assert enc.input_ids[:32] == prompt_ids[-32:]  # the prompt keeps its end ("<|assistant|>")
    short_prompt = Example(prompt="hi", response="answer " * 100)
    enc = encode_train(tok, short_prompt, max_len=64)
    assert len(enc.input_ids) == 64 and enc.input_ids[: len(encode_prompt(tok, short_prompt, 64)[0])] == encode_prompt(tok, short_prompt, 64)[0]


def test_collate_pads_right_and_masks(tiny_llama):
    tok = tiny_llama.tokenizer
    encs = [encode_train(tok, EX, 512), encode_train(tok, Example("a much longer prompt here", "b"), 512)]
    batch = collate_train(encs, tok.pad_token_id)
    width = max(len(e.input_ids) for e in encs)
    assert batch["input_ids"].shape == (2, width)
    for row, e in enumerate(encs):
        n = len(e.input_ids)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert batch["labels"][row, n:].eq(IGNORE).all()


@pytest.mark.parametrize("n,bs", [(10, 4), (7, 7), (5, 3)])
def test_batch_stream_is_seeded_permutations(n, bs):
    steps = 3 * n  # covers 3*bs epochs
    stream = [i for s in range(steps) for i in batch_indices(n, bs, s, seed=11)]
    for epoch in range(len(stream) // n):
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n))  # every epoch sees every example once
    assert batch_indices(n, bs, 5, seed=11) == batch_indices(n, bs, 5, seed=11)
    assert [batch_indices(n, bs, s, seed=12) for s in range(steps)] != [batch_indices(n, bs, s, seed=11) for s in range(steps)]
