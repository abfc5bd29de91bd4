"""pflalign.data.partition: Flower Datasets' partitioners on a table of labelled rows."""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("flwr_datasets")

from pflalign.data.partition import PARTITIONERS, PartitionSpec, label_skew, partition  # noqa: E402
from pflalign.errors import UserError  # noqa: E402


def _labels(n: int = 1000, k: int = 10, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"label{rng.randrange(k)}" for _ in range(n)]


SPECS = {
    "natural": PartitionSpec("natural"),
    "iid": PartitionSpec("iid", num_clients=7, seed=3),
    "dirichlet": PartitionSpec("dirichlet", num_clients=8, alpha=0.5, seed=3),
    "shard": PartitionSpec("shard", num_clients=5, shards_per_client=2, seed=3),
    "linear": PartitionSpec("linear", num_clients=6, seed=3),
    "exponential": PartitionSpec("exponential", num_clients=4, seed=3),
    "square": PartitionSpec("square", num_clients=5, seed=3),
}


def test_every_partitioner_is_tested():
    assert set(SPECS) == set(PARTITIONERS)


@pytest.mark.parametrize("method", PARTITIONERS)
def test_partitions_are_disjoint_nonempty_and_cover_the_data(method):
    labels = _labels()
    result = partition(labels, SPECS[method])
    rows = [r for p in result.partitions for r in p.rows]
    assert len(rows) == len(set(rows)), "a row is in two clients"
    assert sorted(rows + result.unassigned) == list(range(len(labels)))
    assert result.unassigned == [], "these sizes leave no row unassigned"
    assert all(p.rows for p in result.partitions)
    names = [p.name for p in result.partitions]
    assert len(names) == len(set(names))
    if method != "natural":
        assert names == [f"client_{i:03d}" for i in range(SPECS[method].num_clients)]


@pytest.mark.parametrize("method", [m for m in PARTITIONERS if m != "natural"])
def test_same_seed_same_partition_other_seed_other_partition(method):
    labels = _labels()
    spec = SPECS[method]
    first = partition(labels, spec)
    assert partition(labels, spec) == first
    other = partition(labels, PartitionSpec(**{**spec.__dict__, "seed": spec.seed + 1}))
    assert other.partitions != first.partitions


def test_natural_partition_one_client_per_label_in_first_appearance_or_given_order():
    labels = ["b", "a", "b", "c", "a", "b"]
    result = partition(labels, PartitionSpec("natural"))
    assert [(p.name, p.rows) for p in result.partitions] == [("b", [0, 2, 5]), ("a", [1, 4]), ("c", [3])]
    given = partition(labels, PartitionSpec("natural"), clients=["c", "a", "b"])
    assert [(p.name, p.rows) for p in given.partitions] == [("c", [3]), ("a", [1, 4]), ("b", [0, 2, 5])]
    assert partition([3, 1, 3], PartitionSpec("natural")).partitions[0].name == "3"  # CSV integer labels


def test_dirichlet_label_skew_grows_as_alpha_falls():
    """Mean total-variation distance of each client's label mix from the global one, 20 clients, 2000 rows."""
    labels = _labels(2000, 10, seed=1)
    skew = {alpha: label_skew(labels, partition(labels, PartitionSpec("dirichlet", 20, alpha=alpha, seed=0)))
            for alpha in (100.0, 1.0, 0.1)}
    print("dirichlet label skew (mean TV distance):", skew)
    assert skew[100.0] < skew[1.0] < skew[0.1]
    assert skew[100.0] < 0.1 and skew[0.1] > 0.5  # measured: 0.04, 0.32, 0.69 (see the report)
    iid = label_skew(labels, partition(labels, PartitionSpec("iid", 20, seed=0)))
    assert iid < skew[1.0]


def test_shard_partition_gives_each_client_few_labels():
    labels = _labels(1000, 10)
    result = partition(labels, PartitionSpec("shard", 5, shards_per_client=2, seed=0))
    assert all(len({labels[r] for r in p.rows}) <= 4 for p in result.partitions)


def test_size_skew_partitioners_grow_client_sizes():
    labels = _labels(1000)
    for method in ("linear", "exponential", "square"):
        sizes = [len(p.rows) for p in partition(labels, PartitionSpec(method, 4, seed=0)).partitions]
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1], (method, sizes)


@pytest.mark.parametrize("alpha", [0, -1.0, math.nan, math.inf, True])
def test_bad_alpha_is_a_clear_error(alpha):
    with pytest.raises(UserError, match="data.alpha must be a finite number > 0"):
        partition(_labels(), PartitionSpec("dirichlet", 4, alpha=alpha))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (PartitionSpec("iid", num_clients=11), r"data.num_clients=11 is more clients than rows \(10\)"),
        (PartitionSpec("dirichlet", num_clients=3), "needs data.alpha"),
        (PartitionSpec("iid"), "needs data.num_clients"),
        (PartitionSpec("iid", num_clients=0), "data.num_clients must be a positive integer"),
        (PartitionSpec("iid", num_clients=2, alpha=1.0), "data.alpha only applies to data.partition=dirichlet"),
        (PartitionSpec("dirichet", num_clients=2), "unknown data.partition 'dirichet'.*Did you mean 'dirichlet'"),
        (PartitionSpec("natural", num_clients=3), "one client per value of label: 2 here"),
        (PartitionSpec("iid", num_clients=2, min_partition_size=0), "data.min_partition_size must be a positive"),
        (PartitionSpec("iid", num_clients=2, shards_per_client=2), "data.shards_per_client only applies"),
        (PartitionSpec("iid", num_clients=2, min_partition_size=6), "left client client_000 with 5 rows"),
    ],
)
def test_bad_values_are_clear_errors(spec, match):
    with pytest.raises(UserError, match=match) as info:
        partition(["a", "b"] * 5, spec)
    assert "\n" not in str(info.value)


def test_a_client_left_empty_is_an_error():
    with pytest.raises(UserError, match="left client client_000 empty|partitions sizes that are not greater than 0"):
        partition(_labels(30), PartitionSpec("exponential", num_clients=10))


def test_impossible_dirichlet_min_size_is_an_error():
    with pytest.raises(UserError, match=r"data.partition=dirichlet .* is impossible: The max number of attempts"):
        partition(_labels(100), PartitionSpec("dirichlet", 10, alpha=0.05, min_partition_size=9, seed=0))


def test_labelled_partitioners_need_labels():
    with pytest.raises(UserError, match="needs a label column: set data.partition_by"):
        partition(None, PartitionSpec("dirichlet", 2, alpha=1.0), n_rows=10)
    assert len(partition(None, PartitionSpec("iid", 2), n_rows=10).partitions) == 2


def test_natural_clients_must_exist():
    with pytest.raises(UserError, match="client 'z' has no rows: no row has category = 'z'"):
        partition(["a", "b"], PartitionSpec("natural"), clients=["a", "z"], label_name="category")
