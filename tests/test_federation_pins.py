"""The clients of every preset, pinned (issue 59): whatever path builds them, each preset's
federation keeps its clients' names, order, sizes and examples (a sha256 over each client's train
and test examples, in order), so that unifying the two paths from data to clients cannot move a
committed result. tests/federation_pins.json holds the pins; ``PFLALIGN_WRITE_FEDERATION_PINS=1``
rewrites it (only when a change of the clients is meant, and said in the commit).

Each preset is built on the data a user would run it on: the embedded synthetic tasks, and the
real Dolly and FLAN files of ../shared/data (`shared_data`), with the paper's split seed; plus
variants over the same data (two FLAN categories, a Dolly Dirichlet split, the validation
hold-out). The "-by-table" entries spell the path out without the config (the dataset's table →
the natural partitioner on category, in the paper's client order → the default test rule); until
issue 59 they were the second of two paths, now they check that a run's clients
(`pflalign.data.clients`) are exactly that composition."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from pflalign.config import build_config
from pflalign.data.clients import client_shares
from pflalign.data.federate import FederationOptions, make_clients
from pflalign.data.registry import DATASETS

PINS = Path(__file__).with_name("federation_pins.json")

# name → (preset, data file or folder under shared/data (None: none), overrides)
FEDERATIONS = {
    "demo": ("demo", None, {}),
    "synthetic-default": (None, None, {"data": {"name": "synthetic"}}),
    "flan-paper": ("flan-paper", "flan", {}),
    "flan-paper-by-table": ("flan-paper", "flan", {}),
    "flan-two-categories": ("flan-paper", "flan", {"data": {"clients": ["paraphrase", "coreference"]}}),
    "flan-validation": ("flan-paper", "flan", {"data": {"validation": 50}}),
    "dolly-paper": ("dolly-paper", "dolly/databricks-dolly-15k.jsonl", {}),
    "dolly-paper-by-table": ("dolly-paper", "dolly/databricks-dolly-15k.jsonl", {}),
    "dolly-dirichlet": ("dolly-paper", "dolly/databricks-dolly-15k.jsonl",
                        {"data": {"partition": "dirichlet", "num_clients": 6, "alpha": 0.5, "min_partition_size": 20}}),
}


def _digest(examples) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.prompt, e.response, e.messages], ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def federation(name: str, shared_data: Path) -> list[dict]:
    preset, data, overrides = FEDERATIONS[name]
    if data is not None:
        overrides = {**overrides, "data": {**overrides.get("data", {}), "dir": str(shared_data / data)}}
    cfg = build_config(preset, overrides)
    shares = by_table(cfg) if name.endswith("-by-table") else client_shares(cfg)
    return [{"name": s.name, "n_train": len(s.train), "n_test": len(s.test), "train": _digest(s.train),
             "test": _digest(s.test)} for s in shares]


def by_table(cfg):
    """The paper's clients composed by hand: the dataset's table, the natural partitioner on
    category in the paper's client order, the default test rule (data/federate.py)."""
    dataset = DATASETS[cfg.data.name]
    table = dataset.table(cfg.data.dir, cfg.data.split_seed, None, None)
    return make_clients(table, FederationOptions(), list(dataset.categories), cfg.data.split_seed,
                        label_name="category")[0]


@pytest.mark.parametrize("name", list(FEDERATIONS))
def test_every_presets_clients_are_pinned(name, shared_data):
    got = federation(name, shared_data)
    if os.environ.get("PFLALIGN_WRITE_FEDERATION_PINS"):
        pins = json.loads(PINS.read_text()) if PINS.exists() else {}
        pins[name] = got
        PINS.write_text(json.dumps(dict(sorted(pins.items())), indent=1) + "\n")
    pins = json.loads(PINS.read_text())
    assert got == pins[name]


def test_the_table_path_gives_the_per_category_clients():
    """Dolly's and FLAN's paper presets give the clients of the table composed by hand (and, by the
    pins, those of the per-category loaders that issue 59 removed)."""
    pins = json.loads(PINS.read_text())
    assert pins["flan-paper-by-table"] == pins["flan-paper"]
    assert pins["dolly-paper-by-table"] == pins["dolly-paper"]
