"""From a table of examples to clients: partition the rows, then give each client a test set.

`federation(name, ...)` is the one path for every federation: the dataset's table
(`pflalign.data.registry`: `dolly.dolly_table`, `flan.flan_table`, `synthetic.synthetic_table`,
labelled by category; your own files by `files.read_table`, labelled by data.partition_by), then
`make_clients(table, options, ...)`: the partitioner (`pflalign.data.partition`; the paper's
federations are the natural partitioner on category, in the order of data.clients or the
dataset's default clients), then the test rule below.

Test sets (`data.test_set`):
- ``auto`` (default): the source's own test split when it has one (FLAN's
  `test.jsonl`, a `test` split of your files): with the natural partition each
  client gets the test rows of its own label, in file order (FLAN's rule); with
  any other partition the whole test split is every client's test set. A source
  without a test split: as ``per_client``.
- ``per_client``: each client holds out ceil(test_fraction x its rows), drawn by
  an RNG seeded with `f"{split_seed}:{client}"` (Dolly's rule; test first, the
  rest is training data); a source's own test split is then not used.
- ``global``: one test set for every client: the source's test split, or else
  ceil(test_fraction x all rows) drawn with `f"{split_seed}:global"` before the
  rest is partitioned.
`data.clients`, when given, keeps only rows (and test rows) with those labels;
the rows it removes are counted as dropped.
"""

from __future__ import annotations

import difflib
import logging
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from pflalign.data import ClientShare, Example
from pflalign.data.dolly import check_limit, check_unique
from pflalign.data.files import Columns, Table, read_table
from pflalign.data.partition import PartitionSpec, check_spec, partition
from pflalign.data.registry import DATASETS
from pflalign.errors import UserError

log = logging.getLogger(__name__)

TEST_SETS = ("auto", "per_client", "global")
CLIENT_NAMES = ("numbered", "labelled")  # data.client_names
DEFAULT_TEST_FRACTION = 0.1  # Dolly's ceil(10%) hold-out


@dataclass(frozen=True)
class FederationOptions:
    """The `data.*` keys of a federation: its partition, columns and test rule (see `pflalign.settings.DataConfig`)."""

    partition: PartitionSpec = field(default_factory=PartitionSpec)
    partition_by: str | None = None
    test_set: str = "auto"
    test_fraction: float = DEFAULT_TEST_FRACTION
    columns: Columns = field(default_factory=Columns)
    drop_empty: bool = False
    client_names: str = "numbered"

    @classmethod
    def from_config(cls, data: Any) -> FederationOptions:
        """From a `DataConfig` (or anything with its attributes); `data.seed` seeds the partition,
        `split_seed` when it is unset (as before `data.seed` existed)."""
        columns = data.columns
        if isinstance(columns, dict):
            columns = Columns(**columns)
        else:
            columns = Columns(columns.instruction, columns.response, columns.context)
        return cls(
            partition=PartitionSpec(data.partition, data.num_clients, data.alpha, data.min_partition_size,
                                    data.shards_per_client, partition_seed(data)),
            partition_by=data.partition_by, test_set=data.test_set, test_fraction=data.test_fraction,
            columns=columns, drop_empty=data.drop_empty, client_names=getattr(data, "client_names", "numbered"),
        )

    def is_default(self) -> bool:
        """True when these options ask for nothing but the natural partition on category with the
        source's own test rule: a registry dataset's paper clients, one per category."""
        return self == FederationOptions(PartitionSpec(seed=self.partition.seed), self.partition_by) and \
            self.partition_by in (None, "category")


def partition_seed(data: Any) -> int:
    """The partitioner's seed: ``data.seed``, else ``data.split_seed`` (the seed before ``data.seed``
    existed, so every earlier run's partition stays as it was)."""
    seed = getattr(data, "seed", None)
    return data.split_seed if seed is None else seed


