"""Issue 21 on Flower: any partition, many clients.

* A ClientApp (partition-id k of N) computes client k's share alone, on its own host, and
  gets exactly client k's examples of the in-process engine, in the same order (Dirichlet
  and IID partitions of a small local file), from the data cache the second time.
* The server's `Nodes`: one batch of queries for all new SuperNodes; it waits for the clients
  a round samples, not for all N; a sampled client without a SuperNode is missing; a
  SuperNode whose partition-id / num-partitions does not fit the run is refused.
* What a message carries does not grow with N.
* A 2-round Simulation Engine run of a Dirichlet partition with participation < 1 ends
  with the in-process run's global adapter, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("flwr_datasets")

from flwr.app import ConfigRecord, Context, RecordDict  # noqa: E402

from pflalign import checkpoint as ckpt  # noqa: E402
from pflalign.config import build_config  # noqa: E402
from pflalign.run.engine import Federation  # noqa: E402
from pflalign.errors import UserError  # noqa: E402
from pflalign.flower import client_app, nodes as nodes_module, wire  # noqa: E402
from pflalign.flower.strategy import MethodStrategy  # noqa: E402
from pflalign.run.lifecycle import sample_clients  # noqa: E402
from pflalign.methods import method_class  # noqa: E402
from pflalign.run.server import Server  # noqa: E402

from test_engine import TINY  # noqa: E402
from test_workers import one_thread_run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def rows_file(folder: Path, n: int = 48) -> Path:
    """A small local file: n rows, 3 labels."""
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"question {i}: {i} plus {i % 7}?", "response": f"{i + i % 7}",
                                        "topic": "abc"[i % 3]}) + "\n" for i in range(n)))
    return path


def partition_config(path: Path, partition: dict, **over) -> dict:
    cfg = json.loads(json.dumps(TINY))
    cfg["data"] = {"name": "files", "dir": str(path), "partition_by": "topic", "max_test": 2, **partition}
    return {**cfg, **over}


DIRICHLET = {"partition": "dirichlet", "num_clients": 4, "alpha": 1.0, "min_partition_size": 4}
IID = {"partition": "iid", "num_clients": 4, "test_set": "global"}


def context(k: int, n: int) -> Context:
    return Context(run_id=1, node_id=100 + k, node_config={"partition-id": k, "num-partitions": n}, state=RecordDict(),
                   run_config={})


@pytest.mark.parametrize("partition", [DIRICHLET, IID], ids=["dirichlet", "iid"])
def test_a_clientapp_holds_exactly_its_in_process_share(tmp_path, monkeypatch, partition):
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(client_app, "_CACHE", {})
    monkeypatch.setattr(client_app, "_CLIENTS", client_app.OrderedDict())
    cfg = build_config(None, partition_config(rows_file(tmp_path), partition))
    fed = Federation(cfg, progress=False)
    assert [c.name for c in fed.clients] == wire.client_names(cfg) == [f"client_00{k}" for k in range(4)]
    for load in ("computed", "from the data cache"):
        client_app._CACHE.clear()  # a fresh ClientApp process
        client_app._CLIENTS.clear()
        for k, theirs in enumerate(fed.clients):
            _, mine = client_app.build_client(cfg, context(k, 4))
            assert (mine.id, mine.name) == (k, theirs.name), load
            assert mine.data.train == theirs.data.train and mine.data.test == theirs.data.test, load
            assert mine.train == theirs.train, load  # the token ids too
    assert len(list((tmp_path / "cache" / "tokenized").iterdir())) == 4


def test_a_process_keeps_only_its_most_recent_clients_data(tmp_path, monkeypatch):
    """A Simulation Engine actor serves any of N clients: it holds the data of the
    MAX_CLIENTS_PER_PROCESS it served last, not of all N, and one it dropped comes back equal."""
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(client_app, "_CACHE", {})
    monkeypatch.setattr(client_app, "_CLIENTS", client_app.OrderedDict())
    monkeypatch.setattr(client_app, "MAX_CLIENTS_PER_PROCESS", 3)
    cfg = build_config(None, partition_config(rows_file(tmp_path), {**IID, "num_clients": 6}))
    first = {}
    for k in (0, 1, 2, 3, 1, 4):
        _, client = client_app.build_client(cfg, context(k, 6))
        first.setdefault(k, client)
    held = sorted(c.id for c in client_app._CLIENTS.values())
    assert held == [1, 3, 4]  # 1 was used again after 2 and 3, so 0 and 2 went
    _, again = client_app.build_client(cfg, context(0, 6))
    assert again.train == first[0].train and again.data.test == first[0].data.test
    assert [c.id for c in client_app._CLIENTS.values()] == [1, 4, 0]  # least recently served (3) went


def test_a_clientapp_that_does_not_fit_the_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(client_app, "_CACHE", {})
    path = rows_file(tmp_path)
    cfg = build_config(None, partition_config(path, DIRICHLET))
    for k, n in ((4, 4), (1, 5), (-1, 4)):
        with pytest.raises(UserError, match=rf"partition-id={k} num-partitions={n} does not fit the run's 4 clients "
                                            r"\(client_000, client_001, client_002, client_003\)"):
            client_app.build_client(cfg, context(k, n))
    # a natural partition of a file by a column, its clients not named in the config: the data says how many
    natural = build_config(None, partition_config(path, {}))
    assert wire.client_names(natural) == ["a", "b", "c"]
    with pytest.raises(UserError, match="there is no client 3: the partition makes 3 clients"):
        client_app.build_client(natural, context(3, 4))


def test_labelled_client_names_are_read_off_the_data_by_server_and_clientapp(tmp_path, monkeypatch):
    """data.client_names=labelled: the names carry each client's most common label, so the
    ServerApp reads them off the data, and a ClientApp's client is the engine's client k."""
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(client_app, "_CACHE", {})
    path = rows_file(tmp_path)
    cfg = build_config(None, partition_config(path, {**DIRICHLET, "client_names": "labelled"}))
    names = wire.client_names(cfg)
    assert names == [c.name for c in Federation(cfg, progress=False).clients]
    assert [n.split("-", 1)[0] for n in names] == [f"client_00{k}" for k in range(4)] and all("-" in n for n in names)
    assert client_app.build_client(cfg, context(2, 4))[1].name == names[2]
    missing = build_config(None, partition_config(tmp_path / "absent.jsonl", {**DIRICHLET, "client_names": "labelled"}))
    with pytest.raises(UserError, match="names the clients of data.client_names=labelled .* by reading data.dir"):
        wire.client_names(missing)


# ---- the server: which SuperNode is which client ------------------------------------------------
class FakeGrid:
    """SuperNodes that answer the query with their node config; `appear[node]`: how many looks
    (get_node_ids calls) before that node is there."""

    def __init__(self, nodes: dict[int, tuple[int, int]], appear: dict[int, int] | None = None):
        self.nodes, self.appear = nodes, appear or {}
        self.looks, self.pushes, self.queried = 0, 0, []

    def get_node_ids(self):
        self.looks += 1
        return [n for n in self.nodes if self.appear.get(n, 0) < self.looks]

    def send_and_receive(self, messages, timeout=None):
        self.pushes += 1
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.queried.append(node)
            k, n = self.nodes[node]
            replies.append(SimpleNamespace(has_error=lambda: False, metadata=SimpleNamespace(src_node_id=node),
                                           content={"info": {"partition-id": k, "num-partitions": n}}))
        return replies


@pytest.fixture
def no_sleep(monkeypatch):
    """No waiting between looks, and the task identity Flower sets in a ServerApp process (messages need it)."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(nodes_module.time, "sleep", lambda s: None)
    for key, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, key, value)


