"""The partition step: from a dataset's examples to the federation's clients.

A client has a name (results, metrics and logs call it by that name) and the
examples it holds; the data layer (`pflalign.data`) only returns examples by
task (category). Today's federations are ``category``: client k holds
the k-th category of ``data.clients`` (the paper's 4 categories by default),
its name is that category's. Your own files and every other split (IID,
Dirichlet, shards, ...) go through `pflalign.data.federate` (`partitioned`);
the engines, the report and the figures only see names. Every client's share is
a pure function of the config and the data, so a Flower ClientApp computes
client k's share alone on its own host (``which=[k]``) and gets what client k
gets in process.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .data import Example
from .data.load import load_federation, load_federation_described
from .data.partition import partition_name
from .data.registry import DATASETS
from .errors import UserError
from .settings import RunConfig


@dataclass
class ClientShare:
    """One client's data: its name and its train/test examples."""

    name: str
    train: list[Example]
    test: list[Example]


def names_from_config(cfg: RunConfig) -> list[str] | None:
    """The name of every client, in client order (Flower's partition-id k is the k-th), where
    the config alone says them: one client per category (`by_category`), ``client_000`` ... for
    the ``data.num_clients`` clients of every partition but natural, the labels of
    ``data.clients`` (Dolly's and FLAN's default: the paper's categories) for a natural one.
    None for a natural partition of your own files without ``data.clients`` (its clients are
    the values of the ``partition_by`` column) and with ``data.client_names=labelled`` (each
    name carries its client's most common label): known once the data is read (`client_names`)."""
    if uses_partitioner(cfg):
        if cfg.data.client_names == "labelled":
            return None  # each name carries its client's most common label: known once the data is read
        if cfg.data.partition != "natural":
            return [partition_name(k) for k in range(cfg.data.num_clients)]
        clients = cfg.data.clients
        if clients is None and cfg.data.name in DATASETS:
            clients = DATASETS[cfg.data.name].categories or None  # the dataset's default clients, if any
        return None if clients is None else list(clients)
    return client_names(cfg)


def client_names(cfg: RunConfig, data_dir: str | None = None) -> list[str]:
    """The name of every client, in client order (Flower's partition-id k is the k-th): from
    the config (`names_from_config`), else read off the data in `data_dir` (None: ``data.dir``)."""
    if uses_partitioner(cfg):
        names = names_from_config(cfg)
        return names if names is not None else [s.name for s in client_shares(cfg, data_dir)]
    if cfg.data.clients is not None:
        return list(cfg.data.clients)
    dataset = DATASETS.get(cfg.data.name)
    if dataset is None or not dataset.categories:  # the registry's datasets with default clients
        valid = ", ".join(name for name, d in DATASETS.items() if d.categories)
        raise UserError(f"unknown federation {cfg.data.name!r}; valid: {valid}")
    return list(dataset.categories)


def by_category(cfg: RunConfig, data_dir: str | None, which: list[int] | None) -> list[ClientShare]:
    """One client per category of ``data.clients``, named after it; `which`: only those clients
    (None: all), so that a Flower client loads only its own category."""
    categories = cfg.data.clients if which is None else [client_names(cfg)[k] for k in which]
    tasks = load_federation(cfg.data.name, data_dir, categories, cfg.data.split_seed,
                            cfg.data.max_train, cfg.data.max_test)
    return [ClientShare(t.task, t.train, t.test) for t in tasks]


def hold_out_validation(share: ClientShare, n: int, split_seed: int) -> ClientShare:
    """A validation split carved from the training data, for choosing hyperparameters without
    ever looking at the test split: n training examples, drawn with an RNG seeded by
    `f"validation:{split_seed}:{name}"` (the same for every run seed), become the examples the
    client is evaluated on; the rest, in their original order, are its training data."""
    if n <= 0 or n >= len(share.train):
        raise UserError(f"data.validation={n} must be > 0 and leave training data: client {share.name!r} "
                        f"has {len(share.train)} training examples")
    order = list(range(len(share.train)))
    random.Random(f"validation:{split_seed}:{share.name}").shuffle(order)
    held = set(order[:n])
    return ClientShare(share.name, [e for i, e in enumerate(share.train) if i not in held],
                       [share.train[i] for i in sorted(held)])


def uses_partitioner(cfg: RunConfig) -> bool:
    """Whether the clients come from `pflalign.data.federate` (your own files, or a partition other
    than today's one client per category) rather than `by_category`."""
    from .data.federate import FederationOptions

    return cfg.data.name == "files" or not FederationOptions.from_config(cfg.data).is_default()


def partitioned(cfg: RunConfig, data_dir: str | None) -> tuple[list[ClientShare], dict | None]:
    """Your own data (data.name=files) or flwr-datasets' partitioners (data.partition=iid,
    dirichlet, ...; pflalign.data.federate), and what was loaded, for results.json."""
    from .data.federate import FederationOptions

    tasks, info = load_federation_described(cfg.data.name, data_dir, cfg.data.clients, cfg.data.split_seed,
                                            cfg.data.max_train, cfg.data.max_test,
                                            FederationOptions.from_config(cfg.data))
    return [ClientShare(t.task, t.train, t.test) for t in tasks], info


def client_shares_described(cfg: RunConfig, data_dir: str | None = None,
                            which: list[int] | None = None) -> tuple[list[ClientShare], dict | None]:
    """The clients' data (`which`: only those, in that order; None: all) with the dataset read
    from `data_dir` (None: ``data.dir``), and what a partitioned federation loaded (None for
    today's one client per category); with ``data.validation`` each client is evaluated on a
    split held out of its training data instead of its test split."""
    data_dir = cfg.data.dir if data_dir is None else data_dir
    if uses_partitioner(cfg):
        shares, info = partitioned(cfg, data_dir)
        shares = shares if which is None else select(shares, which)
    else:
        shares, info = by_category(cfg, data_dir, which), None
    if cfg.data.validation is not None:
        shares = [hold_out_validation(s, cfg.data.validation, cfg.data.split_seed) for s in shares]
    return shares, info


def select(shares: list[ClientShare], which: list[int]) -> list[ClientShare]:
    """The clients `which` (in that order) of a partition's `shares`; one that is not there is a `UserError`."""
    absent = [k for k in which if not 0 <= k < len(shares)]
    if absent:
        raise UserError(f"there is no client {absent[0]}: the partition makes {len(shares)} clients (0 to "
                        f"{len(shares) - 1})")
    return [shares[k] for k in which]


def client_shares(cfg: RunConfig, data_dir: str | None = None, which: list[int] | None = None) -> list[ClientShare]:
    """`client_shares_described` without the description."""
    return client_shares_described(cfg, data_dir, which)[0]
