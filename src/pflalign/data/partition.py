"""Split one table of examples into clients with Flower Datasets' standard partitioners.

`partition(labels, spec)` takes the label (category, client id, class) of every row
and returns one `Partition(name, rows)` per client: row indices into the table,
disjoint, each client non-empty. It works on indices only, so the caller keeps
its own examples (and any test split) and the same rows can be re-used.

Partitioners (`spec.method`, the key `data.partition`), all from `flwr_datasets`:

- ``natural``: one client per distinct label (`NaturalIdPartitioner`), named by the
  label, in the order of `clients` when given, else in order of first appearance;
  rows keep table order. This is what the Dolly and FLAN federations have always been.
- ``iid``: `num_clients` equal slices (`IidPartitioner`).
- ``dirichlet``: label skew, each label's rows spread over the clients with
  proportions ~ Dir(alpha) (`DirichletPartitioner`; smaller alpha, more skew;
  draws are repeated, at most 10 times, until each client has `min_partition_size`).
- ``shard``: rows sorted by label, cut into shards, `shards_per_client` random
  shards each (`ShardPartitioner`, McMahan et al.); rows beyond the last full set
  of shards are not assigned (`Result.unassigned`).
- ``linear`` / ``exponential`` / ``square``: size skew, client i gets a share
  proportional to i+1, e^(i+1), (i+1)^2 (`LinearPartitioner`, ...).

As with `flwr_datasets.FederatedDataset`, every partitioner but ``natural`` first
shuffles the rows with `seed` (the IID and size partitioners cut the table in
order). Clients other than ``natural`` ones are named ``client_000``, ``client_001``...
`datasets` and `flwr_datasets` are imported only when a partition is made.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pflalign.data.dolly import first_line
from pflalign.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_DIRICHLET_MIN_PARTITION_SIZE = 10  # flwr_datasets.partitioner.DirichletPartitioner's default
DEFAULT_SHARDS_PER_CLIENT = 2  # McMahan et al. (2017): 2 shards of sorted labels per client


@dataclass(frozen=True)
class PartitionSpec:
    """How to partition: the `data.partition*` config keys, checked by `check_spec`."""

    method: str = "natural"
    num_clients: int | None = None
    alpha: float | None = None
    min_partition_size: int | None = None  # dirichlet: Flower's 10; others: 1 (no empty client)
    shards_per_client: int | None = None
    seed: int = 42


@dataclass(frozen=True)
class Partition:
    """One client: its name and the indices of its rows in the table."""

    name: str
    rows: list[int]


@dataclass
class Result:
    """The clients, and the rows no client got (only the shard partitioner leaves some)."""

    partitions: list[Partition]
    unassigned: list[int] = field(default_factory=list)


# ---- the partitioners: one entry each in PARTITIONERS --------------------------------------
@dataclass(frozen=True)
class Partitioner:
    """One ``data.partition`` value: the `flwr_datasets` partitioner it builds for a spec (over a
    dataset whose columns are ``label`` and ``row``), and whether it reads the label column."""

    make: Callable[[PartitionSpec], Any]
    labelled: bool = False


def _natural_partitioner(spec: PartitionSpec):
    from flwr_datasets.partitioner import NaturalIdPartitioner

    return NaturalIdPartitioner(partition_by="label")


def _iid(spec: PartitionSpec):
    from flwr_datasets.partitioner import IidPartitioner

    return IidPartitioner(num_partitions=spec.num_clients)


def _dirichlet(spec: PartitionSpec):
    from flwr_datasets.partitioner import DirichletPartitioner

    return DirichletPartitioner(
        num_partitions=spec.num_clients, partition_by="label", alpha=float(spec.alpha),
        min_partition_size=(DEFAULT_DIRICHLET_MIN_PARTITION_SIZE if spec.min_partition_size is None
                            else spec.min_partition_size),
        self_balancing=False, shuffle=True, seed=spec.seed,
    )


def _shard(spec: PartitionSpec):
    from flwr_datasets.partitioner import ShardPartitioner

    return ShardPartitioner(
        num_partitions=spec.num_clients, partition_by="label",
        num_shards_per_partition=spec.shards_per_client or DEFAULT_SHARDS_PER_CLIENT,
        keep_incomplete_shard=True, shuffle=True, seed=spec.seed,
    )


def _size_skew(name: str) -> Callable[[PartitionSpec], Any]:
    def make(spec: PartitionSpec):
        from flwr_datasets import partitioner as fp

        return getattr(fp, name)(num_partitions=spec.num_clients)

    return make


# To add a partitioner: a function building the flwr_datasets partitioner and its line here.
PARTITIONERS: dict[str, Partitioner] = {
    "natural": Partitioner(_natural_partitioner, labelled=True),  # one client per label (`_natural`)
    "iid": Partitioner(_iid),
    "dirichlet": Partitioner(_dirichlet, labelled=True),
    "shard": Partitioner(_shard, labelled=True),
    "linear": Partitioner(_size_skew("LinearPartitioner")),
    "exponential": Partitioner(_size_skew("ExponentialPartitioner")),
    "square": Partitioner(_size_skew("SquarePartitioner")),
}
LABELLED = tuple(name for name, p in PARTITIONERS.items() if p.labelled)  # partitioners that read a label column


def partition_name(pid: int) -> str:
    """The name of client `pid` of every partition but ``natural``: client_000, client_001, ..."""
    return f"client_{pid:03d}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_spec(spec: PartitionSpec) -> None:
    """Reject bad values before any data is read; each message names its config key."""
    if spec.method not in PARTITIONERS:
        close = difflib.get_close_matches(str(spec.method), PARTITIONERS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UserError(f"unknown data.partition {spec.method!r}; valid: {', '.join(PARTITIONERS)}.{hint}")
    if spec.num_clients is not None and (not _is_int(spec.num_clients) or spec.num_clients < 1):
        raise UserError(f"data.num_clients must be a positive integer, got {spec.num_clients!r}")
    if spec.method != "natural" and spec.num_clients is None:
        raise UserError(f"data.partition={spec.method} needs data.num_clients=N")
    if spec.method == "dirichlet":
        alpha = spec.alpha
        if alpha is None:
            raise UserError("data.partition=dirichlet needs data.alpha (> 0; smaller is more label skew)")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise UserError(f"data.alpha must be a finite number > 0, got {alpha!r}")
    elif spec.alpha is not None:
        raise UserError(f"data.alpha only applies to data.partition=dirichlet (partition is {spec.method})")
    if spec.min_partition_size is not None and (not _is_int(spec.min_partition_size) or spec.min_partition_size < 1):
        raise UserError(f"data.min_partition_size must be a positive integer, got {spec.min_partition_size!r}")
    if spec.shards_per_client is not None:
        if spec.method != "shard":
            raise UserError(f"data.shards_per_client only applies to data.partition=shard (partition is {spec.method})")
        if not _is_int(spec.shards_per_client) or spec.shards_per_client < 1:
            raise UserError(f"data.shards_per_client must be a positive integer, got {spec.shards_per_client!r}")
    if not _is_int(spec.seed):
        raise UserError(f"the partition seed must be an integer, got {spec.seed!r}")


def partition(
    labels: Sequence[str] | None,
    spec: PartitionSpec,
    n_rows: int | None = None,
    clients: Sequence[str] | None = None,
    label_name: str = "label",
) -> Result:
    """Partition `n_rows` rows (default `len(labels)`) into clients as `spec` says.

    `labels[i]` is row i's label, needed by natural, dirichlet and shard (else may
    be None). `clients` fixes the natural clients and their order; every label must
    be one of them. `label_name` is the column's name, for messages only.
    """
    check_spec(spec)
    if labels is not None:
        labels = [str(v) for v in labels]
        n_rows = len(labels)
    if n_rows is None:
        raise UserError("partition: neither labels nor a row count given")
    if spec.method in LABELLED and labels is None:
        raise UserError(f"data.partition={spec.method} needs a label column: set data.partition_by=COLUMN")
    if n_rows == 0:
        raise UserError("no rows to partition: the data is empty")
    if spec.method == "natural":
        result = _natural(labels, spec, clients, label_name)
    else:
        if spec.num_clients > n_rows:
            raise UserError(f"data.num_clients={spec.num_clients} is more clients than rows ({n_rows})")
        result = _flower(labels, spec, n_rows, label_name)
    _check_result(result, n_rows, spec)
    return result


def _natural(labels: list[str], spec: PartitionSpec, clients: Sequence[str] | None, label_name: str) -> Result:
    present = list(dict.fromkeys(labels))  # first appearance
    if clients is not None:
        clients = [str(c) for c in clients]
        missing = [c for c in clients if c not in present]
        if missing:
            raise UserError(f"client {missing[0]!r} has no rows: no row has {label_name} = {missing[0]!r}")
        extra = [v for v in present if v not in clients]
        if extra:
            raise UserError(f"rows with {label_name} = {extra[0]!r} belong to no client (internal: filter them first)")
        order = list(clients)
    else:
        order = present
    if spec.num_clients is not None and spec.num_clients != len(order):
        raise UserError(f"data.num_clients={spec.num_clients} but data.partition=natural makes one client per "
                        f"value of {label_name}: {len(order)} here; leave data.num_clients unset")
    partitioner = PARTITIONERS["natural"].make(spec)
    partitioner.dataset = _table(labels, list(range(len(labels))))
    by_name = {}
    with _quiet():
        for pid in range(partitioner.num_partitions):
            name = partitioner.partition_id_to_natural_id[pid]
            by_name[name] = list(partitioner.load_partition(pid)["row"])
    return Result([Partition(name, by_name[name]) for name in order])


def _flower(labels: list[str] | None, spec: PartitionSpec, n_rows: int, label_name: str) -> Result:
    n = spec.num_clients
    partitioner = PARTITIONERS[spec.method].make(spec)
    labels = labels if labels is not None else [""] * n_rows
    # The permutation `datasets.Dataset.shuffle(seed=...)` (hence FederatedDataset) applies.
    order = np.random.default_rng(spec.seed).permutation(n_rows).tolist()
    if spec.method == "shard":  # shards are runs of equal labels: sort, ties in shuffled order
        order.sort(key=lambda r: labels[r])
    partitioner.dataset = _table([labels[r] for r in order], order)
    partitions = []
    try:
        with _quiet():
            for pid in range(n):
                partitions.append(Partition(partition_name(pid), list(partitioner.load_partition(pid)["row"])))
    except (ValueError, AssertionError) as error:
        raise UserError(_flower_message(spec, label_name, n_rows, error)) from error
    assigned = {r for p in partitions for r in p.rows}
    return Result(partitions, [r for r in range(n_rows) if r not in assigned])


def _flower_message(spec: PartitionSpec, label_name: str, n_rows: int, error: BaseException) -> str:
    what = f"data.partition={spec.method} with data.num_clients={spec.num_clients} on {n_rows} rows"
    if spec.method == "dirichlet":
        what += f" (data.alpha={spec.alpha}, by {label_name})"
    return f"{what} is impossible: {first_line(error)}"


def _table(labels: list[str], rows: list[int]):
    import datasets

    return datasets.Dataset.from_dict({"label": labels, "row": rows})


@contextlib.contextmanager
def _quiet():
    """Keep the partitioners' progress bars and resampling warnings off the console (logged instead)."""
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("always")
        yield
    for w in caught:
        log.info("flwr_datasets: %s", first_line(Exception(str(w.message))))


