"""Your own data: local JSON / JSON-lines / CSV / Parquet files, or a Hugging Face hub id,
read with `datasets.load_dataset`, with a mapping of your columns onto the prompt.

`read_table(source, columns, label)` returns a `Table`: one `Example` per row (the
prompt is the instruction, followed by "\\n\\nContext:\\n" and the context when the
row has one, as for Dolly), the row's label (the column naming its client, or the
class a partitioner skews on) and, when the source has one, its own test split.
What was read, which columns were used and which rows were dropped and why is in
`Table.info` (JSON-ready) and in the log.

Sources:
- a file (`.json` holding a list of objects or JSON lines, `.jsonl`, `.csv`,
  `.parquet`): the rows to partition;
- a folder: `load_dataset(folder)`, i.e. Hugging Face's rules: files named
  `train*` / `test*` (or `train/`, `test/` folders) are those splits, else every
  data file is the train split;
- anything else that is not a path: a hub id, tried only when the hub is reachable.
A `test` split next to `train` is the source's own test set (see
`pflalign.data.federate`); other splits (validation, ...) are ignored and logged.

Conversations: a source with a `messages` column (a list of ``{"role", "content"}``
turns, roles system / user / assistant, the common chat format of TRL and the Hugging
Face hub) and no instruction column is read as one conversation per row, ending with
the assistant turn that is its reference answer (`conversation_example`). A
conversation of one user turn and its answer is an ordinary instruction example.

Bad input is one line (`UserError`, exit 2): a missing file or column, an empty
file, a row with an empty instruction or response (or label) unless
`drop_empty=True`, which drops such rows and counts them instead.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pflalign.data import Dataset, Example, Table  # noqa: F401  (Table: its former home)
from pflalign.data.dolly import check_text, first_line
from pflalign.errors import UserError

log = logging.getLogger(__name__)

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
MESSAGES = "messages"  # the column of a conversational source
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Columns:
    """Which column of the source is what (`data.columns.*`); context is optional."""

    instruction: str = "instruction"
    response: str = "response"
    context: str | None = None


def own_files(source: Path | None) -> list[Path] | None:
    """The files `read_table` reads from a local `source`: the file, or every data file under a
    folder (Hugging Face's rules pick among them, so a change to any of them counts)."""
    if source is None:
        return None
    if source.is_dir():
        return sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS) or None
    return [source] if source.is_file() else None


# your own data loads only as a table (`pflalign.data.federate`, with data.columns and data.partition_by)
DATASET = Dataset(table=None, files=own_files)


def read_table(
    source: str,
    columns: Columns = Columns(),
    label: str | None = None,
    drop_empty: bool = False,
) -> Table:
    """Read `source` (file, folder or hub id), map its columns, check every row."""
    splits, where = _load(source)
    train_name = "train" if "train" in splits else None
    if train_name is None:
        if len(splits) != 1:
            raise UserError(f"{where} has splits {', '.join(sorted(splits))} and none is called 'train'")
        train_name = next(iter(splits))
    ignored = sorted(s for s in splits if s not in (train_name, "test"))
    if ignored:
        log.info("%s: ignoring split(s) %s (only train and test are used)", where, ", ".join(ignored))
    dropped: Counter[str] = Counter()
    present = splits[train_name].column_names
    if MESSAGES in present and columns.instruction not in present:
        columns = Columns(MESSAGES, MESSAGES)  # one column holds the prompt and the response
    examples, labels = _rows(splits[train_name], f"{where} ({train_name})", columns, label, drop_empty, dropped)
    test_examples = test_labels = None
    if "test" in splits and train_name != "test":
        test_examples, test_labels = _rows(splits["test"], f"{where} (test)", columns, label, drop_empty, dropped,
                                           is_test=True)
    used = ({"messages": MESSAGES} if columns.instruction == columns.response == MESSAGES
            else {"instruction": columns.instruction, "response": columns.response})
    if columns.context:
        used["context"] = columns.context
    if label:
        used["label"] = label
    info = {
        "source": where,
        "columns": used,
        "rows": splits[train_name].num_rows,
        "test_rows": None if test_examples is None else splits["test"].num_rows,
        "dropped": dict(sorted(dropped.items())),
        "ignored_splits": ignored,
    }
    log.info("%s: columns %s; %d rows%s; dropped: %s", where,
             ", ".join(f"{k}={v}" for k, v in used.items()), info["rows"],
             "" if test_examples is None else f", {info['test_rows']} test rows",
             ", ".join(f"{n} ({r})" for r, n in info["dropped"].items()) or "none")
    return Table(examples, labels if label else None, test_examples, test_labels if label else None, info)


