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
import re
import subprocess
import time
from pathlib import Path

import flwr  # noqa: F401  (a missing Flower fails here, loudly)
import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.run.client_store import client_records
from pflalign.config import build_config
from pflalign.flower.cluster import Cluster

from test_engine import TINY  # the same tiny federation as the in-process engine's tests
from test_workers import one_thread_run

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 600  # seconds, one `flwr run`


def tiny(method: str) -> dict:
    return {**json.loads(json.dumps(TINY)), "method": method}


def _with_clients(out: Path) -> dict:
    """An in-process run's checkpoint with every client's record under "clients" (in clients/ since issue 21)."""
    payload = ckpt.load_checkpoint(out / ckpt.CHECKPOINT)
    return {**payload, "clients": client_records(out, payload)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """In-process run of the tiny config (2 rounds; stopped after `rounds`), by method and overrides."""
    cache = {}

    def get(method: str, rounds: int = 2, **over) -> dict:
        key = json.dumps([method, rounds, over], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ref-{method}-{rounds}")
            # one thread, as each Flower app has (OMP_NUM_THREADS=1): on some CPUs a thread count
            # changes a float result's last bits (seen on an AMD EPYC host, 2026-11-27)
            results = one_thread_run(build_config(None, {**tiny(method), **over}), out, stop_after=rounds)
            metrics = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
            cache[key] = {"results": results, "metrics": metrics, "out": out,
                          **_with_clients(out)}
        return cache[key]

    return get


# ---- the wire format and the run config (no processes) ----------------------------------------
def test_params_cross_the_wire_exactly_with_their_names():
    from flwr.app import RecordDict

    from pflalign.flower import wire

    params = {"a.lora_A.weight": torch.randn(4, 3), "a.lora_B.weight": torch.randn(3, 4)}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        typed = {n: t.to(dtype) for n, t in params.items()}
        record = wire.to_record(typed)
        assert len(record) == 1  # one flat array per group (see wire.py: Flower sends each Array as an object)
        back = wire.from_record(record, dtype)
        assert list(back) == list(typed)
        assert all(back[n].dtype == dtype and torch.equal(back[n], typed[n]) for n in typed)
        as_sent = wire.from_record(record, None)  # the server's view: bfloat16 arrives as float32
        assert all(as_sent[n].dtype == wire.wire_dtype(dtype) and torch.equal(as_sent[n].to(dtype), typed[n])
                   for n in typed)
    content = RecordDict({**wire.pack(wire.MESSAGE, {"params": params, "delta_c": params}),
                          wire.GLOBAL: wire.to_record(params)})
    assert set(content.array_records) == {"message/params", "message/delta_c", "global"}
    assert set(wire.unpack(content, wire.MESSAGE, torch.float32)) == {"params", "delta_c"}
    assert wire.unpack(RecordDict(wire.pack(wire.MESSAGE, {})), wire.MESSAGE, torch.float32) == {}



def test_the_flat_array_keeps_the_norm_and_sums_elementwise_and_bad_layouts_are_refused():
    """What Flower's fixedclipping_mod and secaggplus_mod see (one array: the norm over all
    tensors; element-wise sums), and what a malformed record from a client gets: `LayoutError`."""
    import numpy as np
    from flwr.app import Array, ArrayRecord

    from pflalign.flower import wire

    a = {"x.lora_A.weight": torch.randn(4, 3), "x.lora_B.weight": torch.randn(3, 4)}
    b = {n: torch.randn_like(t) for n, t in a.items()}
    (ka, fa), = wire.to_record(a).items()
    (kb, fb), = wire.to_record(b).items()
    assert ka == kb  # same layout, same name: a reply's params match the global record they answer
    norm = torch.sqrt(sum((t.double() ** 2).sum() for t in a.values()))
    assert np.isclose(np.linalg.norm(fa.numpy().astype(np.float64)), float(norm), rtol=1e-12)
    summed = wire.from_record(ArrayRecord({ka: Array(fa.numpy() + fb.numpy())}), None)
    assert all(torch.equal(summed[n], a[n] + b[n]) for n in a)
    flat = fa.numpy()
    bad = {"too short": ArrayRecord({ka: Array(flat[:-1])}),
           "float64": ArrayRecord({ka: Array(flat.astype(np.float64))}),
           "two arrays": ArrayRecord({ka: Array(flat), "y": Array(flat)}),
           "not a layout": ArrayRecord({"x.lora_A.weight": Array(flat)}),
           "duplicate names": ArrayRecord({'[["x",[12],"float32"],["x",[12],"float32"]]': Array(flat)}),
           "negative shape": ArrayRecord({'[["x",[-24],"float32"]]': Array(flat)}),
           "unknown dtype": ArrayRecord({'[["x",[24],"int64"]]': Array(flat)})}
    for case, record in bad.items():
        with pytest.raises(wire.LayoutError):
            wire.from_record(record, None)
    with pytest.raises(TypeError):
        wire.to_record({"x": torch.zeros(2, dtype=torch.float64)})  # float32 cannot hold it exactly

def test_run_config_maps_to_pflalign_run_keys():
    import tomllib

    from pflalign.flower import wire
    from pflalign.data.clients import client_names

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert declared == wire.RUN_DEFAULTS
    cfg = wire.resolve_config({"config": "demo", "set": "method=scaffold lora.r=8 data.clients=arithmetic,sorting"})
    assert (cfg.method, cfg.lora.r, cfg.data.clients, cfg.rounds) == ("scaffold", 8, ["arithmetic", "sorting"], 4)
    assert wire.parse_overrides('{"lora": {"r": 2}, "rounds": 3}') == {"lora": {"r": 2}, "rounds": 3}
    assert wire.parse_overrides("data.dir='/a b/c'") == {"data": {"dir": "/a b/c"}}
    assert wire.config_from_json(wire.config_json(cfg)) == cfg
    assert client_names(cfg) == ["arithmetic", "sorting"]
    assert client_names(build_config(None, {"data": {"name": "flan"}})) == \
        ["coreference", "entailment", "paraphrase", "structure_to_text"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # flwr.cli's imports (typer, pathspec), in this process
def test_the_cluster_bundles_the_same_fab_from_a_copy_of_its_files(tmp_path):
    """`flwr run` of a copy holding pyproject.toml and the fab-include files (cluster.fab_folder)
    sends the FAB that `flwr run .` in the checkout would: the same bytes, so the same hash."""
    from flwr.cli.build import build_fab_from_disk

    from pflalign.flower.cluster import fab_folder

    copy = fab_folder(REPO, tmp_path / "app")
    assert copy == tmp_path / "app" and (copy / "src" / "pflalign" / "flower" / "client_app.py").exists()
    assert not (copy / "tests").exists() and not (copy / ".venv").exists()
    assert build_fab_from_disk(copy) == build_fab_from_disk(REPO)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "pyproject.toml").write_text('[tool.flwr.app]\npublisher = "x"\n')
    assert fab_folder(bare, tmp_path / "unused") == bare  # no fab-include: the folder as it is


# ---- the server's checks on client replies (no processes) -------------------------------------
ADAPTER = {"l0.lora_A.weight": torch.arange(8.0).reshape(2, 4) / 4, "l0.lora_B.weight": torch.zeros(4, 2),
           "l1.lora_A.weight": -torch.arange(8.0).reshape(2, 4) / 4, "l1.lora_B.weight": torch.zeros(4, 2)}


def _honest() -> dict:
    """w^r plus 0.25 everywhere: an update of norm 0.25 * sqrt(32) = 1.41 (exact in float32)."""
    return {"params": {n: t + 0.25 for n, t in ADAPTER.items()}}


def _set(update: dict, name: str, value) -> dict:
    update["params"][name] = value
    return update


BAD_UPDATES = {  # what a malicious client sends → the reason the server gives
    "wrong shape": (lambda u: _set(u, "l0.lora_A.weight", torch.zeros(4, 2)),
                    "params/l0.lora_A.weight has shape (4, 2), expected (2, 4)"),
    "wrong dtype": (lambda u: _set(u, "l0.lora_B.weight", torch.zeros(4, 2, dtype=torch.float64)),
                    "params/l0.lora_B.weight has dtype torch.float64, expected torch.float32"),
    "NaN": (lambda u: _set(u, "l1.lora_A.weight", torch.full((2, 4), float("nan"))),
            "params/l1.lora_A.weight holds NaN or Inf"),
    "Inf": (lambda u: _set(u, "l1.lora_B.weight", torch.full((4, 2), float("-inf"))),
            "params/l1.lora_B.weight holds NaN or Inf"),
    "missing key": (lambda u: (u["params"].pop("l1.lora_B.weight"), u)[1], "group 'params': missing 'l1.lora_B.weight'"),
    "unexpected key": (lambda u: _set(u, "l2.lora_A.weight", torch.zeros(2, 4)),
                       "group 'params': unexpected 'l2.lora_A.weight'"),
    "missing group": (lambda u: {}, "missing group 'params'"),
    "unexpected group": (lambda u: {**u, "delta_c": dict(u["params"])}, "unexpected group 'delta_c'"),
    "1e6 times too large": (lambda u: {"params": {n: ADAPTER[n] + 1e6 * (t - ADAPTER[n]) for n, t in u["params"].items()}},
                            "update norm 1.414e+06 exceeds max-update-norm=2"),
}


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_the_server_rejects_a_malformed_update_saying_why(case):
    from pflalign.flower.validate import expected_message, validate_update
    from pflalign.methods import METHODS

    expected = expected_message(METHODS["fedavg"](), ADAPTER)
    reference = {"params": ADAPTER}
    assert validate_update(_honest(), expected, max_norm=2.0, reference=reference) is None
    corrupt, reason = BAD_UPDATES[case]
    assert validate_update(corrupt(_honest()), expected, max_norm=2.0, reference=reference) == reason
    if case == "1e6 times too large":  # the bound is off by default
        assert validate_update(corrupt(_honest()), expected) is None


@pytest.mark.parametrize("method", sorted(__import__("pflalign.methods", fromlist=["METHODS"]).METHODS))
def test_every_methods_honest_update_passes_the_checks(tiny_llama, method):
    """A real round of the method's client rule, through the wire: accepted (bound on, generous)."""
    from flwr.app import RecordDict

    from pflalign.run.client import local_round
    from pflalign.data import Example
    from pflalign.flower import wire
    from pflalign.flower.validate import expected_message, validate_update
    from pflalign.methods import METHODS
    from pflalign.prompts import collate_train, encode_train

    tok, w0 = tiny_llama.tokenizer, tiny_llama.get_lora()
    rule = METHODS[method]()
    batch = collate_train([encode_train(tok, Example("What is 1 plus 2?", "3"), 64)] * 2, tok.pad_token_id)
    result = local_round(tiny_llama, rule, rule.init_client_state(w0), w0, rule.broadcast(w0, rule.init_server_state(w0)),
                         [batch, batch], 0.04, 0)
    tiny_llama.set_lora(w0)
    update = wire.unpack(RecordDict(wire.pack(wire.MESSAGE, result.message)), wire.MESSAGE, dtype=None)
    assert validate_update(update, expected_message(rule, w0), max_norm=10.0,
                           reference={group: w0 for group in rule.weight_groups}) is None


def test_expected_updates_follow_the_method_and_bad_metrics_are_rejected():
    from pflalign.flower.validate import expected_message, validate_eval_metrics, validate_train_metrics
    from pflalign.methods import METHODS

    shapes = {n: (tuple(t.shape), torch.float32) for n, t in ADAPTER.items()}
    assert expected_message(METHODS["scaffold"](), ADAPTER) == {"params": shapes, "delta_c": shapes}
    assert expected_message(METHODS["ffa-lora"](), ADAPTER) == {"params": {n: v for n, v in shapes.items() if "lora_B" in n}}
    assert expected_message(METHODS["local"](), ADAPTER) == {}
    assert expected_message(METHODS["pflalign"](), {n: t.bfloat16() for n, t in ADAPTER.items()}) == {"params": shapes}
    good = {"n_train": 12, "losses": [1.5, 1.25], "update_norm": 0.1, "model_norm": 4.0, "gsnr_mean": 0.3}
    assert validate_train_metrics(good, local_steps=2) is None
    for bad, reason in [({"n_train": 0}, "'n_train' must be a positive integer"),
                        ({"losses": [1.5, float("nan")]}, "'losses' must hold 2 finite numbers"),
                        ({"losses": [1.5]}, "'losses' must hold 2 finite numbers"),
                        ({"update_norm": None}, "'update_norm' must be a finite number"),
                        ({"gsnr_mean": float("inf")}, "'gsnr_mean' must be a finite number")]:
        assert reason in validate_train_metrics({**good, **bad}, local_steps=2)
    scores = {"task": "sorting", "n_train": 12, "n_test": 3, "truncated": 0, "rouge_l_personalized": 50.0,
              "rouge_l_global": 40.0}
    assert validate_eval_metrics(scores) is None
    assert "'rouge_l_global' must be a ROUGE-L score" in validate_eval_metrics({**scores, "rouge_l_global": 1e9})
    assert "'n_test' must be a non-negative integer" in validate_eval_metrics({**scores, "n_test": -1})


# ---- processes -----------------------------------------------------------------------------
def make_cluster(root: Path, simulation: bool = False, app: Path = REPO) -> Cluster:
    """Two clients (the tiny federation's), the model cache under `root`, one thread per process.
    Deployment: the ServerApps and ClientApps forked by pflalign-superexec (they start with torch,
    transformers and Flower imported); the TLS test in test_flower_privacy.py runs Flower's own
    SuperExecs instead (a new process per run and message, Flower's default)."""
    return Cluster(root, app, clients=2, simulation=simulation, fork_apps=True,
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
    # the exported adapters: the global one by the ServerApp, each personalized one on its own node
    from pflalign.run.adapter_folder import read_adapter
    from pflalign.run.export import ADAPTERS

    assert_close(read_adapter(out / ADAPTERS / "global"), read_adapter(ref["out"] / ADAPTERS / "global"),
                 "exported global adapter")
    assert sorted(p.name for p in (out / ADAPTERS).iterdir()) == ["global"]
    for k, state_dir in enumerate(state_dirs):
        task = results["clients"][k]["task"]
        mine = state_dir / results["flower"]["experiment"] / f"client-{k}" / ADAPTERS / task
        assert_close(read_adapter(mine), read_adapter(ref["out"] / ADAPTERS / task), f"client {k} exported adapter")
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
    node is back, resumes to the in-process result. The crashed node's pflalign-superexec and
    its ClientApp children die with it, as Flower's own SuperExec would (it is the node's child)."""
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


def tensorboard_scalars(folder: Path) -> tuple[dict, dict]:
    """A run's TensorBoard scalars {tag: [(step, value)]} and its HParams hyperparameters {name: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(folder))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    return scalars, {name: (v.number_value, v.string_value) for name, v in hparams.items()}


def test_simulation_engine_matches_in_process(tmp_path, reference):
    """SCAFFOLD on the Simulation Engine (Ray), with per-round scores (eval.every) and TensorBoard
    (log.tensorboard: the ServerApp logs what pflalign run logs) too."""
    over = {"eval": {**TINY["eval"], "every": 1, "every_max_test": 2}, "log": {"tensorboard": True}}
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
        # the same TensorBoard scalars (per-step and per-round losses, GSNR, consistency, scores) and hyperparameters
        (scalars, hparams), (ref_scalars, ref_hparams) = (tensorboard_scalars(d / "tensorboard") for d in (out, ref["out"]))
        assert hparams == ref_hparams and hparams["method"] == (0.0, "scaffold")
        # exact match: the in-process engine scores it from its predictions; the ServerApp has none (each client keeps its own)
        ref_scalars = {tag: v for tag, v in ref_scalars.items() if not tag.startswith("final/avg_exact_match")}
        assert scalars.keys() == ref_scalars.keys() and {"loss/step/arithmetic", "loss/mean", "gsnr/ratio/sorting",
                                                         "rouge_l/global/sorting", "final/avg_rouge_l_global"} <= scalars.keys()
        for tag, points in scalars.items():
            assert [s for s, _ in points] == [s for s, _ in ref_scalars[tag]], tag
            assert [v for _, v in points] == pytest.approx([v for _, v in ref_scalars[tag]], rel=1e-5, abs=1e-6), tag
    finally:
        cluster.close()
    check_closed(cluster)


def test_a_malicious_client_is_rejected_and_the_honest_result_unaffected(tmp_path):
    """Client 1 runs tests/malicious_client.py: it sends wrong shapes, a NaN, a missing tensor,
    (with max-update-norm on) an update 1e6 times too large and an honest update claiming 10^12
    examples (max-size-ratio, on by default), one per round. The server rejects each, naming the
    SuperNode, and the run ends as FedAvg over client 0 alone; client 1's evaluation reply,
    claiming 10^9 examples, is left out."""
    app = tmp_path / "maliciousapp"  # a Flower app: pflalign's ServerApp, the malicious ClientApp
    app.mkdir()
    (app / "malicious_client.py").write_text((REPO / "tests" / "malicious_client.py").read_text())
    pyproject = (REPO / "pyproject.toml").read_text()
    for old, new in [('clientapp = "pflalign.flower.client_app:app"', 'clientapp = "malicious_client:app"'),
                     ('fab-include = ["src/pflalign/**/*.py"]', 'fab-include = ["malicious_client.py"]')]:
        assert old in pyproject
        pyproject = pyproject.replace(old, new)
    (app / "pyproject.toml").write_text(pyproject)
    over = {"rounds": 5, "eval": {**TINY["eval"], "base_model": False}}
    cluster = make_cluster(tmp_path, simulation=True, app=app)
    try:
        cluster.start_link()
        out, clients = tmp_path / "out", tmp_path / "clients"
        cluster.flwr_run({"set": json.dumps({**tiny("fedavg"), **over}), "out": str(out), "client-dir": str(clients),
                          "max-update-norm": 10.0}, "malicious")  # honest updates: about 0.07
        output = cluster.finish("malicious")
        assert (out / ckpt.RESULTS).exists(), output[-3000:]
    finally:
        cluster.close()
    check_closed(cluster)
    for r, reason in enumerate([r"params/\S+ has shape \(3, \d+\), expected \(4, \d+\)", r"params/\S+ holds NaN or Inf",
                                r"group 'params': missing '\S+'", r"update norm \S+ exceeds max-update-norm=10",
                                r"metric 'n_train' is 1000000000000, more than max-size-ratio=10 x the round's median "
                                r"declared n_train \(\d+\)"]):
        assert re.search(rf"round {r + 1}: rejected the update of client 1 \(sorting\) from SuperNode \d+: {reason}",
                         output), reason
    rounds = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
    assert [(m["clients"], m["rejected"]) for m in rounds if m["event"] == "round"] == [([0], [1])] * 5
    results = json.loads((out / ckpt.RESULTS).read_text())
    assert results["flower"]["rounds_done"] == {"0": 5}
    assert [c["id"] for c in results["clients"]] == [0]
    [missing] = results["flower"]["missing_clients"]
    assert missing["id"] == 1 and "evaluation rejected: metric 'n_train' is 1000000000" in missing["reason"] \
        and "max-size-ratio=10" in missing["reason"], missing
    # the honest client's result is FedAvg over itself alone, as if client 1 did not exist
    one_thread_run(build_config(None, {**tiny("fedavg"), **over, "data": {**TINY["data"], "clients": ["arithmetic"]}}),
                   tmp_path / "alone")
    alone = _with_clients(tmp_path / "alone")
    assert_close(ckpt.load_checkpoint(out / ckpt.CHECKPOINT)["global"], alone["global"], "global adapter")
    assert_close(personalized(clients, results, 0, 5), alone["clients"][0]["personalized"], "client 0 personalized")


def test_simulation_engine_runs_the_local_optimizer_as_in_process(tmp_path, reference):
    """optimizer.* (issue 42) reach the ClientApps with the run's config: FedProx with AdamW, a
    cosine lr over the rounds and gradient accumulation gives the in-process run's adapters."""
    over = {"lr": 1e-3, "optimizer": {"name": "adamw", "weight_decay": 0.01, "schedule": "cosine", "min_lr": 1e-4,
                                      "grad_accumulation": 2}}
    cluster = make_cluster(tmp_path, simulation=True)
    try:
        cluster.start_link()
        out, clients = tmp_path / "out", tmp_path / "clients"
        cluster.flwr_run({"set": json.dumps({**tiny("fedprox"), **over}), "out": str(out), "client-dir": str(clients)},
                         "sim")
        output = cluster.finish("sim", RUN_TIMEOUT)
        assert (out / ckpt.RESULTS).exists(), output[-3000:]
        assert json.loads((out / ckpt.CONFIG).read_text())["optimizer"]["name"] == "adamw"
        assert_matches_in_process(out, [clients, clients], reference("fedprox", **over))
    finally:
        cluster.close()
    check_closed(cluster)
