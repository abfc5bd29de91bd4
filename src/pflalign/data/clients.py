"""A run's clients from its config: the dataset's table, partitioned, with its test rule.

A client has a name (results, metrics and logs call it by that name) and the examples it holds
(`ClientShare`). Every federation takes one path (`pflalign.data.federate.federation`): the
dataset as a table with a label column -> a partitioner (`data.partition`; the paper's
federations are the natural partitioner on category, one client per category of ``data.clients``
or of the dataset's default clients, in that order) -> the test rule (``data.test_set``) ->
clients, then, with ``data.validation``, a validation split held out of each client's training
data. The engines, the report and the figures only see names. Every client's share is a pure
function of the config and the data, so a Flower ClientApp computes client k's share alone on its
own host (``which=[k]``) and gets what client k gets in process.
"""

from __future__ import annotations

import random

from pflalign.data import ClientShare
from pflalign.data.federate import FederationOptions, federation
from pflalign.data.partition import partition_name
from pflalign.data.registry import DATASETS
from pflalign.errors import UserError
from pflalign.settings import RunConfig

__all__ = ["ClientShare", "client_names", "client_shares", "client_shares_described", "hold_out_validation",
           "names_from_config", "select"]


def names_from_config(cfg: RunConfig) -> list[str] | None:
    """The name of every client, in client order (Flower's partition-id k is the k-th), where
    the config alone says them: ``client_000`` ... for the ``data.num_clients`` clients of every
    partition but natural, the labels of ``data.clients`` (else the dataset's default clients:
    the paper's categories, the synthetic tasks) for a natural one. None for a natural partition
    of your own files without ``data.clients`` (its clients are the values of the
    ``partition_by`` column) and with ``data.client_names=labelled`` (each name carries its
    client's most common label): known once the data is read (`client_names`)."""
    if cfg.data.client_names == "labelled":
        return None  # each name carries its client's most common label: known once the data is read
    if cfg.data.partition != "natural":
        return [partition_name(k) for k in range(cfg.data.num_clients)]
    clients = cfg.data.clients
    if clients is None and cfg.data.name in DATASETS:
        clients = DATASETS[cfg.data.name].categories or None  # the dataset's default clients, if any
    return None if clients is None else list(clients)


def client_names(cfg: RunConfig, data_dir: str | None = None) -> list[str]:
    """The name of every client, in client order (Flower's partition-id k is the k-th): from
    the config (`names_from_config`), else read off the data in `data_dir` (None: ``data.dir``)."""
    names = names_from_config(cfg)
    return names if names is not None else [s.name for s in client_shares(cfg, data_dir)]


def client_shares_described(cfg: RunConfig, data_dir: str | None = None,
                            which: list[int] | None = None) -> tuple[list[ClientShare], dict | None]:
    """The clients' data (`which`: only those, in that order; None: all) with the dataset read
    from `data_dir` (None: ``data.dir``), and what was loaded, for results.json's ``data``; with
    ``data.validation`` each client is evaluated on a split held out of its training data instead
    of its test split.

    The description is None for a dataset's natural partition on category with the default
    options (the paper's federations, the synthetic tasks): their results.json has never had a
    ``data`` entry (the committed runs' files and pins stay as they are), and the in-process
    engine takes exactly those clients' token ids from the host's cache (run/engine.py:
    ``data_info is None``)."""
    data_dir = cfg.data.dir if data_dir is None else data_dir
    options = FederationOptions.from_config(cfg.data)
    shares, info = federation(cfg.data.name, data_dir, cfg.data.clients, cfg.data.split_seed,
                              cfg.data.max_train, cfg.data.max_test, options)
    if which is not None:
        shares = select(shares, which)
    if cfg.data.validation is not None:
        shares = [hold_out_validation(s, cfg.data.validation, cfg.data.split_seed) for s in shares]
    return shares, None if cfg.data.name != "files" and options.is_default() else info


def client_shares(cfg: RunConfig, data_dir: str | None = None, which: list[int] | None = None) -> list[ClientShare]:
    """`client_shares_described` without the description."""
    return client_shares_described(cfg, data_dir, which)[0]


def select(shares: list[ClientShare], which: list[int]) -> list[ClientShare]:
    """The clients `which` (in that order) of a partition's `shares`; one that is not there is a `UserError`."""
    absent = [k for k in which if not 0 <= k < len(shares)]
    if absent:
        raise UserError(f"there is no client {absent[0]}: the partition makes {len(shares)} clients (0 to "
                        f"{len(shares) - 1})")
    return [shares[k] for k in which]


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