def _load(source: str) -> tuple[dict[str, Any], str]:
    """The source's splits as `datasets.Dataset`s, and a short name for messages."""
    path = Path(source).expanduser()
    if path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise UserError(f"{path}: unsupported file type {path.suffix or '(none)'!r}; "
                            f"use one of {', '.join(BUILDERS)} (or a folder of them)")
        if path.stat().st_size == 0:
            raise UserError(f"{path} is empty")
        return _call_load_dataset(str(path), builder, data_files={"train": str(path)},
                                  as_text=builder == "csv"), str(path)
    if path.is_dir():
        suffixes = {p.suffix.lower() for p in path.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS}
        if not suffixes:
            raise UserError(f"{path} holds no {', '.join(BUILDERS)} files")
        return _call_load_dataset(str(path), str(path), as_text=suffixes == {".csv"}), str(path)
    if path.suffix.lower() in BUILDERS or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise UserError(f"data file not found: {path}")
    unreachable = _hub_unreachable()
    if unreachable:
        raise UserError(f"{source!r} is not a local file or folder, and the Hugging Face Hub is not reachable "
                        f"({unreachable}); pass a local .json/.jsonl/.csv/.parquet file or folder")
    return _call_load_dataset(source, source, hub=True), source


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached, or None: offline mode, or no connection to its host within
    3 s (checked first, so that an offline machine fails at once instead of after the hub
    client's retries). Behind a proxy the check is left to the hub client."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as error:
        return f"cannot connect to {host}:{port}: {error.strerror or error}"
    return None


def _call_load_dataset(where: str, *args, hub: bool = False, as_text: bool = False, **kwargs) -> dict[str, Any]:
    """`datasets.load_dataset(*args, **kwargs)`'s splits, its errors as one line. `as_text`: every
    column cast to text, for CSV: it has no types (its reader guesses numbers, 1.50 becoming 1.5),
    so a cell is text; JSON, Parquet and hub tables keep their types, and a number in a text
    column is refused (`_text`)."""
    try:
        import datasets
    except ImportError as error:  # a dependency, but say so plainly if it is missing
        raise UserError("data.name=files needs the 'datasets' package: pip install 'datasets>=4,<5'") from error
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Generating train split" is noise next to the run's log
    # its builders also log a bad file's error ("Failed to load JSON from file ..."): our one line says it
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        loaded = datasets.load_dataset(*args, **kwargs)
        if as_text:
            loaded = {name: split.cast(datasets.Features({c: datasets.Value("string") for c in split.column_names}))
                      for name, split in loaded.items()}
    except Exception as error:  # datasets raises many types for a bad file or an unreachable hub
        if hub:
            raise UserError(
                f"{where!r} is not a local file or folder, and loading it as a Hugging Face hub dataset "
                f"failed ({first_line(error)}); pass a local .json/.jsonl/.csv/.parquet file or folder"
            ) from error
        if "corresponds to no data" in str(error):  # e.g. a CSV with only its header line
            raise UserError(f"{where} has no rows") from error
        # DatasetGenerationError ("An error occurred while generating the dataset") wraps the file's own
        # error (a JSON parse error with its row, a bad byte): that one says what is wrong
        inner = error.__cause__ or error.__context__
        said = inner if type(error).__name__ == "DatasetGenerationError" and inner is not None else error
        raise UserError(f"{where}: cannot read it as a dataset ({type(said).__name__}: {first_line(said)})") from error
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    return dict(loaded)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _text(value: Any, column: str, where: str) -> str:
    """A text cell (instruction, response, context, a turn's content) stripped; a missing cell is
    empty. Anything but a string is refused (`check_text`, as Dolly's and FLAN's fields): a
    JSON 42 is not the text "42" (a CSV's cells are all text: `_call_load_dataset`'s `as_text`)."""
    return "" if _missing(value) else check_text(value, column, where).strip()


def _label(value: Any, column: str, where: str) -> str:
    """A label cell (`partition_by`) as text: a label names a client or a class, so numbers and
    booleans are written out (class ids 0, 1, 2 are labels); a missing cell is empty."""
    if _missing(value):
        return ""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (bool, int, float)):
        return str(value)
    raise UserError(f"{where}: field {column!r} must be a label (text or a number), got {type(value).__name__}")


