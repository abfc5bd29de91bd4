"""Databricks-Dolly-15K as a federation: one client per category.

The paper's Dolly setting gives each of 4 clients one Dolly category and
holds out ceil(10%) of that category as the client's test set (214, 178,
151 and 119 examples for classification, closed_qa, information_extraction
and summarization). `dolly_table` reads Dolly (a local file or, failing that,
the Hugging Face Hub) as one table labelled by category; the natural partition
on category and the per-client test rule (`pflalign.data.federate`: each
category shuffled by an RNG seeded with `f"{split_seed}:{category}"`, the
first ceil(n/10) its test set) reproduce that split deterministically.

The small JSON-lines helpers at the bottom are shared with `flan.py`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pflalign.data import Dataset, Example, Table
from pflalign.errors import UserError

log = logging.getLogger(__name__)

DOLLY_HUB_ID = "databricks/databricks-dolly-15k"
DOLLY_FILENAME = "databricks-dolly-15k.jsonl"
DOLLY_CATEGORIES = (
    "brainstorming",
    "classification",
    "closed_qa",
    "creative_writing",
    "general_qa",
    "information_extraction",
    "open_qa",
    "summarization",
)
PAPER_CATEGORIES = ("classification", "closed_qa", "information_extraction", "summarization")  # the paper's clients


def _dolly_prompt(record: Mapping[str, Any], where: str) -> str:
    """The instruction, followed by the context when the record has a non-empty one."""
    instruction = get_text_field(record, "instruction", where).strip()
    context = record.get("context")
    if context is None:
        context = ""
    context = check_text(context, "context", where).strip()
    return f"{instruction}\n\nContext:\n{context}" if context else instruction


def _dolly_records(source: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
    """(location, record) pairs from a local file or directory, or from the hub."""
    if source == DOLLY_HUB_ID and not Path(source).exists():
        return _hub_records()
    path = Path(source)
    if path.is_dir():
        path = path / DOLLY_FILENAME
    if not path.is_file():
        raise UserError(
            f"Dolly data not found: {path} (pass a .jsonl file, a folder containing "
            f"{DOLLY_FILENAME}, or the hub id {DOLLY_HUB_ID})"
        )
    return read_jsonl(path)


def _hub_records() -> list[tuple[str, Mapping[str, Any]]]:
    """Download Dolly from the Hugging Face Hub, via `datasets` when it is installed."""
    try:
        try:
            import datasets  # optional: not a dependency of pflalign
        except ImportError:
            datasets = None
        if datasets is not None:
            rows = datasets.load_dataset(DOLLY_HUB_ID, split="train")
            return [(f"{DOLLY_HUB_ID} row {i}", dict(row)) for i, row in enumerate(rows, start=1)]
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(DOLLY_HUB_ID, DOLLY_FILENAME, repo_type="dataset")
    except Exception as error:  # network, auth, cache: all mean "use a local copy"
        raise UserError(
            f"the Hugging Face Hub is unreachable, could not download {DOLLY_HUB_ID} "
            f"({first_line(error)}); "
            f"pass a local file instead (a .jsonl or a folder containing {DOLLY_FILENAME}, "
            "e.g. with --data-dir)"
        ) from error
    return list(read_jsonl(Path(local)))


def dolly_table(source: str | None) -> Table:
    """Dolly as a table: every record in file order (`source`: a ``.jsonl`` file, a folder holding
    ``databricks-dolly-15k.jsonl``, or the hub id; None: the hub), its category as label."""
    source = source or DOLLY_HUB_ID
    examples, labels = [], []
    for where, record in _dolly_records(source):
        examples.append(Example(prompt=_dolly_prompt(record, where),
                                response=get_text_field(record, "response", where).strip()))
        labels.append(get_text_field(record, "category", where))
    if not examples:
        raise UserError(f"no Dolly records in {source}")
    unknown = sorted(set(labels) - set(DOLLY_CATEGORIES))
    if unknown:
        log.info("Dolly data has categories beyond the 8 standard ones: %s", ", ".join(unknown))
    return Table(examples, labels, info={"source": str(source), "columns": {
        "instruction": "instruction", "context": "context", "response": "response", "label": "category"},
        "rows": len(examples), "dropped": {}})


def dolly_files(source: Path | None) -> list[Path] | None:
    """The file `dolly_table` reads from a local `source` (a file, or a folder holding it)."""
    if source is None:
        return None
    return [source / DOLLY_FILENAME if source.is_dir() else source]


def _table(source: str | None, split_seed: int, max_train: int | None, max_test: int | None) -> Table:
    return dolly_table(source)  # the file as it is: the split and the sizes are the test rule's


DATASET = Dataset(table=_table, categories=PAPER_CATEGORIES, files=dolly_files)


# --- JSON-lines helpers, shared with flan.py -------------------------------------------


def read_jsonl(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Yield ("file:line", object) for each non-blank line; any bad line is a `UserError`.

    Lines are decoded one by one so that bad UTF-8, bad JSON and non-object
    values are all reported with their file and line number.
    """
    try:
        handle = path.open("rb")
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from error
    with handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # BOM ok
            except UnicodeDecodeError as error:
                raise UserError(f"{where}: not valid UTF-8 ({error.reason})") from error
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                message = f"{where}: not valid JSON ({error.msg} at column {error.colno})"
                raise UserError(message) from error
            except (ValueError, RecursionError) as error:  # e.g. a 5000-digit number
                raise UserError(f"{where}: not valid JSON ({first_line(error)})") from error
            if not isinstance(record, dict):
                raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record


def check_text(value: Any, field: str, where: str) -> str:
    """`value` of the text field `field` of the row `where`, which must be a string: every
    loader's text (Dolly's and FLAN's fields, your files' instruction, response and context
    columns, a chat turn's content) is checked here, so a number is never trained on as text."""
    if not isinstance(value, str):
        raise UserError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    return value


def get_text_field(record: Mapping[str, Any], field: str, where: str) -> str:
    """`record[field]`, which must be present and a string (`check_text`); else a `UserError` naming it."""
    if field not in record:
        raise UserError(f"{where}: record has no field {field!r}")
    return check_text(record[field], field, where)


def check_unique(names: list[str], what: str) -> None:
    """Reject a name requested twice: it would silently create two identical clients."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise UserError(f"{what} {name!r} is given twice")
        seen.add(name)


def check_limit(name: str, value: int | None) -> None:
    """`max_train`/`max_test` must be None or a non-negative integer."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise UserError(f"{name} must be a non-negative integer or None, got {value!r}")


def first_line(error: BaseException) -> str:
    """An exception as one short line, for the one-line `UserError` messages."""
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else type(error).__name__