def many(n: int, participation: float, **data) -> object:
    cfg = json.loads(json.dumps(TINY))
    cfg["data"] = {"name": "dolly", "partition": "iid", "num_clients": n, **data}
    return build_config(None, {**cfg, "method": "fedavg", "participation": participation, "eval": {"clients": 3}})


def make_strategy(tiny_llama, cfg, **kw) -> MethodStrategy:
    server = Server(method_class(cfg.method)(), tiny_llama.get_lora(), len(wire.client_names(cfg)))
    return MethodStrategy(server, cfg, experiment="t", **kw)


def test_the_server_asks_100_new_supernodes_at_once_and_waits_only_for_the_sampled(tiny_llama, no_sleep):
    from pflalign.run.lifecycle import eval_clients

    cfg = many(100, 0.1)
    first, scored = sample_clients(100, 0.1, cfg.seed, 0), eval_clients(100, 3, cfg.seed)
    assert len(first) == 10
    late = [k for k in range(100) if k not in first + scored][:5]  # never needed: never waited for
    grid = FakeGrid({1000 + k: (k, 100) for k in range(100)},
                    appear={1000 + k: 10**6 for k in late} | {1000 + first[0]: 3})  # one sampled node comes late
    strategy = make_strategy(tiny_llama, cfg, connect_timeout=3600)
    assert strategy.connect(grid, strategy.clients_of_round(0)) == {}
    assert grid.looks == 4  # it waited for the late sampled node, and stopped once it was there
    assert grid.pushes == 2 and len(grid.queried) == 95  # all but that one in one batch, then that one
    assert sorted(strategy.nodes.of) == sorted(set(range(100)) - set(late))
    messages = strategy.configure_train(1, wire.to_record(strategy.server.global_params), ConfigRecord(), grid)
    assert sorted(strategy.nodes.of[k] for k in first) == sorted(m.metadata.dst_node_id for m in messages)
    # the final evaluation: the seeded sample of eval.clients, as in process
    messages = strategy.configure_evaluate(3, wire.to_record(strategy.server.global_params), ConfigRecord(), grid)
    assert [m.metadata.dst_node_id for m in messages] == [1000 + k for k in scored]


