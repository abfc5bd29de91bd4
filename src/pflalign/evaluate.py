"""Scoring: batched greedy generation with a KV cache, and ROUGE-L.

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
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
             desc: str = "generate", progress: bool = True) -> list[str]:
    """Greedy continuations of tokenized prompts, decoded without special tokens.

    Prompts are grouped by length (less padding), left-padded, and decoded
    with the model's KV cache; each batch stops once every row has hit EOS.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=_eos_ids(model, tokenizer),
    )
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
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen)
        for row, i in enumerate(chunk):
            outputs[i] = tokenizer.decode(out[row, width:], skip_special_tokens=True).strip()
        bar.update(len(chunk))
    bar.close()
    return outputs
