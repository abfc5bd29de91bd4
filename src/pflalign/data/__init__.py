"""Instruction data: the loaders return plain text examples by task (category),
one `TaskData` each. Which client holds which examples is the partition
step's job (`pflalign.partition`); turning examples into token ids (chat
template, loss mask, truncation) is `pflalign.prompts`'s.

A dataset is one loader module here that defines a `Dataset` (how to load it, its
default clients, its table, its files) and one line in `registry.DATASETS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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



@dataclass
class Table:
    """Rows of examples with their labels; `test_*` is the source's own test split, if any
    (`pflalign.data.federate` partitions it)."""

    examples: list[Example]
    labels: list[str] | None
    test_examples: list[Example] | None = None
    test_labels: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Dataset:
    """What pflalign needs of one dataset (``data.name``); its loader module defines one, and
    `pflalign.data.registry.DATASETS` names it. Everything else (the default clients of a run,
    `pflalign export`'s client names, the data cache's key, which `data.*` options apply) is
    derived from these fields."""

    # (source, categories, split_seed, max_train, max_test) -> one TaskData per category, in order;
    # categories None: `categories` below. None: the dataset loads only as a table (your own files).
    load: Callable[..., list[TaskData]] | None
    categories: tuple[str, ...] = ()  # the default clients, one per category (the paper's)
    # source -> the whole dataset as one `Table` labelled by category, for data.partition other than
    # one client per category; None: it cannot be partitioned (synthetic).
    table: Callable[[str | None], Table] | None = None
    # the local source (None: none given) -> the files `load` reads, in order; None where the data
    # cache does not apply (a hub id, a missing file). None here: never cached.
    files: Callable[[Path | None], list[Path] | None] | None = None
