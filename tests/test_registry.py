"""One registry per extension point (issue 40): a dataset is its loader's `Dataset` plus one line
in `data.registry.DATASETS`, a partitioner one entry in `data.partition.PARTITIONERS`; everything
else that needs to know them (default clients, export's client names, the data cache's key, the
partition options) reads them from there. Each test adds an entry the way a newcomer would and
uses it through the code that used to hard-code the names."""

from __future__ import annotations

import pytest

from pflalign.run import data_cache
from pflalign.config import build_config
from pflalign.data import Dataset, Example, Table
from pflalign.data import partition as data_partition
from pflalign.data.partition import PARTITIONERS, Partitioner, PartitionSpec, partition
from pflalign.data.registry import DATASETS
from pflalign.errors import UserError
from pflalign.run.export import client_names as export_client_names
from pflalign.data.clients import client_names, client_shares

TASKS = ("left", "right")


def _examples(task: str, n: int) -> list[Example]:
    return [Example(f"{task} {i}?", f"{task} {i}.") for i in range(n)]


def _table(source, split_seed, max_train, max_test):
    """6 rows and 2 test rows per task, labelled by task."""
    return Table([e for t in TASKS for e in _examples(t, 6)], [t for t in TASKS for _ in range(6)],
                 [e for t in TASKS for e in _examples(f"{t} test", 2)], [t for t in TASKS for _ in range(2)])


@pytest.fixture
def toy_dataset(monkeypatch, tmp_path):
    source = tmp_path / "toy.txt"
    source.write_text("the toy dataset's one file\n")
    monkeypatch.setitem(DATASETS, "toy", Dataset(table=_table, categories=TASKS,
                                                 files=lambda path: [path] if path is not None else None))
    return source


def test_a_dataset_is_one_registry_line(toy_dataset, tmp_path):
    cfg = build_config(None, {"data": {"name": "toy", "dir": str(toy_dataset)}})
    assert client_names(cfg) == list(TASKS)  # its default clients
    shares = client_shares(cfg)  # the natural partition on its label; each client's test rows its own
    assert [s.name for s in shares] == list(TASKS)
    assert [(len(s.train), len(s.test)) for s in shares] == [(6, 2), (6, 2)]
    assert shares[1].test == _examples("right test", 2)
    assert export_client_names(tmp_path / "no-run-here", cfg) == list(TASKS)  # was a KeyError
    assert data_cache.data_files(cfg, str(toy_dataset)) == [toy_dataset]  # was None: never cached
    # the same table, other partitions: every row in one client, the table's test rows every client's
    iid = build_config(None, {"data": {"name": "toy", "partition": "iid", "num_clients": 4}})
    shares = client_shares(iid)
    assert [s.name for s in shares] == ["client_000", "client_001", "client_002", "client_003"]
    assert sum(len(s.train) for s in shares) == 12 and all(len(s.test) == 4 for s in shares)
    with pytest.raises(UserError, match="fixed columns"):  # a table's dataset has fixed columns, as Dolly/FLAN
        build_config(None, {"data": {"name": "toy", "columns": {"instruction": "q"}}})


def test_a_partitioner_is_one_entry(monkeypatch):
    """A partitioner entered in PARTITIONERS is accepted by the config and used: here Flower's
    IidPartitioner under another name gives exactly `iid`'s clients."""
    from flwr_datasets.partitioner import IidPartitioner

    monkeypatch.setitem(PARTITIONERS, "halves", Partitioner(lambda spec: IidPartitioner(spec.num_clients)))
    labels = [str(i % 3) for i in range(30)]
    got = partition(labels, PartitionSpec("halves", num_clients=2, seed=5)).partitions
    want = partition(labels, PartitionSpec("iid", num_clients=2, seed=5)).partitions
    assert [p.rows for p in got] == [p.rows for p in want]
    assert "halves" not in data_partition.LABELLED  # labelled is the entry's own flag


def test_registries_name_the_shipped_ones():
    assert list(DATASETS) == ["synthetic", "dolly", "flan", "files"]
    assert list(PARTITIONERS) == ["natural", "iid", "dirichlet", "shard", "linear", "exponential", "square"]
    assert data_partition.LABELLED == ("natural", "dirichlet", "shard")
    assert DATASETS["dolly"].categories == ("classification", "closed_qa", "information_extraction", "summarization")
    assert DATASETS["files"].table is None and DATASETS["files"].categories == ()  # your own data: read_table


def test_the_config_check_knows_every_method_by_name():
    """settings.METHOD_NAMES (checked before torch is imported) is the registry's names, in its order."""
    from pflalign.methods import METHODS
    from pflalign.settings import METHOD_NAMES

    assert METHOD_NAMES == tuple(METHODS)


def test_export_names_the_clients_of_an_unfinished_partitioned_run(tmp_path):
    """`pflalign export` of a run without results.json names its clients as the run did; at
    3308221 a hard-coded {synthetic, dolly, flan} table raised KeyError: 'files' here."""
    cfg = build_config(None, {"data": {"name": "files", "dir": "rows.csv", "partition": "iid", "num_clients": 3}})
    assert export_client_names(tmp_path, cfg) == ["client_000", "client_001", "client_002"]
