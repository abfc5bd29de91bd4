"""From text examples to token ids: chat template, loss mask, truncation, batches.

Truncation rule (documented in docs/usage.md): an example longer than
``max_len`` tokens keeps its response (plus EOS) up to half of ``max_len``,
cut from the right; the prompt then keeps its *last* tokens, so the chat
template's generation prompt ("assistant:") always survives. Truncated
examples are counted and reported, never dropped. A conversation is cut the
same way, its last assistant turn being the response and everything before
it (earlier assistant turns keep their labels) the prompt.
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


def _render(tokenizer, turns: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(turns, add_generation_prompt=generation_prompt, tokenize=False)


def encode_conversation(tokenizer, messages) -> tuple[list[int], list[int], list[int]]:
    """A conversation through the tokenizer's chat template: (ids before its last assistant turn,
    their labels, the last assistant turn's ids). Every assistant turn is learned as the template
    renders it (its content and end-of-turn marker: the text the template adds between the
    conversation before it, with the generation prompt, and the conversation through it); all
    else (system, user turns, the template's role headers) is masked with IGNORE. EOS follows
    the last turn when the template put none in it, as in instruction examples.

    The template must render a conversation's beginnings as prefixes of it (most do: ChatML,
    Llama 3, SmolLM2); one that rewrites earlier turns is refused with one line."""
    from .errors import UserError

    turns = [{"role": role, "content": content} for role, content in messages]
    ids: list[int] = []
    labels: list[int] = []
    last: list[int] = []
    done = ""
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = _render(tokenizer, turns[:i], True)
        through = _render(tokenizer, turns[: i + 1], False)
        if not before.startswith(done) or not through.startswith(before):
            raise UserError("the tokenizer's chat template does not render a conversation's first turns as the "
                            "beginning of the whole (it rewrites earlier turns), so its assistant turns cannot be "
                            "told apart; use data.template=plain")
        head = _ids(tokenizer, before[len(done):])
        answer = _ids(tokenizer, through[len(before):])
        ids += last + head  # the previous assistant turn, learned, then the next prompt part, masked
        labels += last + [IGNORE] * len(head)
        last, done = answer, through
    if tokenizer.eos_token_id not in last:
        last = last + [tokenizer.eos_token_id]
    return ids, labels, last


def _is_conversation(tokenizer, example: Example, template: str) -> bool:
    return example.messages is not None and _chat(tokenizer, template)


def encode_train(tokenizer, example: Example, max_len: int, template: str = "chat") -> Encoded:
    """Prompt + response + EOS; the prompt's labels are IGNORE so only the response is learned
    (a conversation: every assistant turn, `encode_conversation`)."""
    if _is_conversation(tokenizer, example, template):
        prompt, prompt_labels, response = encode_conversation(tokenizer, example.messages)
    else:
        prompt = _ids(tokenizer, format_prompt(tokenizer, example.prompt, template), template)
        prompt_labels = [IGNORE] * len(prompt)
        response = list(tokenizer(example.response, add_special_tokens=False)["input_ids"])
        response.append(tokenizer.eos_token_id)
    truncated = len(prompt) + len(response) > max_len
    if truncated:
        response = response[: max(max_len // 2, max_len - len(prompt))]
        keep = max(0, len(prompt) - (max_len - len(response)))
        prompt, prompt_labels = prompt[keep:], prompt_labels[keep:]
    return Encoded(prompt + response, prompt_labels + response, truncated)


def encode_prompt(tokenizer, example: Example, max_len: int, template: str = "chat") -> tuple[list[int], bool]:
    """The prompt alone, for generation; left-truncated to max_len. A conversation's: its turns
    before the last assistant turn, with the generation prompt."""
    if _is_conversation(tokenizer, example, template):
        text = _render(tokenizer, [{"role": r, "content": c} for r, c in example.messages[:-1]], True)
    else:
        text = format_prompt(tokenizer, example.prompt, template)
    prompt = _ids(tokenizer, text, template)
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