def check_options(name: str, options: FederationOptions) -> None:
    """Every value that can be checked without reading data; one line each."""
    check_spec(options.partition)
    if options.test_set not in TEST_SETS:
        raise UserError(f"data.test_set must be one of {', '.join(TEST_SETS)}, got {options.test_set!r}")
    f = options.test_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0 < f < 1:
        raise UserError(f"data.test_fraction must be a number in (0, 1), got {f!r}")
    for role in ("instruction", "response", "context"):
        value = getattr(options.columns, role)
        if (value is not None or role != "context") and (not isinstance(value, str) or not value.strip()):
            raise UserError(f"data.columns.{role} must be a column name, got {value!r}")
    if options.partition_by is not None and (not isinstance(options.partition_by, str) or not options.partition_by):
        raise UserError(f"data.partition_by must be a column name, got {options.partition_by!r}")
    if options.client_names not in CLIENT_NAMES:
        raise UserError(f"data.client_names must be numbered or labelled, got {options.client_names!r}")
    if options.client_names == "labelled":
        if options.partition.method == "natural":
            raise UserError("data.client_names=labelled names a partition's clients by their most common label; "
                            "with data.partition=natural each client already is one label, named by it")
        if name == "files" and options.partition_by is None:
            raise UserError("data.client_names=labelled needs the label a name carries: set data.partition_by=COLUMN")
    dataset = DATASETS.get(name)
    if name == "files":
        if options.partition.method == "natural" and options.partition_by is None:
            raise UserError("data.partition=natural makes one client per value of a column: set "
                            "data.partition_by=COLUMN, or split the rows with e.g. data.partition=iid "
                            "data.num_clients=N")
    elif dataset is not None:  # Dolly, FLAN, synthetic: fixed columns, labelled by category
        if options.columns != Columns():
            raise UserError(f"data.columns applies to data.name=files; {name} has fixed columns")
        if options.partition_by not in (None, "category"):
            raise UserError(f"data.partition_by for {name} can only be 'category', got {options.partition_by!r}")
        if options.drop_empty:
            raise UserError(f"data.drop_empty applies to data.name=files, not {name}")


