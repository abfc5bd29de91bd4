"""The clients of every preset, pinned (issue 59): whatever path builds them, each preset's
federation keeps its clients' names, order, sizes and examples (a sha256 over each client's train
and test examples, in order), so that unifying the two paths from data to clients cannot move a
committed result. tests/federation_pins.json holds the pins; ``PFLALIGN_WRITE_FEDERATION_PINS=1``
rewrites it (only when a change of the clients is meant, and said in the commit).

Each preset is built on the data a user would run it on: the embedded synthetic tasks, and the
real Dolly and FLAN files of ../shared/data (`shared_data`), with the paper's split seed; plus the
table path's variants over the same data (FLAN's natural partition named explicitly, a Dolly
Dirichlet split, the validation hold-out)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from pflalign.config import build_config
from pflalign.partition import client_shares, partitioned

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
    # "-by-table": the same config through the table path (data/federate.py: table → natural
    # partition on category → test rule), which today serves only other partitions and your files
    shares = partitioned(cfg, cfg.data.dir)[0] if name.endswith("-by-table") else client_shares(cfg)
    return [{"name": s.name, "n_train": len(s.train), "n_test": len(s.test), "train": _digest(s.train),
             "test": _digest(s.test)} for s in shares]


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
    """Dolly's and FLAN's paper presets through the table path give the clients of today's
    per-category path: the two paths agree, so one can go (issue 59)."""
    pins = json.loads(PINS.read_text())
    assert pins["flan-paper-by-table"] == pins["flan-paper"]
    assert pins["dolly-paper-by-table"] == pins["dolly-paper"]