def _rows(
    table: Any,
    where: str,
    columns: Columns,
    label: str | None,
    drop_empty: bool,
    dropped: Counter,
    is_test: bool = False,
) -> tuple[list[Example], list[str]]:
    conversations = columns.instruction == columns.response == MESSAGES
    keys = [("messages", MESSAGES)] if conversations else [("instruction", columns.instruction),
                                                            ("response", columns.response)]
    if columns.context:
        keys.append(("context", columns.context))
    if label:
        keys.append(("label", label))
    present = list(table.column_names)
    for role, name in keys:
        if name not in present:
            key = "data.partition_by" if role == "label" else f"data.columns.{role}"
            raise UserError(f"{where}: no column {name!r} ({key}); its columns are: {', '.join(present)}")
    if table.num_rows == 0:
        raise UserError(f"{where} has no rows")
    data = {role: table[name] for role, name in keys}
    examples: list[Example] = []
    labels: list[str] = []
    prefix = "test: " if is_test else ""
    for i in range(table.num_rows):
        row = f"{where} row {i + 1}"
        turns = _conversation(data["messages"][i], row) if conversations else None
        if conversations:
            instruction = "\n".join(c for r, c in turns[:-1] if r == "user")  # empty: no user text
            response = turns[-1][1]
        else:
            instruction = _text(data["instruction"][i], columns.instruction, row)
            response = _text(data["response"][i], columns.response, row)
        context = _text(data["context"][i], columns.context, row) if "context" in data else ""
        value = _label(data["label"][i], label, row) if "label" in data else ""
        empty = [(role, name) for role, name, text in (("instruction", columns.instruction, instruction),
                                                       ("response", columns.response, response),
                                                       ("label", label, value))
                 if name and not text]
        if empty:
            role, name = empty[0]
            if not drop_empty:
                raise UserError(f"{row}: empty {role} (column {name!r}); fix the data or set "
                                "data.drop_empty=true to drop such rows")
            dropped[f"{prefix}empty {role} (column {name!r})"] += 1
            continue
        if conversations:
            examples.append(conversation_example(turns))
        else:
            prompt = f"{instruction}\n\nContext:\n{context}" if context else instruction
            examples.append(Example(prompt=prompt, response=response))
        labels.append(value)
    if not examples:
        raise UserError(f"{where}: every row was dropped (empty instruction, response or label)")
    return examples, labels


def _conversation(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    """A `messages` cell as (role, content) turns, checked: roles system / user / assistant, at
    least one user turn, and an assistant turn last (the reference answer)."""
    shape = f"{where}: column {MESSAGES!r} must be a list of {{role, content}} turns"
    if not isinstance(value, list) or not value:
        raise UserError(f"{shape}, got {type(value).__name__ if value is not None else 'nothing'}")
    turns = []
    for j, turn in enumerate(value, 1):
        if not isinstance(turn, dict) or not {"role", "content"} <= turn.keys():
            raise UserError(f"{shape}; turn {j} is {turn!r}")
        role = turn["role"]
        if role not in ROLES:
            raise UserError(f"{where}: turn {j} has role {role!r}; the roles are {', '.join(ROLES)}")
        turns.append((role, _text(turn["content"], f"{MESSAGES}[{j}].content", where)))
    if turns[-1][0] != "assistant":
        raise UserError(f"{where}: the conversation ends with a {turns[-1][0]} turn; it must end with the "
                        "assistant turn that is its reference answer")
    return tuple(turns)


def conversation_example(turns: tuple[tuple[str, str], ...]) -> Example:
    """The example of a conversation ending with an assistant turn: response = that turn.
    One user turn and its answer make a plain instruction example (prompt = the user turn);
    any other conversation keeps its turns for the chat template (pflalign.prompts), and its
    prompt is the turns before the answer as "Role: content" paragraphs (what the plain
    template shows the model, and what predictions.jsonl shows you)."""
    *before, (_, response) = turns
    if [role for role, _ in before] == ["user"]:
        return Example(prompt=before[0][1], response=response)
    prompt = "\n\n".join(f"{role.capitalize()}: {content}" for role, content in before)
    return Example(prompt=prompt, response=response, messages=tuple(turns))