def federation(
    name: str,
    source: str | None,
    clients: list[str] | None,
    split_seed: int,
    max_train: int | None,
    max_test: int | None,
    options: FederationOptions,
) -> tuple[list[ClientShare], dict[str, Any]]:
    """Read dataset `name` as a table and make its clients (`make_clients`) from the rows whose
    label is one of `clients`; None: the dataset's default clients (the paper's categories), or,
    where it has none (your own files), every label.
    `source` is the data file or folder (None or empty: none given); for a dataset generated in
    code (synthetic) `split_seed` seeds it and `max_train`/`max_test` are its sizes."""
    check_options(name, options)
    dataset = DATASETS.get(name)
    if dataset is None:
        close = difflib.get_close_matches(name, DATASETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UserError(f"unknown federation {name!r}; valid: {', '.join(DATASETS)}.{hint}")
    source = source or None
    if dataset.table is None:  # your own files
        if not source:
            raise UserError("data.name=files needs its data: --set data.dir=FILE_OR_FOLDER (or a hub id)")
        table = read_table(source, options.columns, options.partition_by, options.drop_empty)
        label_name = options.partition_by or "label"
    else:
        table, label_name = dataset.table(source, split_seed, max_train, max_test), "category"
        if clients is None and dataset.categories:  # every partition: of the default clients' rows
            clients = list(dataset.categories)
    return make_clients(table, options, clients, split_seed, max_train, max_test, label_name)


def make_clients(
    table: Table,
    options: FederationOptions,
    clients: Sequence[str] | None,
    split_seed: int,
    max_train: int | None = None,
    max_test: int | None = None,
    label_name: str = "label",
) -> tuple[list[ClientShare], dict[str, Any]]:
    """Partition `table` as `options` says and give each client its train and test examples (the
    first `max_train`/`max_test` of each); `clients`: keep only the rows with those labels (and,
    for the natural partition, one client per label in that order)."""
    check_limit("max_train", max_train)
    check_limit("max_test", max_test)
    spec = options.partition
    dropped: Counter[str] = Counter(table.info.get("dropped", {}))
    examples, labels = table.examples, table.labels
    test_examples, test_labels = table.test_examples, table.test_labels
    if clients is not None:
        clients = [str(c) for c in clients]
        if not clients:
            raise UserError("data.clients is empty: name at least one client, or leave it unset for all")
        check_unique(clients, "client")
        if labels is None:
            raise UserError("data.clients names values of a label column: set data.partition_by=COLUMN")
        keep, present = set(clients), set(labels)
        missing = [c for c in clients if c not in present]
        if missing:
            raise UserError(absent_client(missing[0], label_name, present, table.info.get("source")))
        rows = [i for i, v in enumerate(labels) if v in keep]
        if len(rows) < len(labels):
            dropped[f"{label_name} not among the clients (data.clients)"] += len(labels) - len(rows)
        examples, labels = [examples[i] for i in rows], [labels[i] for i in rows]
        if test_examples is not None and test_labels is not None:
            test_rows = [i for i, v in enumerate(test_labels) if v in keep]
            if len(test_rows) < len(test_labels):
                dropped[f"test: {label_name} not among the clients (data.clients)"] += len(test_labels) - len(test_rows)
            test_examples, test_labels = [test_examples[i] for i in test_rows], [test_labels[i] for i in test_rows]

    mode = options.test_set
    if mode == "auto":
        mode = ("per_label" if spec.method == "natural" else "global") if test_examples is not None else "per_client"
    shared_test: list[Example] | None = None
    if mode == "global":
        if test_examples is not None:
            shared_test = list(test_examples)
        else:
            order = list(range(len(examples)))
            random.Random(f"{split_seed}:global").shuffle(order)
            n_test = _n_test(len(order), options.test_fraction)
            if n_test >= len(order):
                raise UserError(f"{len(order)} rows are too few to hold out a global test set")
            held = set(order[:n_test])
            shared_test = [examples[i] for i in order[:n_test]]
            rest = [i for i in range(len(examples)) if i not in held]
            examples = [examples[i] for i in rest]
            labels = None if labels is None else [labels[i] for i in rest]
    elif mode == "per_client" and test_examples is not None:
        dropped["test: the source's test split (data.test_set=per_client)"] += len(test_examples)

    result = partition(labels, spec, n_rows=len(examples), clients=clients, label_name=label_name)
    if result.unassigned:
        dropped[f"left over by the {spec.method} partitioner"] += len(result.unassigned)
    out: list[ClientShare] = []
    mixes: list[Counter[str]] = []  # each client's training examples by label (the mix table)
    for part in result.partitions:
        mine = [examples[i] for i in part.rows]
        if mode == "per_client":
            train, test = hold_out(mine, options.test_fraction, f"{split_seed}:{part.name}", part.name)
        elif mode == "per_label":
            train = mine
            test = [e for e, v in zip(test_examples, test_labels, strict=True) if v == part.name]
            if not test:
                raise UserError(f"client {part.name!r} has no test rows ({label_name} = {part.name!r}) "
                                "in the source's test split; use data.test_set=per_client or global")
        else:
            train, test = mine, list(shared_test)
        out.append(ClientShare(part.name, train[:max_train], test[:max_test]))
        if labels is not None:
            label_of = {id(examples[i]): labels[i] for i in part.rows}  # the examples are the rows' own objects
            mixes.append(Counter(label_of[id(e)] for e in out[-1].train))

    if options.client_names == "labelled":  # after the test hold-outs, which stay seeded by the plain name
        out = [ClientShare(f"{c.name}-{mix.most_common(1)[0][0]}" if mix else c.name, c.train, c.test)
               for c, mix in zip(out, mixes, strict=True)]
    info = {
        **{k: v for k, v in table.info.items() if k != "dropped"},
        "partition": spec.method,
        "partition_by": label_name if labels is not None else None,
        "num_clients": len(out),
        "test_set": {"per_label": "per_client (the source's test split, by label)",
                     "per_client": f"per_client (seeded {options.test_fraction:g} hold-out)",
                     "global": "global"}[mode],
        "dropped": dict(sorted(dropped.items())),
        "clients": [{"name": c.name, "n_train": len(c.train), "n_test": len(c.test),
                     **({"labels": dict(mixes[k].most_common())} if mixes else {})} for k, c in enumerate(out)],
    }
    if spec.method == "dirichlet":
        info["alpha"] = spec.alpha
    log.info("%d clients (%s partition%s), test set %s; dropped rows: %s", len(out), spec.method,
             f" by {label_name}" if labels is not None else "", info["test_set"],
             ", ".join(f"{n} ({r})" for r, n in info["dropped"].items()) or "none")
    log.info("%s", mix_table(info["clients"], info["partition_by"]))
    return out, info


def absent_client(client: str, label_name: str, present: set[str], source: str | None, shown: int = 20) -> str:
    """The message for a client of data.clients that no row has: the labels there are (the first
    `shown`, sorted), and the closest one."""
    values = sorted(present)
    listed = (", ".join(values[:shown]) + (f", ... ({len(values) - shown} more)" if len(values) > shown else "")
              if values else "none")
    close = difflib.get_close_matches(client, values, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    where = f" in {source}" if source else ""
    return f"data.clients: no example{where} has {label_name} {client!r} (values there: {listed}).{hint}"


def mix_table(clients: list[dict], label_name: str | None, rows: int = 20, top: int = 3) -> str:
    """The clients' sizes and label mixes as one text table (the first `rows` clients; the
    `top` labels of each by share of its training examples, counted after the test hold-out and
    data.max_train: what it trains on). flwr-datasets' `compute_counts` counts a partitioner's
    partitions, before those cuts, so the counts are taken here."""
    width = max([len("client")] + [len(c["name"]) for c in clients[:rows]])
    head = f"{'client':<{width}}  {'n_train':>7}  {'n_test':>6}" + (f"  {label_name} mix (share of n_train)"
                                                                    if label_name else "")
    lines = [head]
    for c in clients[:rows]:
        line = f"{c['name']:<{width}}  {c['n_train']:>7}  {c['n_test']:>6}"
        mix = c.get("labels")
        if mix:
            shown = [f"{label} {100 * n / c['n_train']:.0f}%" for label, n in list(mix.items())[:top]]
            more = len(mix) - top
            line += "  " + ", ".join(shown) + (f", +{more} more" if more > 0 else "")
        lines.append(line.rstrip())
    if len(clients) > rows:
        lines.append(f"... {len(clients) - rows} more clients (results.json: data.clients)")
    return "\n".join(lines)


def _n_test(n: int, fraction: float) -> int:
    """ceil(fraction x n), exactly: 0.1 x 2140 is 214, not the 215 floating point would give."""
    return math.ceil(Fraction(repr(fraction)) * n)


def hold_out(examples: list[Example], fraction: float, seed: str, name: str) -> tuple[list[Example], list[Example]]:
    """Shuffle with `random.Random(seed)`; the first ceil(fraction x n) are the test set (Dolly's rule)."""
    shuffled = list(examples)
    random.Random(seed).shuffle(shuffled)
    n_test = _n_test(len(shuffled), fraction)
    if n_test >= len(shuffled):
        raise UserError(f"client {name!r} has {len(shuffled)} rows: too few to hold out a test set "
                        f"(data.test_fraction={fraction:g}) and keep training data")
    return shuffled[n_test:], shuffled[:n_test]
