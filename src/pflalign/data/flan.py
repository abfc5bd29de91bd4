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

from pflalign.data import Dataset, Example, Table
from pflalign.data.dolly import first_line, get_text_field, read_jsonl
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


def flan_table(directory: str | None) -> Table:
    """FedDPA FLAN as a table: the training files (K ascending) as rows, test.jsonl as the test
    split, each record labelled by its category. The natural partition on category gives client c
    the training records of category c and, by the test rule, the lines of test.jsonl with that
    category, each in file order (the paper's clients)."""
    if not directory:
        raise UserError("the flan federation needs its data folder: pass --data-dir pointing at the "
                        "folder with local_training_K.json and test.jsonl")
    root = Path(directory)
    if not root.is_dir():
        raise UserError(f"FLAN data directory not found: {root}")

    def rows(records):
        examples, labels = [], []
        for where, record in records:
            examples.append(Example(prompt=get_text_field(record, "instruction", where).strip(),
                                    response=get_text_field(record, "output", where).strip()))
            labels.append(get_text_field(record, "category", where))
        return examples, labels

    train, train_labels = rows(_training_records(root))
    test_path = root / TEST_FILENAME
    if not test_path.is_file():
        raise UserError(f"FLAN test file not found: {test_path}")
    test, test_labels = rows(read_jsonl(test_path))
    return Table(train, train_labels, test, test_labels, info={"source": str(root), "columns": {
        "instruction": "instruction", "response": "output", "label": "category"},
        "rows": len(train), "test_rows": len(test), "dropped": {}})


def flan_files(source: Path | None) -> list[Path] | None:
    """The files `flan_table` reads from the folder `source`: the training files (K ascending), then
    test.jsonl."""
    if source is None or not source.is_dir():
        return None
    train = sorted((int(m.group(1)), p) for p in source.iterdir()
                   if (m := _TRAINING_FILE.fullmatch(p.name)) and p.is_file())
    return [p for _, p in train] + [source / TEST_FILENAME]


def _table(source: str | None, split_seed: int, max_train: int | None, max_test: int | None) -> Table:
    return flan_table(source)  # the files as they are: the sizes are the test rule's


DATASET = Dataset(table=_table, categories=PAPER_CATEGORIES, files=flan_files)


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
