"""The Flower app on real processes, loopback only: a `flower-superlink` and
`flower-supernode`s (insecure, on 127.0.0.1), `flwr run` of this repository's
app, the tiny model. The Flower runs must equal the in-process engine: the
final global adapter (the server's checkpoint) and every client's
personalized adapter (its state file on its node). Every process started
here is killed in a `finally`, then checked to have exited, with no port left
listening. Flower is a test dependency: without it this module fails.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import flwr  # noqa: F401  (a missing Flower fails here, loudly)
import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.config import build_config
from pflalign.engine import run as run_in_process
from pflalign.flower.local import Cluster

from test_engine import TINY  # the same tiny federation as the in-process engine's tests

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 600  # seconds, one `flwr run`


def tiny(method: str) -> dict:
    return {**json.loads(json.dumps(TINY)), "method": method}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """In-process run of the tiny config (2 rounds; stopped after `rounds`), by method and overrides."""
    cache = {}

    def get(method: str, rounds: int = 2, **over) -> dict:
        key = json.dumps([method, rounds, over], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ref-{method}-{rounds}")
            results = run_in_process(build_config(None, {**tiny(method), **over}), out, progress=False,
                                     stop_after=rounds)
            metrics = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
            cache[key] = {"results": results, "metrics": metrics, **ckpt.load_checkpoint(out / ckpt.CHECKPOINT)}
        return cache[key]

    return get


# ---- the wire format and the run config (no processes) ----------------------------------------
def test_params_cross_the_wire_exactly_with_their_names():
    from flwr.app import RecordDict

    from pflalign.flower import wire

    params = {"a.lora_A.weight": torch.randn(4, 3), "a.lora_B.weight": torch.randn(3, 4)}
    for dtype in (torch.float32, torch.bfloat16):
        typed = {n: t.to(dtype) for n, t in params.items()}
        back = wire.from_record(wire.to_record(typed), dtype)
        assert list(back) == list(typed)
        assert all(back[n].dtype == dtype and torch.equal(back[n], typed[n]) for n in typed)
    content = RecordDict({**wire.pack(wire.MESSAGE, {"params": params, "delta_c": params}),
                          wire.GLOBAL: wire.to_record(params)})
    assert set(content.array_records) == {"message/params", "message/delta_c", "global"}
    assert set(wire.unpack(content, wire.MESSAGE, torch.float32)) == {"params", "delta_c"}
    assert wire.unpack(RecordDict(wire.pack(wire.MESSAGE, {})), wire.MESSAGE, torch.float32) == {}


def test_run_config_maps_to_pflalign_run_keys():
    import tomllib

    from pflalign.flower import wire

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert declared == wire.RUN_DEFAULTS
    cfg = wire.resolve_config({"config": "demo", "set": "method=scaffold lora.r=8 data.clients=arithmetic,sorting"})
    assert (cfg.method, cfg.lora.r, cfg.data.clients, cfg.rounds) == ("scaffold", 8, ["arithmetic", "sorting"], 4)
    assert wire.parse_overrides('{"lora": {"r": 2}, "rounds": 3}') == {"lora": {"r": 2}, "rounds": 3}
    assert wire.parse_overrides("data.dir='/a b/c'") == {"data": {"dir": "/a b/c"}}
    assert wire.config_from_json(wire.config_json(cfg)) == cfg
    assert wire.client_tasks(cfg) == ["arithmetic", "sorting"]
    assert wire.client_tasks(build_config(None, {"data": {"name": "flan"}})) == \
        ["coreference", "entailment", "paraphrase", "structure_to_text"]


# ---- processes -----------------------------------------------------------------------------
def make_cluster(root: Path, simulation: bool = False) -> Cluster:
    """Two clients (the tiny federation's), the model cache under `root`, one thread per process."""
    return Cluster(root, REPO, clients=2, simulation=simulation,
                   env={"PFLALIGN_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"})


def check_closed(cluster: Cluster) -> None:
    left = cluster.leftovers()
    assert not left, f"still running after close: {left}"


# ---- comparisons ------------------------------------------------------------------------------
def assert_close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for n in a:
        assert torch.allclose(a[n], b[n], atol=1e-6, rtol=0), f"{what}: {n}"


def personalized(state_dir: Path, results: dict, k: int, rounds: int) -> dict:
    saved = ckpt.load_checkpoint(state_dir / results["flower"]["experiment"] / f"client-{k}" / f"round-{rounds}.pt")
    return saved["personalized"]


def assert_matches_in_process(out: Path, state_dirs: list[Path], ref: dict) -> None:
    results = json.loads((out / ckpt.RESULTS).read_text())
    assert_close(ckpt.load_checkpoint(out / ckpt.CHECKPOINT)["global"], ref["global"], "global adapter")
    for k, state_dir in enumerate(state_dirs):
        assert_close(personalized(state_dir, results, k, 2), ref["clients"][k]["personalized"],
                     f"client {k} personalized adapter")
    assert [(c["id"], c["task"], c["n_train"], c["n_test"]) for c in results["clients"]] == \
        [(c["id"], c["task"], c["n_train"], c["n_test"]) for c in ref["results"]["clients"]]
    for mine, theirs in zip(results["clients"], ref["results"]["clients"]):
        for key in ("rouge_l_personalized", "rouge_l_global", "rouge_l_base"):
            assert mine[key] == pytest.approx(theirs[key]), key
    steps = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
    assert [(m["round"], m["client"], m["step"]) for m in steps if m["event"] == "train_step"] == \
        [(r, k, t) for r in range(2) for k in range(2) for t in range(2)]


# ---- the tests ----------------------------------------------------------------------------------
def test_deployment_engine_matches_in_process(tmp_path, reference):
    """pFLAlign, SCAFFOLD and FedSA-LoRA (the stateful methods), as three concurrent runs on
    one SuperLink and two SuperNodes, each equal to the in-process engine."""
    methods = ["pflalign", "scaffold", "fedsa-lora"]
    cluster = make_cluster(tmp_path)
    try:
        cluster.start_link()
        cluster.start_node(0)
        cluster.start_node(1)
        for method in methods:
            cluster.flwr_run({"set": json.dumps(tiny(method)), "out": str(tmp_path / method)}, f"run-{method}")
        outputs = {method: cluster.finish(f"run-{method}", RUN_TIMEOUT) for method in methods}
        for method in methods:
            out = tmp_path / method
            assert (out / ckpt.RESULTS).exists(), f"{method}:\n{outputs[method][-3000:]}"
            assert_matches_in_process(out, [cluster.state_dir(0), cluster.state_dir(1)], reference(method))
            results = json.loads((out / ckpt.RESULTS).read_text())
            assert results["method"] == method and results["flower"]["missing_clients"] == []
    finally:
        cluster.close()
    check_closed(cluster)


def wait_for_round(out: Path, rounds_done: int, proc: subprocess.Popen, timeout: float = RUN_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the round"
        try:
            if ckpt.load_checkpoint(out / ckpt.CHECKPOINT)["rounds_done"] >= rounds_done:
                return
        except (FileNotFoundError, EOFError, RuntimeError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"round {rounds_done} not checkpointed after {timeout} s")


def test_a_killed_client_node(tmp_path, reference):
    """Client 1's node dies in round 2. With min-clients=1 (the node crashes: SIGKILL) the
    round and the run finish without it; with every client required (the node is stopped:
    SIGTERM) the run stops with a clear error and a checkpoint from which the run, once the
    node is back, resumes to the in-process result."""
    cluster = make_cluster(tmp_path)
    try:
        cluster.start_link()
        cluster.start_node(0)
        cluster.start_node(1)
        config = json.dumps(tiny("pflalign"))

        # min-clients=1: the run completes with client 0 alone in round 2
        out = tmp_path / "tolerant"
        proc = cluster.flwr_run({"set": config, "out": str(out), "min-clients": 1}, "tolerant")
        wait_for_round(out, 1, proc)
        cluster.kill_node(1)
        output = cluster.finish("tolerant", RUN_TIMEOUT)
        results = json.loads((out / ckpt.RESULTS).read_text())
        assert "round 2: client 1 (sorting) is missing" in output
        assert [c["id"] for c in results["clients"]] == [0]
        assert [m["id"] for m in results["flower"]["missing_clients"]] == [1]
        assert results["flower"]["rounds_done"] == {"0": 2, "1": 1}
        rounds = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
        assert [(m["clients"], m.get("missing")) for m in rounds if m["event"] == "round"] == [([0, 1], None), ([0], [1])]

        # every client required: round 2 fails, the checkpoint after round 1 stays
        cluster.start_node(1)
        out = tmp_path / "strict"
        proc = cluster.flwr_run({"set": config, "out": str(out)}, "strict")
        wait_for_round(out, 1, proc)
        cluster.kill_node(1, crash=False)
        output = cluster.finish("strict", RUN_TIMEOUT)
        assert not (out / ckpt.RESULTS).exists()
        assert "round 2: 1 of 2 clients replied, fewer than min-clients=all; missing: client 1 (sorting)" in output
        assert "resume=true" in output
        saved = ckpt.load_checkpoint(out / ckpt.CHECKPOINT)
        assert saved["rounds_done"] == 1
        assert_close(saved["global"], reference("pflalign", rounds=1)["global"], "global adapter after round 1")

        # the checkpoint is usable: node 1 back (same state-dir), resume, the in-process result
        cluster.start_node(1)
        cluster.flwr_run({"out": str(out), "resume": True}, "resume")
        output = cluster.finish("resume", RUN_TIMEOUT)
        assert (out / ckpt.RESULTS).exists(), output[-3000:]
        assert_matches_in_process(out, [cluster.state_dir(0), cluster.state_dir(1)], reference("pflalign"))
    finally:
        cluster.close()
    check_closed(cluster)


def test_simulation_engine_matches_in_process(tmp_path, reference):
    """SCAFFOLD on the Simulation Engine (Ray), with per-round scores (eval.every) too."""
    over = {"eval": {**TINY["eval"], "every": 1, "every_max_test": 2}}
    cluster = make_cluster(tmp_path, simulation=True)
    try:
        cluster.start_link()
        out, clients = tmp_path / "out", tmp_path / "clients"
        cluster.flwr_run({"set": json.dumps({**tiny("scaffold"), **over}), "out": str(out), "client-dir": str(clients)},
                         "sim")
        output = cluster.finish("sim", RUN_TIMEOUT)
        assert (out / ckpt.RESULTS).exists(), output[-3000:]
        ref = reference("scaffold", **over)
        assert_matches_in_process(out, [clients, clients], ref)

        def round_evals(rows):
            return [(m["round"], m["client"], m["task"], m["n_test"], m["rouge_l_personalized"], m["rouge_l_global"])
                    for m in rows if m["event"] == "round_eval"]

        mine = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
        assert round_evals(mine) == round_evals(ref["metrics"]) and len(round_evals(mine)) == 4
        # SCAFFOLD's payload per round: w^r and c to each client, w_k and Δc_k back, LoRA tensors only
        from pflalign.flower import wire

        adapter = wire.to_record(ref["global"]).count_bytes()
        assert [(m["bytes_to_clients"], m["bytes_from_clients"]) for m in mine if m["event"] == "round"] == \
            [(4 * adapter, 4 * adapter)] * 2
    finally:
        cluster.close()
    check_closed(cluster)
