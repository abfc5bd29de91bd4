"""Scoring: batched greedy generation with a KV cache (finished rows leave the batch), and ROUGE-L.

ROUGE-L is the F-measure of `rouge-score`'s ``rougeL`` with Porter stemming,
×100, averaged over a client's test examples — the paper's metric.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

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


@torch.no_grad()
def greedy_batch(model, ids: torch.Tensor, mask: torch.Tensor, eos: list[int], max_new_tokens: int) -> list[list[int]]:
    """The token ids `model.generate` picks greedily for a left-padded batch, EOS included.

    Unlike `model.generate`, a row leaves the batch as soon as it ends (an EOS token):
    its cache, mask and positions are dropped, so the remaining rows' decode
    steps stop paying for it.
    """
    alive = list(range(len(ids)))  # batch position -> row of `ids`
    answers: list[list[int]] = [[] for _ in alive]
    # Positions as generate derives them: count of real tokens so far, 0 on pads.
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    # generate drops an all-ones mask (attention then takes its unpadded, causal path): do the same.
    mask = None if bool(mask.all()) else mask
    cache, inputs = None, ids
    for step in range(max_new_tokens):
        out = model(input_ids=inputs, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)  # logits of the last position only
        cache, tokens = out.past_key_values, out.logits[:, -1].argmax(-1)
        picked = tokens.tolist()
        for row, token in zip(alive, picked):
            answers[row].append(token)
        keep = [k for k, token in enumerate(picked) if token not in eos]
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(alive):  # shrink every per-row tensor to the rows still running
            index = torch.tensor(keep, device=tokens.device)
            cache.batch_select_indices(index)
            tokens, positions = tokens[index], positions[index]
            mask = None if mask is None else mask[index]
            alive = [alive[k] for k in keep]
        inputs, positions = tokens[:, None], positions[:, -1:] + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=-1)
    return answers


def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
             desc: str = "generate", progress: bool = True) -> list[str]:
    """Greedy continuations of tokenized prompts, decoded without special tokens.

    Prompts are grouped by length (less padding), left-padded, and decoded
    with the model's KV cache by `greedy_batch`, rows leaving as they end.
    """
    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[str] = [""] * len(prompts)
    bar = tqdm(total=len(prompts), desc=desc, leave=False, disable=not progress, unit="ex")
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            p = prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        answers = greedy_batch(model, ids.to(device), mask.to(device), eos, max_new_tokens)
        for answer, i in zip(answers, chunk):
            outputs[i] = tokenizer.decode(answer, skip_special_tokens=True).strip()
        bar.update(len(chunk))
    bar.close()
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
