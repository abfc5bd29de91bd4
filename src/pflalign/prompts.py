"""From text examples to token ids: chat template, loss mask, truncation, batches.

Truncation rule (documented in docs/usage.md): an example longer than
``max_len`` tokens keeps its response (plus EOS) up to half of ``max_len``,
cut from the right; the prompt then keeps its *last* tokens, so the chat
template's generation prompt ("assistant:") always survives. Truncated
examples are counted and reported, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .data import Example

IGNORE = -100
PLAIN_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"


TEMPLATES = ("chat", "plain")  # data.template


def _chat(tokenizer, template: str) -> bool:
    """Whether prompts go through the tokenizer's chat template."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    return template == "chat" and bool(getattr(tokenizer, "chat_template", None))


def format_prompt(tokenizer, prompt: str, template: str = "chat") -> str:
    """The model-facing prompt: with template="chat" (the default), the tokenizer's chat
    template when it has one (SmolLM2, Llama-3.2-Instruct), else a plain instruction
    template (OPT); template="plain" always the plain one (base models)."""
    if _chat(tokenizer, template):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return PLAIN_TEMPLATE.format(prompt=prompt)


def _ids(tokenizer, text: str, template: str = "chat") -> list[int]:
    # The chat template already holds the special tokens (BOS etc.); add none twice.
    special = not _chat(tokenizer, template)
    ids = tokenizer(text, add_special_tokens=special)["input_ids"]
    return list(ids)


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool


def encode_train(tokenizer, example: Example, max_len: int, template: str = "chat") -> Encoded:
    """Prompt + response + EOS; the prompt's labels are IGNORE so only the response is learned."""
    prompt = _ids(tokenizer, format_prompt(tokenizer, example.prompt, template), template)
    response = list(tokenizer(example.response, add_special_tokens=False)["input_ids"])
    response.append(tokenizer.eos_token_id)
    truncated = len(prompt) + len(response) > max_len
    if truncated:
        response = response[: max(max_len // 2, max_len - len(prompt))]
        prompt = prompt[max(0, len(prompt) - (max_len - len(response))) :]
    return Encoded(prompt + response, [IGNORE] * len(prompt) + response, truncated)


def encode_prompt(tokenizer, example: Example, max_len: int, template: str = "chat") -> tuple[list[int], bool]:
    """The prompt alone, for generation; left-truncated to max_len."""
    prompt = _ids(tokenizer, format_prompt(tokenizer, example.prompt, template), template)
    return prompt[-max_len:], len(prompt) > max_len


def collate_train(encoded: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a training batch to its longest member."""
    width = max(len(e.input_ids) for e in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of minibatch number `step` of a client with n examples.

    The stream is an endless concatenation of seeded permutations (one per
    epoch), so a client's data order is a pure function of (seed, step): the
    only sampler state to checkpoint is the step counter.
    """
    start = step * batch_size
    out: list[int] = []
    epoch = start // n
    offset = start % n
    while len(out) < batch_size:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=g).tolist()
        take = perm[offset : offset + batch_size - len(out)]
        out.extend(take)
        epoch, offset = epoch + 1, 0
    return out
