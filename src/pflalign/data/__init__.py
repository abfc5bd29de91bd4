"""Instruction data: the loaders return plain text examples by task (category),
one `TaskData` each. Which client holds which examples is the partition
step's job (`pflalign.partition`); turning examples into token ids (chat
template, loss mask, truncation) is `pflalign.prompts`'s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One instruction-following example: the prompt text and the reference answer."""

    prompt: str
    response: str


@dataclass
class TaskData:
    """The examples of one task (category): its name and its train/test split."""

    task: str
    train: list[Example]
    test: list[Example]

