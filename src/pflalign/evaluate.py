"""Scoring: batched greedy generation with a KV cache (the prompts' shared start computed once,
finished rows leaving the batch, the next prompts joining it when few are left), and ROUGE-L.

ROUGE-L is the F-measure of `rouge-score`'s ``rougeL`` with Porter stemming,
×100, averaged over a client's test examples — the paper's metric.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .settings.defaults import EVAL_ROWS_CPU

_SCORER = None


def rouge_l(predictions: list[str], references: list[str]) -> float:
    """Mean ROUGE-L F-measure ×100 (0 for an empty list)."""
    global _SCORER
    if _SCORER is None:
        from rouge_score import rouge_scorer  # imports nltk and scipy: only when scoring

        _SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    if not predictions:
        return 0.0
    scores = [_SCORER.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references)]
    return 100.0 * sum(scores) / len(scores)


def _eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends an answer: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return sorted(i for i in ids if i is not None)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` widened to `width` along `dim` by zeros in front."""
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class _Rows:
    """The rows being decoded: which prompt each is, their KV cache, last token and its
    position, and the padding mask (None: no padding, as `generate` passes it)."""

    def __init__(self, prompts: list[int], cache, tokens: torch.Tensor, positions: torch.Tensor, mask):
        self.prompts, self.cache, self.tokens, self.positions, self.mask = prompts, cache, tokens, positions, mask

    def width(self) -> int:
        return self.cache.get_seq_length()

    def keep(self, kept: list[int]) -> None:
        """Drop every row not in `kept` (batch positions): its cache, mask and position."""
        index = torch.tensor(kept, device=self.tokens.device)
        self.cache.batch_select_indices(index)
        self.tokens, self.positions = self.tokens[index], self.positions[index]
        self.mask = None if self.mask is None else self.mask[index]
        self.prompts = [self.prompts[k] for k in kept]

    def join(self, other: "_Rows") -> None:
        """Append `other`'s rows, both caches left-padded to the longer one (masked)."""
        width = max(self.width(), other.width())
        # each side's mask at its own width, before the caches widen (an unpadded group's mask is None:
        # all ones over its cache; made after, it would cover the left padding too)
        masks = [rows.mask if rows.mask is not None else rows.tokens.new_ones(len(rows.prompts), rows.width())
                 for rows in (self, other)]
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
            mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])
        self.mask = torch.cat([_left_pad(m, width, 1) for m in masks])
        self.tokens = torch.cat([self.tokens, other.tokens])
        self.positions = torch.cat([self.positions, other.positions])
        self.prompts = self.prompts + other.prompts


def _cache_arg(model) -> str:
    """The name of forward's KV-cache argument: transformers 5.24 renamed past_key_values to cache
    (the old name warns there, and is removed in 5.40); earlier 5.x know only past_key_values."""
    # the transformers model's class (PEFT wraps it and passes keywords on; an instance's forward may
    # be wrapped too: hooks, tests counting calls)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(inner).forward).parameters else "past_key_values"


def _cache_of(out):
    """The KV cache a forward returned, under either release's name (see `_cache_arg`)."""
    return out.cache if "cache" in out else out.past_key_values


def _shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares, leaving each at least one of its own (0 for
    fewer than two prompts)."""
    if len(prompts) < 2:
        return 0
    n, first = 0, prompts[0]
    limit = min(map(len, prompts)) - 1
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


@dataclass(frozen=True)
class DecodeMemory:
    """What one decoding loop may hold on its device beside the model (`eval.batch_size=auto` on
    CUDA, `decode_plan`): `budget` bytes for the rows' KV cache and a prefill's transient tensors,
    at `cache_per_token` bytes per cached token of a row (`kv_bytes_per_token`) and
    `prefill_per_token` per token of a prefill, whose padded attention mask adds `mask_per_entry`
    bytes per (row, query, key)."""

    budget: int
    cache_per_token: int
    prefill_per_token: int
    mask_per_entry: int

    def cache_bytes(self, rows: int, width: int, max_new_tokens: int) -> int:
        """The KV cache of `rows` rows of `width` tokens once each has generated `max_new_tokens`."""
        return rows * (width + max_new_tokens) * self.cache_per_token

    def group_bytes(self, rows: int, width: int, max_new_tokens: int) -> int:
        """A group of `rows` prompts padded to `width` tokens: its cache to the end and its prefill."""
        prefill = rows * width * (self.prefill_per_token + width * self.mask_per_entry)
        return self.cache_bytes(rows, width, max_new_tokens) + prefill


# eval.batch_size=auto: the rows one decoding loop holds. On this 2-core CPU 64 (a step of 64 rows
# costs about twice a step of one: measured, EvalConfig's default). On CUDA a step is bound by its
# kernel launches: LLaMA-3.2-1B's 128 greedy tokens took 6.4 s for 64 rows and 5.9-6.3 s for 128,
# 200 and 256 on an H200 (benchmarks/results/gpu_eval_batch.json), so up to 1024 rows (not timed
# beyond 256; benchmarks/gpu.py's scoring section measures it), within half the device's free memory.
AUTO_ROWS = {"cpu": EVAL_ROWS_CPU, "cuda": 1024}
AUTO_MEMORY_SHARE = 0.5


def kv_bytes_per_token(config, dtype: torch.dtype) -> tuple[int, int]:
    """(KV-cache bytes per token of a row, transient bytes per prefilled token) of a decoder with
    transformers' `config` whose activations are `dtype`: keys and values of every layer; one
    layer's hidden states and MLP intermediates (no_grad frees each layer's before the next)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    intermediate = (getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
                    or 4 * config.hidden_size)
    size = dtype.itemsize
    return (2 * config.num_hidden_layers * kv_heads * head_dim * size,
            (6 * config.hidden_size + 4 * intermediate) * size)


