"""Evaluation's generation: batching and the merged adapter change speed, never the text."""

import contextlib
import inspect
import warnings

import pytest
import torch

from pflalign.data import Example
from pflalign import evaluate
from pflalign.evaluate import _eos_ids, generate, greedy_ids
from pflalign.prompts import encode_prompt

PROMPTS = [Example(p, "") for p in ("Hi", "Sort these numbers: 5, 3, 9, 1", "Name a colour.",
                                     "Translate to French: the cat sits on the mat", "2+2=?", "Why?")]


@contextlib.contextmanager
def _nonzero_adapter(lm):
    """`lm` with a nonzero adapter, restored afterwards."""
    saved = lm.get_lora()
    g = torch.Generator().manual_seed(1)
    lm.set_lora({n: t + 0.2 * torch.randn(t.shape, generator=g) for n, t in saved.items()})
    try:
        yield lm
    finally:
        lm.set_lora(saved)


@pytest.fixture
def trained_like(tiny_llama):
    """The tiny Llama with a nonzero adapter, restored afterwards."""
    with _nonzero_adapter(tiny_llama) as lm:
        yield lm


@pytest.fixture(params=["tiny_llama", "tiny_opt"])
def trained_lm(request):
    """Each tiny model family (Llama, OPT) with a nonzero adapter, restored afterwards."""
    with _nonzero_adapter(request.getfixturevalue(request.param)) as lm:
        yield lm


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


# --- The explicit greedy loop (finished rows leave the batch) against `model.generate` ---------------


def _old_generate(model, tokenizer, prompts, max_new_tokens, batch_size):
    """The previous `generate`: the same grouping and padding, then `model.generate` runs every row to the end."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=_eos_ids(model, tokenizer))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        ids, mask = _left_pad([prompts[i] for i in chunk], tokenizer.pad_token_id)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        for row, i in enumerate(chunk):
            outputs[i] = tokenizer.decode(out[row, ids.shape[1] :], skip_special_tokens=True).strip()
    return outputs


def _left_pad(prompts, pad_id):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _generate_ids(lm, prompts, max_new_tokens):
    """`model.generate`'s greedy ids for one left-padded batch, each row cut after its first EOS."""
    from transformers import GenerationConfig

    eos = _eos_ids(lm.model, lm.tokenizer)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                           pad_token_id=lm.tokenizer.pad_token_id, eos_token_id=eos)
    ids, mask = _left_pad(prompts, lm.tokenizer.pad_token_id)
    rows = lm.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)[:, ids.shape[1] :].tolist()
    return [row[: next((k + 1 for k, t in enumerate(row) if t in eos), len(row))] for row in rows]


def _loop_ids(lm, prompts, max_new_tokens, batch_size=None, refill_at=0):
    """`greedy_ids` on `prompts`: one group of them all unless `batch_size` is given."""
    return greedy_ids(lm.model, prompts, lm.tokenizer.pad_token_id, _eos_ids(lm.model, lm.tokenizer), max_new_tokens,
                      batch_size or len(prompts), refill_at=refill_at)


def test_generation_passes_the_cache_under_the_name_this_transformers_release_takes(trained_lm):
    """transformers 5.24 renamed forward's past_key_values to cache; the old name warns there
    (and goes in 5.40). Generation must use whichever name the model's forward declares."""
    lm = trained_lm
    declared = inspect.signature(type(lm.model.get_base_model()).forward).parameters  # under PEFT's wrapper
    seen = []
    original = lm.model.forward
    lm.model.forward = lambda *a, **k: seen.append({"cache", "past_key_values"} & set(k)) or original(*a, **k)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _loop_ids(lm, _prompts(lm), 6)
    finally:
        lm.model.forward = original
    expected = "cache" if "cache" in declared else "past_key_values"
    assert {expected} in seen and all(names <= {expected} for names in seen)  # a prefill without a cache passes none
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def _in_batches(fn, lm, prompts, max_new_tokens, batch_size):
    return [a for s in range(0, len(prompts), batch_size) for a in fn(lm, prompts[s : s + batch_size], max_new_tokens)]


