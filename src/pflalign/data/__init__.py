"""Instruction data: the loaders return plain text examples by task (category),
one `TaskData` each. Which client holds which examples is the partition
step's job (`pflalign.partition`); turning examples into token ids (chat
template, loss mask, truncation) is `pflalign.prompts`'s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One instruction-following example: the prompt text and the reference answer.

    A conversation (`messages` data, pflalign.data.files) also keeps its turns as
    (role, content) pairs, the last one the assistant turn that `response` holds; with a chat
    template every assistant turn is learned and the prompt is the conversation before the
    last one (pflalign.prompts). `prompt` is then that conversation as plain text, for the
    plain template and for reading predictions.
    """

    prompt: str
    response: str
    messages: tuple[tuple[str, str], ...] | None = None


@dataclass
class TaskData:
    """The examples of one task (category): its name and its train/test split."""

    task: str
    train: list[Example]
    test: list[Example]

