"""One entry point for every federation: `load_federation(name, ...)`.

The CLI and the experiment code call this instead of the individual loaders so
that defaults (the paper's client categories, the synthetic sizes) and input
checks live in one place.
"""

from __future__ import annotations

import difflib
import random

from pflalign.data import ClientData
from pflalign.data.dolly import DOLLY_HUB_ID, check_unique, load_dolly, unknown_category_error
from pflalign.data.federate import FederationOptions, check_options, load_partitioned
from pflalign.data.flan import load_flan
from pflalign.data.synthetic import SYNTHETIC_TASKS, make_synthetic
from pflalign.errors import UserError

FEDERATIONS = ("synthetic", "dolly", "flan", "files")
DOLLY_PAPER_CATEGORIES = ["classification", "closed_qa", "information_extraction", "summarization"]
FLAN_PAPER_CATEGORIES = ["coreference", "entailment", "paraphrase", "structure_to_text"]
SYNTHETIC_DEFAULT_TRAIN = 64
SYNTHETIC_DEFAULT_TEST = 16


def load_federation(
    name: str,
    source: str | None,
    categories: list[str] | None,
    split_seed: int,
    max_train: int | None,
    max_test: int | None,
    validation: int | None = None,
    options: FederationOptions | None = None,
) -> list[ClientData]:
    """Load the federation `name` ("synthetic", "dolly", "flan" or "files"), one client per category
    (or as `options` partition it: see `load_federation_described`).

    `validation=N` holds out N of each client's training examples as the split
    it is evaluated on, in place of its test split (see `hold_out_validation`).

    `categories=None` means the paper's 4 clients (all 4 tasks for synthetic).
    `source` is the data file or folder; Dolly falls back to the Hugging Face
    Hub, FLAN needs a folder, synthetic takes none. For synthetic, `split_seed`
    seeds the generator and `max_train`/`max_test` are the sizes (default 64/16).
    """
    return load_federation_described(name, source, categories, split_seed, max_train, max_test,
                                     validation, options)[0]


def load_federation_described(
    name: str,
    source: str | None,
    categories: list[str] | None,
    split_seed: int,
    max_train: int | None,
    max_test: int | None,
    validation: int | None = None,
    options: FederationOptions | None = None,
) -> tuple[list[ClientData], dict | None]:
    """`load_federation`, and what was loaded for results.json (`data`): source, columns,
    partition, rows dropped and why, clients' sizes. None for today's federations with
    the default options (one client per category), whose results.json stays as it was.

    `options` (the `data.*` partition and column keys, `FederationOptions.from_config(cfg.data)`)
    route `files`, and `dolly`/`flan` with anything but the default, through
    `pflalign.data.federate`; None or the defaults load exactly as before.
    """
    info = None
    if name == "files" or (options is not None and name in ("dolly", "flan") and not options.is_default()):
        if options is None:
            options = FederationOptions()
        chosen = categories
        if chosen is None and name in ("dolly", "flan"):
            chosen = DOLLY_PAPER_CATEGORIES if name == "dolly" else FLAN_PAPER_CATEGORIES
        clients, info = load_partitioned(name, source or None, chosen, split_seed, max_train, max_test, options)
    else:
        if options is not None:
            check_options(name, options)
        clients = _load(name, source or None, categories, split_seed, max_train, max_test)
    if validation is None:
        return clients, info
    return [hold_out_validation(c, validation, split_seed) for c in clients], info


def hold_out_validation(client: ClientData, n: int, split_seed: int) -> ClientData:
    """A validation split carved from the training data, for choosing hyperparameters without
    ever looking at the test split: n training examples, drawn with an RNG seeded by
    `f"validation:{split_seed}:{task}"` (the same for every run seed), become the examples the
    client is evaluated on; the rest, in their original order, are its training data."""
    if n <= 0 or n >= len(client.train):
        raise UserError(f"data.validation={n} must be > 0 and leave training data: client {client.task!r} "
                        f"has {len(client.train)} training examples")
    order = list(range(len(client.train)))
    random.Random(f"validation:{split_seed}:{client.task}").shuffle(order)
    held = set(order[:n])
    return ClientData(client.task, [e for i, e in enumerate(client.train) if i not in held],
                      [client.train[i] for i in sorted(held)])


def _load(name: str, source: str | None, categories: list[str] | None, split_seed: int,
          max_train: int | None, max_test: int | None) -> list[ClientData]:
    if name == "synthetic":
        return _load_synthetic(source, categories, split_seed, max_train, max_test)
    if name == "dolly":
        chosen = DOLLY_PAPER_CATEGORIES if categories is None else categories
        return load_dolly(source or DOLLY_HUB_ID, list(chosen), split_seed, max_train, max_test)
    if name == "flan":
        if source is None:
            raise UserError(
                "the flan federation needs its data folder: pass --data-dir pointing at the "
                "folder with local_training_K.json and test.jsonl"
            )
        chosen = FLAN_PAPER_CATEGORIES if categories is None else categories
        return load_flan(source, list(chosen), max_train, max_test)
    close = difflib.get_close_matches(name, FEDERATIONS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise UserError(f"unknown federation {name!r}; valid: {', '.join(FEDERATIONS)}.{hint}")


def _load_synthetic(
    source: str | None,
    categories: list[str] | None,
    seed: int,
    max_train: int | None,
    max_test: int | None,
) -> list[ClientData]:
    """The synthetic federation, optionally only some of its tasks (in the order given)."""
    if source is not None:
        raise UserError(
            f"the synthetic federation is generated in code: it takes no data source ({source!r})"
        )
    if categories is not None and not categories:
        raise UserError("no synthetic tasks given: name at least one, e.g. arithmetic")
    for task in categories or ():
        if task not in SYNTHETIC_TASKS:
            raise unknown_category_error("synthetic", task, SYNTHETIC_TASKS)
    check_unique(categories or [], "synthetic task")
    clients = make_synthetic(
        n_train=SYNTHETIC_DEFAULT_TRAIN if max_train is None else max_train,
        n_test=SYNTHETIC_DEFAULT_TEST if max_test is None else max_test,
        seed=seed,
    )
    if categories is None:
        return clients
    by_task = {client.task: client for client in clients}
    return [by_task[task] for task in categories]
