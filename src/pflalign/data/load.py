"""One entry point for every federation: `load_federation(name, ...)`.

The partition step (`pflalign.partition`) calls this instead of the individual
loaders so that defaults (the paper's categories, the synthetic sizes) and
input checks live in one place. It returns examples by category (`TaskData`);
which client holds what is the partition step's business.
"""

from __future__ import annotations

import difflib

from pflalign.data import TaskData
from pflalign.data.dolly import DOLLY_HUB_ID, check_unique, load_dolly, unknown_category_error
from pflalign.data.federate import FederationOptions, check_options, load_partitioned
from pflalign.data.flan import load_flan
from pflalign.data.synthetic import SYNTHETIC_TASKS, make_synthetic
from pflalign.errors import UserError

FEDERATIONS = ("synthetic", "dolly", "flan", "files")
DOLLY_PAPER_CATEGORIES = ["classification", "closed_qa", "information_extraction", "summarization"]
FLAN_PAPER_CATEGORIES = ["coreference", "entailment", "paraphrase", "structure_to_text"]
# the categories (one client each) of a federation when data.clients is not given
DEFAULT_CATEGORIES = {"synthetic": list(SYNTHETIC_TASKS), "dolly": DOLLY_PAPER_CATEGORIES,
                      "flan": FLAN_PAPER_CATEGORIES}
SYNTHETIC_DEFAULT_TRAIN = 64
SYNTHETIC_DEFAULT_TEST = 16


def load_federation(
    name: str,
    source: str | None,
    categories: list[str] | None,
    split_seed: int,
    max_train: int | None,
    max_test: int | None,
    options: FederationOptions | None = None,
) -> list[TaskData]:
    """Load the dataset `name` ("synthetic", "dolly", "flan" or "files"): the examples of each
    category (or of each client as `options` partition them: see `load_federation_described`).

    `categories=None` means the paper's 4 categories (all 4 tasks for synthetic).
    `source` is the data file or folder; Dolly falls back to the Hugging Face
    Hub, FLAN needs a folder, synthetic takes none. For synthetic, `split_seed`
    seeds the generator and `max_train`/`max_test` are the sizes (default 64/16).
    """
    return load_federation_described(name, source, categories, split_seed, max_train, max_test, options)[0]


def load_federation_described(
    name: str,
    source: str | None,
    categories: list[str] | None,
    split_seed: int,
    max_train: int | None,
    max_test: int | None,
    options: FederationOptions | None = None,
) -> tuple[list[TaskData], dict | None]:
    """`load_federation`, and what was loaded for results.json (`data`): source, columns,
    partition, rows dropped and why, clients' sizes. None for today's federations with
    the default options (one client per category), whose results.json stays as it was.

    `options` (the `data.*` partition and column keys, `FederationOptions.from_config(cfg.data)`)
    route `files`, and `dolly`/`flan` with anything but the default, through
    `pflalign.data.federate`; None or the defaults load exactly as before.
    """
    if name == "files" or (options is not None and name in ("dolly", "flan") and not options.is_default()):
        options = options or FederationOptions()
        chosen = categories
        if chosen is None and name in ("dolly", "flan"):
            chosen = DEFAULT_CATEGORIES[name]
        return load_partitioned(name, source or None, chosen, split_seed, max_train, max_test, options)
    if options is not None:
        check_options(name, options)
    return _load(name, source or None, categories, split_seed, max_train, max_test), None


def _load(name: str, source: str | None, categories: list[str] | None, split_seed: int,
          max_train: int | None, max_test: int | None) -> list[TaskData]:
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
) -> list[TaskData]:
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