def test_loop_gives_model_generates_ids_and_text(trained_lm):
    lm = trained_lm
    prompts = _prompts(lm)
    for batch_size in (1, 3, 64):
        assert _in_batches(_loop_ids, lm, prompts, 12, batch_size) == _in_batches(_generate_ids, lm, prompts, 12, batch_size)
        assert (generate(lm.model, lm.tokenizer, prompts, 12, batch_size=batch_size, progress=False)
                == _old_generate(lm.model, lm.tokenizer, prompts, 12, batch_size))


def _stoppers(answers):
    """Tokens of `answers` that, made EOS tokens, end the answers after as many different lengths as they can."""
    def lengths(eos):
        return {next((k + 1 for k, t in enumerate(a) if t in eos), len(a)) for a in answers}

    chosen = []
    for token in sorted({t for a in answers for t in a}):
        if len(lengths(chosen + [token])) > len(lengths(chosen)):
            chosen.append(token)
    return chosen


def test_rows_that_end_at_different_steps_leave_the_batch_without_changing_the_others(trained_lm):
    lm = trained_lm
    prompts = _prompts(lm)
    config = lm.model.generation_config
    saved = config.eos_token_id
    one_at_a_time = _in_batches(_loop_ids, lm, prompts, 12, 1)
    config.eos_token_id = [lm.tokenizer.eos_token_id, *_stoppers(one_at_a_time)]
    try:
        one_at_a_time = _in_batches(_loop_ids, lm, prompts, 12, 1)
        lengths = [len(a) for a in one_at_a_time]
        assert len(set(lengths)) >= 3 and min(lengths) < 12  # rows really end at different steps
        assert _loop_ids(lm, prompts, 12) == one_at_a_time == _generate_ids(lm, prompts, 12)
        texts = _old_generate(lm.model, lm.tokenizer, prompts, 12, 64)
        for batch_size in (1, 3, 64):
            assert generate(lm.model, lm.tokenizer, prompts, 12, batch_size=batch_size, progress=False) == texts
    finally:
        config.eos_token_id = saved