def decode_plan(model, batch_size: int | str) -> tuple[int, DecodeMemory | None]:
    """The rows of a decoding loop and the bound on its memory for `eval.batch_size`: a number as
    it is (no bound); "auto" `AUTO_ROWS` of the model's device (64 elsewhere than CUDA), on CUDA
    bounded by `AUTO_MEMORY_SHARE` of the free memory (`DecodeMemory`)."""
    if batch_size != "auto":
        return int(batch_size), None
    param = next(model.parameters())
    if param.device.type != "cuda":
        return AUTO_ROWS["cpu"], None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    # free: the driver's, and what torch's caching allocator holds unused (training's activations)
    free = (torch.cuda.mem_get_info(param.device)[0] + torch.cuda.memory_reserved(param.device)
            - torch.cuda.memory_allocated(param.device))
    # the activations' dtype is the base's (its embeddings'), whatever the adapters' is
    return AUTO_ROWS["cuda"], auto_memory(inner.config, inner.get_input_embeddings().weight.dtype, free)


def auto_memory(config, dtype: torch.dtype, free_bytes: int) -> DecodeMemory:
    """The `DecodeMemory` of a decoder (transformers' `config`, activations in `dtype`) on a device
    with `free_bytes` free: `AUTO_MEMORY_SHARE` of them."""
    cache, prefill = kv_bytes_per_token(config, dtype)
    return DecodeMemory(int(free_bytes * AUTO_MEMORY_SHARE), cache, prefill, dtype.itemsize)


def _groups(widths: list[int], batch_size: int, max_new_tokens: int, memory: DecodeMemory | None) -> list[list[int]]:
    """The prompts (indices, in order; `widths`: their lengths, the shared start included) cut into
    the groups prefilled together: `batch_size` each, and under `memory` no more than fit in half
    its budget (`DecodeMemory.group_bytes`; the other half for the rows still running when the group
    joins them), a prompt that alone exceeds it in a group of its own."""
    groups: list[list[int]] = []
    width = 0
    for i, w in enumerate(widths):
        wider = max(width, w)
        if (groups and len(groups[-1]) < batch_size
                and (memory is None or 2 * memory.group_bytes(len(groups[-1]) + 1, wider, max_new_tokens) <= memory.budget)):
            groups[-1].append(i)
            width = wider
        else:
            groups.append([i])
            width = w
    return groups


@dataclass
class RowAdapters:
    """Each prompt's own adapter, in decoding loops whose batches mix adapters (no merging): prompt
    i takes adapter `of[i]` (an index into the caller's stack of adapters), and `route(owners, n)`
    is the context inside which one forward of rows of n tokens each computes row r with adapter
    `owners[r]` (model/multi_lora.py's `row_router`)."""

    of: list[int]
    route: Callable[[list[int], int], AbstractContextManager]


