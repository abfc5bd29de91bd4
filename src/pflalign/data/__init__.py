"""Federated instruction data: one `ClientData` per client, one task each.

Loaders return plain text examples; turning them into token ids (chat
template, loss mask, truncation) is `pflalign.data.tokenize`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One instruction-following example: the prompt text and the reference answer."""

    prompt: str
    response: str


@dataclass
class ClientData:
    """The private data of one client: its task name and its train/test examples."""

    task: str
    train: list[Example]
    test: list[Example]
