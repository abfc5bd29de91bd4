"""The FLAN federation of the FedDPA paper: one client per task category.

The FedDPA release ships `local_training_K.json` (a JSON list of records with
`instruction`, `output`, `task`, `category`; one client's 300 training examples
per file) and a shared `test.jsonl` (200 lines per category). Which file holds
which category is read from the records' `category` field, never assumed from K,
so a reordered or partial copy of the release still loads correctly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pflalign.data import Dataset, Example, Table, TaskData
from pflalign.data.dolly import (
    check_limit,
    check_unique,
    first_line,
    get_text_field,
    read_jsonl,
    unknown_category_error,
)
from pflalign.errors import UserError

FLAN_CATEGORIES = (
    "coreference",
    "entailment",
    "linguistic_acceptability",
    "paraphrase",
    "question_classification",
    "structure_to_text",
    "text_formatting",
    "word_disambiguation",
)
PAPER_CATEGORIES = ("coreference", "entailment", "paraphrase", "structure_to_text")  # the paper's clients
TEST_FILENAME = "test.jsonl"
_TRAINING_FILE = re.compile(r"local_training_(\d+)\.json")


def load_flan(
    directory: str,
    categories: list[str],
    max_train: int | None = None,
    max_test: int | None = None,
) -> list[TaskData]:
    """Load the FedDPA FLAN files in `directory`; one `TaskData` per category, in order.

    A client's training examples are the records of that category in the
    `local_training_K.json` files (K ascending, file order), its test examples
    the lines of `test.jsonl` with that category, in file order. `max_train`/
    `max_test` keep only the first N of each.
    """
    if not categories:
        raise UserError("no FLAN categories given: name at least one, e.g. coreference")
    check_unique(categories, "FLAN category")
    check_limit("max_train", max_train)
    check_limit("max_test", max_test)
    root = Path(directory)
    if not root.is_dir():
        raise UserError(f"FLAN data directory not found: {root}")

    train = _group_by_category(_training_records(root))
    test_path = root / TEST_FILENAME
    if not test_path.is_file():
        raise UserError(f"FLAN test file not found: {test_path}")
    test = _group_by_category(read_jsonl(test_path))

    clients = []
    for category in categories:
        if category not in train and category not in FLAN_CATEGORIES:
            raise unknown_category_error("FLAN", category, set(FLAN_CATEGORIES) | set(train))
        if category not in train:
            raise UserError(f"FLAN category {category!r} has no training examples in {root}")
        if category not in test:
            raise UserError(f"FLAN category {category!r} has no test examples in {test_path}")
        clients.append(
            TaskData(
                task=category,
                train=train[category][:max_train],
                test=test[category][:max_test],
            )
        )
    return clients


def flan_table(directory: str | None) -> Table:
    """FedDPA FLAN as a table: the training files (K ascending) as rows, test.jsonl as the test split."""
    if not directory:
        raise UserError("the flan federation needs its data folder: pass --data-dir")
    root = Path(directory)
    if not root.is_dir():
        raise UserError(f"FLAN data directory not found: {root}")
    test_path = root / TEST_FILENAME
    if not test_path.is_file():
        raise UserError(f"FLAN test file not found: {test_path}")

    def rows(records):
        examples, labels = [], []
        for where, record in records:
            examples.append(Example(prompt=get_text_field(record, "instruction", where).strip(),
                                    response=get_text_field(record, "output", where).strip()))
            labels.append(get_text_field(record, "category", where))
        return examples, labels

    train, train_labels = rows(_training_records(root))
    test, test_labels = rows(read_jsonl(test_path))
    return Table(train, train_labels, test, test_labels, info={"source": str(root), "columns": {
        "instruction": "instruction", "response": "output", "label": "category"},
        "rows": len(train), "test_rows": len(test), "dropped": {}})


def flan_files(source: Path | None) -> list[Path] | None:
    """The files `load_flan` reads from the folder `source`: the training files (K ascending), then
    test.jsonl."""
    if source is None or not source.is_dir():
        return None
    train = sorted((int(m.group(1)), p) for p in source.iterdir()
                   if (m := _TRAINING_FILE.fullmatch(p.name)) and p.is_file())
    return [p for _, p in train] + [source / TEST_FILENAME]


def _load(source: str | None, categories: list[str] | None, split_seed: int, max_train: int | None,
          max_test: int | None) -> list[TaskData]:
    if source is None:
        raise UserError(
            "the flan federation needs its data folder: pass --data-dir pointing at the "
            "folder with local_training_K.json and test.jsonl"
        )
    return load_flan(source, list(PAPER_CATEGORIES if categories is None else categories), max_train, max_test)


DATASET = Dataset(load=_load, categories=PAPER_CATEGORIES, table=flan_table, files=flan_files)


def _training_records(root: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """("file item N", record) for every record of every `local_training_K.json`, K ascending."""
    files = sorted(
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _TRAINING_FILE.fullmatch(path.name)) and path.is_file()
    )
    if not files:
        raise UserError(f"no local_training_*.json files in FLAN data directory {root}")
    for _, path in files:
        yield from _read_json_list(path)


def _read_json_list(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """The objects of a file holding one JSON list; anything else is a `UserError`."""
    try:
        text = path.read_bytes().decode("utf-8-sig")  # tolerate a byte-order mark
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise UserError(f"{path}: not valid UTF-8 (byte {error.start}: {error.reason})") from error
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        where = f"{path}:{error.lineno}"
        raise UserError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from error
    except (ValueError, RecursionError) as error:  # e.g. a 5000-digit number
        raise UserError(f"{path}: not valid JSON ({first_line(error)})") from error
    if not isinstance(records, list):
        raise UserError(f"{path}: expected a JSON list of records, got {type(records).__name__}")
    for index, record in enumerate(records):
        where = f"{path} item {index}"
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record


def _group_by_category(
    records: Iterator[tuple[str, Mapping[str, Any]]],
) -> dict[str, list[Example]]:
    """Validate each record and bucket its `Example` under its `category`, keeping order."""
    grouped: dict[str, list[Example]] = {}
    for where, record in records:
        example = Example(
            prompt=get_text_field(record, "instruction", where).strip(),
            response=get_text_field(record, "output", where).strip(),
        )
        grouped.setdefault(get_text_field(record, "category", where), []).append(example)
    return grouped
