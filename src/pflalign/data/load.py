"""One entry point for every federation: `load_federation(name, ...)`.

The partition step (`pflalign.partition`) calls this instead of the individual
loaders; each dataset's loader, defaults (the paper's categories, the synthetic
sizes) and input checks are its `Dataset` in `pflalign.data.registry.DATASETS`.
It returns examples by category (`TaskData`); which client holds what is the
partition step's business.
"""

from __future__ import annotations

import difflib

from pflalign.data import TaskData, dolly, flan
from pflalign.data.federate import FederationOptions, check_options, load_partitioned
from pflalign.data.registry import DATASETS
from pflalign.errors import UserError

FEDERATIONS = tuple(DATASETS)
DOLLY_PAPER_CATEGORIES = list(dolly.PAPER_CATEGORIES)
FLAN_PAPER_CATEGORIES = list(flan.PAPER_CATEGORIES)
# the categories (one client each) of a federation when data.clients is not given
DEFAULT_CATEGORIES = {name: list(d.categories) for name, d in DATASETS.items() if d.categories}


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
    dataset = DATASETS.get(name)
    if dataset is not None and (dataset.load is None or (
            options is not None and dataset.table is not None and not options.is_default())):
        options = options or FederationOptions()
        chosen = categories
        if chosen is None and dataset.categories:
            chosen = list(dataset.categories)
        return load_partitioned(name, source or None, chosen, split_seed, max_train, max_test, options)
    if options is not None:
        check_options(name, options)
    return _load(name, source or None, categories, split_seed, max_train, max_test), None


def _load(name: str, source: str | None, categories: list[str] | None, split_seed: int,
          max_train: int | None, max_test: int | None) -> list[TaskData]:
    dataset = DATASETS.get(name)
    if dataset is None or dataset.load is None:
        close = difflib.get_close_matches(name, FEDERATIONS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UserError(f"unknown federation {name!r}; valid: {', '.join(FEDERATIONS)}.{hint}")
    return dataset.load(source, categories, split_seed, max_train, max_test)