class _CountedForward:
    """Counts the model's decode steps (forward calls with one input position after a KV cache)."""

    def __init__(self, model):
        self.model, self.original, self.decode_steps = model, model.forward, 0
        model.forward = self

    def __call__(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # the name depends on the transformers release
        self.decode_steps += kwargs["input_ids"].shape[1] == 1 and cache is not None
        return self.original(*args, **kwargs)

    def close(self):
        self.model.forward = self.original


def test_the_next_group_joins_the_rows_left_without_changing_any_answer(trained_lm):
    """Refilling: when half a group or less is still running, the next group is prefilled and
    decoded together with it (caches left-padded to one width). The answers stay those of one
    prompt at a time, and it takes fewer decode steps than finishing each group alone."""
    lm = trained_lm
    prompts = _prompts(lm)
    config = lm.model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = [lm.tokenizer.eos_token_id, *_stoppers(_in_batches(_loop_ids, lm, prompts, 12, 1))]
    try:
        one_at_a_time = _in_batches(_loop_ids, lm, prompts, 12, 1)
        assert len({len(a) for a in one_at_a_time}) >= 3  # rows end at different steps: groups shrink
        counter = _CountedForward(lm.model)
        try:
            steps = {}
            for refill_at in (0, 1, 2):
                before = counter.decode_steps
                assert _loop_ids(lm, prompts, 12, batch_size=2, refill_at=refill_at) == one_at_a_time
                steps[refill_at] = counter.decode_steps - before
        finally:
            counter.close()
        assert steps[0] == sum(max(len(a) for a in one_at_a_time[s:s + 2]) - 1 for s in range(0, len(prompts), 2))
        assert steps[2] < steps[0]  # the groups really were joined
        texts = _old_generate(lm.model, lm.tokenizer, prompts, 12, 2)
        assert generate(lm.model, lm.tokenizer, prompts, 12, batch_size=2, progress=False) == texts
    finally:
        config.eos_token_id = saved


def test_the_prompts_shared_start_is_computed_once_without_changing_any_answer(trained_lm):
    """Prompts that share their first tokens (a chat template's system prompt): those are
    prefilled once and every group continues from a copy of their KV cache. The answers stay
    `model.generate`'s, for groups of one, some and all prompts."""
    lm = trained_lm
    start = encode_prompt(lm.tokenizer, Example("You are a careful assistant who answers in few words.", ""), 256)[0]
    prompts = [start + p for p in _prompts(lm)]
    assert evaluate._shared_prefix(prompts) >= len(start) >= 8
    assert evaluate._shared_prefix([[1, 2, 3], [1, 2]]) == 1  # each prompt keeps a token of its own
    assert evaluate._shared_prefix([[1, 2, 3]]) == 0
    reference = [a for p in prompts for a in _generate_ids(lm, [p], 12)]
    prefills = []
    original = lm.model.forward
    lm.model.forward = lambda *a, **k: prefills.append(k["input_ids"].shape) or original(*a, **k)
    try:
        for batch_size in (1, 2, 64):
            prefills.clear()
            assert _loop_ids(lm, prompts, 12, batch_size=batch_size, refill_at=None) == reference
            shared = evaluate._shared_prefix(prompts)
            assert prefills[0] == (1, shared)  # the shared start, once
            assert all(shape[1] <= max(map(len, prompts)) - shared for shape in prefills[1:])
    finally:
        lm.model.forward = original


def test_rows_of_an_unpadded_group_keep_their_padding_masked_when_a_longer_group_joins(trained_lm):
    """A group of prompts of one length runs without a mask; when a longer group joins, its rows'
    caches are left-padded and that padding must be masked (it was not: the running rows' mask was
    made at the widened cache's width, all ones, and they attended to the zero keys; on SmolLM2 a
    row's logits then moved by up to 23 and "16" became "16.")."""
    lm = trained_lm
    prompts = _prompts(lm)
    short, long_ = min(prompts, key=len), max(prompts, key=len)
    # [short, short] is one group of one length (no mask); [long_] joins it right after its prefill
    joined = _loop_ids(lm, [short, short, long_], 12, batch_size=2, refill_at=2)
    assert joined == [a for p in (short, short, long_) for a in _loop_ids(lm, [p], 12)]


def test_kv_bytes_per_token_is_what_the_cache_holds(trained_lm):
    """`kv_bytes_per_token`'s first figure (what `eval.batch_size=auto` budgets a row's token at on
    CUDA) is the bytes the model's KV cache holds per row and token, Llama (grouped KV heads) and OPT."""
    lm = trained_lm
    inner = lm.model.get_base_model()
    rows, width = 3, 7
    out = lm.model(input_ids=torch.ones(rows, width, dtype=torch.long), use_cache=True)
    cache = evaluate._cache_of(out)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    per_token, prefill = evaluate.kv_bytes_per_token(inner.config, torch.float32)
    assert per_token == held / (rows * width) and prefill > 0
    assert evaluate.kv_bytes_per_token(inner.config, torch.bfloat16)[0] == per_token // 2


def test_eval_batch_size_auto_is_64_rows_off_cuda_and_a_number_is_taken_as_it_is(tiny_llama):
    from pflalign.settings.defaults import EVAL_ROWS_CPU

    assert evaluate.decode_plan(tiny_llama.model, "auto") == (64, None) == (EVAL_ROWS_CPU, None)
    assert evaluate.decode_plan(tiny_llama.model, 200) == (200, None)
    memory = evaluate.auto_memory(tiny_llama.model.get_base_model().config, torch.bfloat16, 8 * 2**30)
    assert memory.budget == 4 * 2**30 and memory.mask_per_entry == 2


def _memory(cache_per_token, budget, prefill_per_token=0, mask_per_entry=0):
    return evaluate.DecodeMemory(budget, cache_per_token, prefill_per_token, mask_per_entry)


def test_groups_take_batch_size_prompts_or_as_many_as_half_the_memory_holds():
    widths = [2, 3, 3, 5, 8, 8, 9, 30]
    assert evaluate._groups(widths, 3, 4, None) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # 1 byte a cached token: a group of n rows of width w holds n (w + 4); half of 40 bytes each
    memory = _memory(1, 40)
    groups = evaluate._groups(widths, 64, 4, memory)
    # [0, 1, 2] would hold 3 x (3 + 4) = 21 > 20; [2, 3] 2 x 9 = 18; [7] alone 34 > 20, a group of its own
    assert groups == [[0, 1], [2, 3], [4], [5], [6], [7]]
    for g in groups[:-1]:
        assert 2 * memory.group_bytes(len(g), max(widths[i] for i in g), 4) <= memory.budget
    # the prefill's transient bytes count too: 1 a token, and 1 per mask entry (a row's width²)
    assert evaluate._groups([2, 2, 2], 64, 0, _memory(0, 28, 1, 1)) == [[0, 1], [2]]  # n x 2 x (1 + 2): 12 <= 14 < 18


def test_a_memory_bound_changes_the_groups_never_an_answer_and_holds_the_cache_it_allows(trained_lm):
    """Under a `DecodeMemory` (eval.batch_size=auto on CUDA), the groups are as many prompts as fit
    in half the budget and a group joins the running rows only when the cache of both fits: the
    answers stay those of one prompt at a time, and no forward's cache exceeds the budget."""
    lm = trained_lm
    prompts = _prompts(lm)
    per_token, _ = evaluate.kv_bytes_per_token(lm.model.get_base_model().config, torch.float32)
    longest = max(map(len, prompts)) + 12
    memory = _memory(per_token, 5 * longest * per_token)  # about five rows' worth of cache
    one_at_a_time = _in_batches(_loop_ids, lm, prompts, 12, 1)
    held = []
    original = lm.model.forward

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        cache = evaluate._cache_of(out)
        held.append(sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)))
        return out

    lm.model.forward = counted
    try:
        got = greedy_ids(lm.model, prompts, lm.tokenizer.pad_token_id, _eos_ids(lm.model, lm.tokenizer), 12, 64,
                         memory=memory)
    finally:
        lm.model.forward = original
    assert got == one_at_a_time
    assert max(held) <= memory.budget and len(held) > 12  # bounded, and more than one group's steps
    assert len(evaluate._groups(list(map(len, prompts)), 64, 12, memory)) > 1  # the bound cut the groups
    texts = generate(lm.model, lm.tokenizer, prompts, 12, batch_size=1, progress=False)
    assert generate(lm.model, lm.tokenizer, prompts, 12, batch_size="auto", progress=False) == texts


def test_auto_on_cuda_takes_1024_rows_within_half_the_memory_free_or_cached_unused(tiny_llama, monkeypatch):
    """`decode_plan` on a CUDA model (stood in for here): AUTO_ROWS["cuda"] rows, bounded by half of
    the driver's free memory plus what torch's caching allocator holds unused (after training, most
    of what the device has free is there)."""
    import types

    inner = tiny_llama.model.get_base_model()
    cuda_param = types.SimpleNamespace(device=torch.device("cuda", 0))
    model = types.SimpleNamespace(parameters=lambda: iter([cuda_param]), get_base_model=lambda: inner)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 9 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 * 2**30)
    rows, memory = evaluate.decode_plan(model, "auto")
    assert rows == evaluate.AUTO_ROWS["cuda"] == 1024
    assert memory == evaluate.auto_memory(inner.config, torch.float32, 10 * 2**30)  # (3 + 9 - 2) GiB free
    assert memory.budget == 5 * 2**30
    assert evaluate.decode_plan(model, 32) == (32, None)
