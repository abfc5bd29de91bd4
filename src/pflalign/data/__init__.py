"""Instruction data: every dataset is a table of plain text examples with a label column
(`Table`); a federation is table -> partitioner -> test rule -> clients (`federate.make_clients`,
with the partitioners of `partition`), and `clients` makes a run's clients from its config.
Turning examples into token ids (chat template, loss mask, truncation) is `pflalign.prompts`'s.

A dataset is one loader module here that defines a `Dataset` (its table, its default clients,
its files) and one line in `registry.DATASETS`.
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
class ClientShare:
    """One client's data: its name (results, metrics and logs call it by that name) and its
    train/test examples."""

    name: str
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

    # (source, split_seed, max_train, max_test) -> the whole dataset as one `Table` labelled by
    # category; the last three matter only to a dataset generated in code (synthetic: its seed and
    # its sizes per task). None: your own files, read with data.columns and data.partition_by
    # (`files.read_table`).
    table: Callable[[str | None, int, int | None, int | None], Table] | None
    categories: tuple[str, ...] = ()  # the default clients of the natural partition (the paper's)
    # the local source (None: none given) -> the files `table` reads, in order; None where the data
    # cache does not apply (a hub id, a missing file). None here: never cached.
    files: Callable[[Path | None], list[Path] | None] | None = None