def _check_result(result: Result, n_rows: int, spec: PartitionSpec) -> None:
    """Disjoint rows, in range, and every client at least `min_partition_size` (default 1) rows."""
    seen: set[int] = set()
    for p in result.partitions:
        for r in p.rows:
            if r in seen or not 0 <= r < n_rows:
                raise AssertionError(f"partitioner returned row {r} twice or out of range")  # a bug, not input
            seen.add(r)
    need = spec.min_partition_size or 1
    for p in result.partitions:
        if len(p.rows) < need:
            left = "empty" if not p.rows else f"with {len(p.rows)} rows"
            raise UserError(
                f"data.partition={spec.method} left client {p.name} {left} (each needs at least {need}); "
                "use fewer clients (data.num_clients), more data, or another partition"
            )


def label_skew(labels: Sequence[str], result: Result) -> float:
    """Mean total-variation distance between each client's label distribution and the whole table's.

    0 when every client has the global mix; close to 1 when clients hold labels that are
    rare overall. Used to check that Dirichlet skew grows as alpha falls.
    """
    labels = [str(v) for v in labels]
    values = sorted(set(labels))
    total = {v: 0 for v in values}
    for v in labels:
        total[v] += 1
    distances = []
    for p in result.partitions:
        counts = {v: 0 for v in values}
        for r in p.rows:
            counts[labels[r]] += 1
        distances.append(0.5 * sum(abs(counts[v] / len(p.rows) - total[v] / len(labels)) for v in values))
    return sum(distances) / len(distances)