@torch.no_grad()
def greedy_ids(model, prompts: list[list[int]], pad_id: int, eos: list[int], max_new_tokens: int,
               batch_size: int, refill_at: int | None = None, on_done=lambda n: None,
               per_row: RowAdapters | None = None, memory: DecodeMemory | None = None) -> list[list[int]]:
    """The token ids `model.generate` picks greedily for each prompt, EOS included.

    Prompts are prefilled `batch_size` at a time, in the given order, left-padded. Unlike
    `model.generate`, a row leaves the batch as soon as it ends (an EOS token or
    `max_new_tokens`): its cache, mask and position are dropped, so the other rows' decode
    steps stop paying for it. And when no more than `refill_at` rows are left (default
    half a batch; 0: never) the next group of prompts is prefilled and joins them, so the
    few long answers of a group no longer take a decode step each on their own: a step
    costs about as much for one row as for dozens (it reads every weight once).
    The tokens all prompts start with (`_shared_prefix`: a chat template's system prompt,
    24 of FLAN's 69-88 with SmolLM2) are prefilled once; each group continues from a copy
    of their KV cache, its own tokens left-padded after them (padding masked).
    `on_done(n)` is told of every n prompts finished (progress bars).
    `per_row`: each prompt decoded with its own adapter (`RowAdapters`), rows of different
    adapters in one forward; the shared start is then prefilled once per adapter (its keys and
    values depend on the adapter) and each row continues from its adapter's copy. None: the
    model as it is, for every prompt.
    `memory`: a bound on what the loop holds (`DecodeMemory`): groups of at most half its budget,
    and a group joins the running rows only when their cache and its prefill fit in it together
    (else the running rows decode on until they do). None: `batch_size` rows, whatever they hold.
    """
    refill_at = batch_size // 2 if refill_at is None else refill_at
    owner = (lambda i: 0) if per_row is None else per_row.of.__getitem__

    def forward(owners: list[int], **inputs):
        """The model on `inputs`, row r with adapter owners[r] under `per_row` (else as it is)."""
        route = contextlib.nullcontext() if per_row is None else per_row.route(owners, inputs["input_ids"].shape[1])
        with route:
            return model(**inputs)

    stop = set(eos)
    groups = _groups(list(map(len, prompts)), batch_size, max_new_tokens, memory)
    answers: list[list[int]] = [[] for _ in prompts]
    device = next(model.parameters()).device
    cache_arg = _cache_arg(model)

    def took(rows: _Rows) -> _Rows | None:
        """Each row's new token into its answer; the rows that ended leave (None: none left)."""
        kept = []
        for k, (i, token) in enumerate(zip(rows.prompts, rows.tokens.tolist())):
            answers[i].append(token)
            if token not in stop and len(answers[i]) < max_new_tokens:
                kept.append(k)
        if len(kept) < len(rows.prompts):
            on_done(len(rows.prompts) - len(kept))
            if not kept:
                return None
            rows.keep(kept)
        return rows

    prefix = _shared_prefix(prompts)
    prefix_cache, prefix_row = None, {}
    if prefix:  # the tokens every prompt starts with (a chat template's system prompt): computed once (per adapter)
        prefix_row = {j: r for r, j in enumerate(sorted({owner(i) for i in range(len(prompts))}))}
        prefix_cache = _cache_of(forward(list(prefix_row), use_cache=True, logits_to_keep=1,
                                         input_ids=torch.tensor([prompts[0][:prefix]] * len(prefix_row), device=device)))
    def joins(group: list[int]) -> bool:
        """Whether `group` is prefilled now: no rows running, or few enough (`refill_at`) that
        their cache fits beside the group's (under `memory`) to the end of their answers."""
        if running is None:
            return True
        if len(running.prompts) > refill_at:
            return False
        if memory is None:
            return True
        width = max(running.width(), max(len(prompts[i]) for i in group))
        return (memory.cache_bytes(len(running.prompts), width, max_new_tokens)
                + memory.group_bytes(len(group), width, max_new_tokens)) <= memory.budget

    running: _Rows | None = None
    while groups or running is not None:
        while groups and joins(groups[0]):
            group = groups.pop(0)
            tails = [prompts[i][prefix:] for i in group]
            width = max(map(len, tails))
            ids = torch.full((len(group), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, tail in enumerate(tails):
                ids[row, width - len(tail) :] = torch.tensor(tail)
                mask[row, width - len(tail) :] = 1
            ids, mask = ids.to(device), mask.to(device)
            # positions as generate derives them: count of real tokens so far, 0 on pads
            positions = (prefix + mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            cache = None
            if prefix:  # each row from its adapter's copy of the shared start
                cache = copy.deepcopy(prefix_cache)
                cache.batch_select_indices(torch.tensor([prefix_row[owner(i)] for i in group], device=device))
            # generate drops an all-ones mask (attention then takes its unpadded, causal path): so do we
            mask = None if bool(mask.all()) else torch.cat([mask.new_ones(len(group), prefix), mask], dim=-1)
            out = forward([owner(i) for i in group], input_ids=ids, attention_mask=mask, position_ids=positions,
                          **{cache_arg: cache}, use_cache=True, logits_to_keep=1)  # logits of the last position only
            fresh = took(_Rows(group, _cache_of(out), out.logits[:, -1].argmax(-1), positions[:, -1:], mask))
            if fresh is not None and running is not None:
                running.join(fresh)
            elif fresh is not None:
                running = fresh
        if running is None:
            continue
        rows = running
        rows.positions = rows.positions + 1
        if rows.mask is not None:
            rows.mask = torch.cat([rows.mask, rows.mask.new_ones(len(rows.prompts), 1)], dim=-1)
        out = forward([owner(i) for i in rows.prompts], input_ids=rows.tokens[:, None], attention_mask=rows.mask,
                      position_ids=rows.positions, **{cache_arg: rows.cache}, use_cache=True, logits_to_keep=1)
        rows.cache, rows.tokens = _cache_of(out), out.logits[:, -1].argmax(-1)
        running = took(rows)
    return answers


def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int | str,
             desc: str = "generate", progress: bool = True, per_row: RowAdapters | None = None) -> list[str]:
    """Greedy continuations of tokenized prompts, decoded without special tokens.

    `batch_size`: the rows prefilled together, or "auto" (`decode_plan`: 64 on a CPU; on CUDA up to
    1024 within half the free memory).

    Prompts are grouped by length (less padding) and decoded with the model's KV cache
    by `greedy_ids`: rows leave as they end, the next group joins when few are left.
    `per_row`: each prompt with its own adapter (`RowAdapters`); the rows of each group (the
    prompts `greedy_ids` prefills together) are then ordered by adapter, so that a
    forward computes one run per adapter, not one per change of adapter (the group's padding is
    its longest prompt's, whatever the order).
    """
    batch_size, memory = decode_plan(model, batch_size)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    if per_row is not None:
        # each group's rows by adapter; `greedy_ids` cuts the reordered prompts into the same groups
        # (a group's members and widest prompt unchanged, so every cut `_groups` checks is too)
        groups = _groups([len(prompts[i]) for i in order], batch_size, max_new_tokens, memory)
        order = [i for g in groups for i in sorted((order[j] for j in g), key=per_row.of.__getitem__)]
    bar = tqdm(total=len(prompts), desc=desc, leave=False, disable=not progress, unit="ex")
    sorted_rows = None if per_row is None else RowAdapters([per_row.of[i] for i in order], per_row.route)
    answers = greedy_ids(model, [prompts[i] for i in order], tokenizer.pad_token_id, _eos_ids(model, tokenizer),
                         max_new_tokens, batch_size, on_done=bar.update, per_row=sorted_rows, memory=memory)
    bar.close()
    outputs: list[str] = [""] * len(prompts)
    for i, answer in zip(order, answers):
        outputs[i] = tokenizer.decode(answer, skip_special_tokens=True).strip()
    return outputs


# ---- exact match -------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """Case folded, punctuation removed (ASCII punctuation and Unicode's P* categories, as
    SQuAD's normalisation without its article rule), whitespace runs collapsed to one space."""
    import string
    import unicodedata

    kept = (ch for ch in text.casefold() if ch not in string.punctuation and not unicodedata.category(ch).startswith("P"))
    return " ".join("".join(kept).split())


def exact_match(predictions: list[str], references: list[str]) -> float:
    """Share ×100 of predictions equal to their reference after `normalize_answer` (0 for none).
    The usual measure for FLAN's short-label tasks (entailment, paraphrase, coreference)."""
    if not predictions:
        return 0.0
    hits = sum(normalize_answer(p) == normalize_answer(r) for p, r in zip(predictions, references))
    return 100.0 * hits / len(predictions)


def add_exact_match(results: dict, predictions: list[dict]) -> dict:
    """Add exact match next to ROUGE-L in `results` (results.json's dict), computed from the
    run's prediction rows (predictions.jsonl): per client ``exact_match_{personalized,global,base}``
    and their client averages ``avg_exact_match_*``; a model without outputs (base switched
    off) gets None. Existing keys are left as they are."""
    kinds = ("personalized", "global", "base")
    for row in results["clients"]:
        mine = [p for p in predictions if p["task"] == row["task"]]
        for kind in kinds:
            outputs = [p[kind] for p in mine]
            row[f"exact_match_{kind}"] = (None if not mine or any(o is None for o in outputs)
                                          else exact_match(outputs, [p["reference"] for p in mine]))
    for kind in kinds:
        values = [r[f"exact_match_{kind}"] for r in results["clients"] if r[f"exact_match_{kind}"] is not None]
        results[f"avg_exact_match_{kind}"] = sum(values) / len(values) if values else None
    return results