def test_a_sampled_client_without_a_supernode_is_missing_after_connect_timeout(tiny_llama, no_sleep):
    cfg = many(10, 0.5)
    chosen = sample_clients(10, 0.5, cfg.seed, 0)
    absent = chosen[0]
    grid = FakeGrid({1000 + k: (k, 10) for k in range(10) if k != absent})
    strategy = make_strategy(tiny_llama, cfg, connect_timeout=0)
    strategy.configure_train(1, wire.to_record(strategy.server.global_params), ConfigRecord(), grid)
    assert list(strategy._unreached) == [absent]
    assert "no SuperNode with partition-id" in strategy._unreached[absent]
    gone = chosen[1]  # a client that was connected and is gone: missing at once
    del grid.nodes[1000 + gone]
    assert strategy.connect(grid, [gone]) == {gone: "its SuperNode is not connected"}


@pytest.mark.parametrize("k,n", [(3, 5), (4, 4)])
def test_a_supernode_that_does_not_fit_the_run_is_refused(tiny_llama, no_sleep, k, n):
    cfg = many(4, 1.0)
    grid = FakeGrid({1000: (0, 4), 1001: (k, n)})
    strategy = make_strategy(tiny_llama, cfg)
    with pytest.raises(UserError, match=rf"SuperNode 1001 has partition-id={k} num-partitions={n}, but the run has "
                                        r"4 clients \(client_000, .*num-supernodes=4"):
        strategy.connect(grid, [0])


def test_what_a_message_carries_does_not_grow_with_the_clients(tiny_llama, no_sleep):
    """The run's configuration (about 1 kB) and the client's counters: the same bytes with 4 and
    with 100 clients but for the digits of data.num_clients."""
    sizes = {}
    for n in (4, 100):
        cfg = many(n, 0.1)
        strategy = make_strategy(tiny_llama, cfg)
        grid = FakeGrid({1000 + k: (k, n) for k in range(n)})
        messages = list(strategy.configure_train(1, wire.to_record(strategy.server.global_params), ConfigRecord(), grid))
        assert len(messages) == max(1, round(0.1 * n))
        sizes[n] = {m.content["config"].count_bytes() for m in messages}
    (four,), (hundred,) = sizes[4], sizes[100]
    assert 0 <= hundred - four <= 2 and four < 2000, sizes


# ---- the Simulation Engine ----------------------------------------------------------------------
def test_a_partitioned_simulation_equals_in_process_bit_for_bit(tmp_path):
    """A Dirichlet partition of a local file into 4 clients, 2 sampled a round (participation
    0.5), 2 rounds, 3 clients scored (eval.clients): the Simulation Engine's final global
    adapter, and each scored client's results, are the in-process run's."""
    from pflalign.flower.cluster import Cluster

    config = partition_config(rows_file(tmp_path), DIRICHLET, method="pflalign", participation=0.5,
                              eval={**TINY["eval"], "clients": 3, "base_model": False})
    ref = tmp_path / "ref"
    # float results depend on the thread count: the reference with the one thread the actor has
    reference = one_thread_run(build_config(None, config), ref)
    cluster = Cluster(tmp_path, REPO, clients=4, simulation=True, runtime_cpus=1,
                      env={"PFLALIGN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    try:
        cluster.start_link()
        out = tmp_path / "out"
        cluster.flwr_run({"set": json.dumps(config), "out": str(out), "client-dir": str(tmp_path / "clients")}, "sim")
        output = cluster.finish("sim", 600)
    finally:
        cluster.close()
    assert not cluster.leftovers()
    assert (out / ckpt.RESULTS).exists(), output[-3000:]
    mine, theirs = ckpt.load_checkpoint(out / ckpt.CHECKPOINT)["global"], ckpt.load_checkpoint(ref / ckpt.CHECKPOINT)["global"]
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
    results = json.loads((out / ckpt.RESULTS).read_text())
    assert [(c["id"], c["task"], c["n_train"], c["n_test"], c["rouge_l_personalized"]) for c in results["clients"]] \
        == [(c["id"], c["task"], c["n_train"], c["n_test"], c["rouge_l_personalized"]) for c in reference["clients"]]
    assert results["clients_in_federation"] == reference["clients_in_federation"] == 4
    rounds = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
    ref_rounds = [json.loads(line) for line in (ref / ckpt.METRICS).read_text().splitlines()]
    assert [m["clients"] for m in rounds if m["event"] == "round"] == \
        [m["clients"] for m in ref_rounds if m["event"] == "round"] == [sample_clients(4, 0.5, 0, r) for r in range(2)]
