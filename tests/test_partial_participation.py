"""Partial participation: each stateful method's rule for a round in which only some of the N
clients take part, against numbers computed by hand, and the engine's side of it (who is sampled,
what N the server is told, whose state changes).

The toy round: N = 4 clients of unequal sizes |D| = (10, 30, 20, 40); clients 1 and 3 are
sampled, so the data weights are 30/70 and 40/70. Client k's loss is ½ a_k (w − t_k)² on a
scalar, with a_1 = 2, t_1 = 1 and a_3 = 4, t_3 = −1; w^r = 0.5, one local step (K = 1) with
η = 0.1. Client 1's gradient is 2 (0.5 − 1) = −1, client 3's is 4 (0.5 + 1) = 6.
"""

import json
import math

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.run.client_store import client_records
from pflalign.config import build_config
from pflalign.run.engine import Federation
from pflalign.run.lifecycle import Recorder, sample_clients
from pflalign.methods.base import data_weights
from pflalign.methods.feddyn import FedDyn, FedDynArgs
from pflalign.methods.fedopt import FedAdam, FedAdamArgs
from pflalign.methods.pflalign import PFLAlign
from pflalign.methods.scaffold import Scaffold

from test_engine import TINY
from test_optimizer_methods import run_round, vec
from toy import quadratic

N, SAMPLED, SIZES, LR, W0 = 4, [1, 3], [10, 30, 20, 40], 0.1, 0.5
WEIGHTS = data_weights([SIZES[k] for k in SAMPLED])  # 3/7, 4/7
GRAD_OF = [quadratic(vec(a), vec(t)) for a, t in ((1.0, 0.0), (2.0, 1.0), (1.0, 0.0), (4.0, -1.0))]


def one_round(method):
    glob = {"w": vec(W0)}
    server_state = method.init_server_state(glob)
    states = [method.init_client_state(glob) for _ in range(N)]
    new = run_round(method, glob, states, server_state, SAMPLED, N, GRAD_OF, WEIGHTS, steps=1, lr=LR)
    return new, server_state, states


def test_weights_are_the_sampled_clients_data_shares():
    assert WEIGHTS == pytest.approx([3 / 7, 4 / 7], rel=1e-15)


def test_scaffold_server_control_moves_by_sampled_fraction_times_mean_delta():
    # clients (c = c_k = 0): w_1 = 0.5 − 0.1·(−1) = 0.6, c_1⁺ = (0.5 − 0.6)/(1·0.1) = −1 = Δc_1;
    # w_3 = 0.5 − 0.1·6 = −0.1, c_3⁺ = (0.5 + 0.1)/0.1 = 6 = Δc_3.
    # server: c = 0 + (|S|/N)·mean(Δc) = (2/4)·2.5 = 1.25 (with 1 instead of |S|/N: 2.5; with the
    # data-weighted mean of Δc: 1.5); w = (3/7)·0.6 + (4/7)·(−0.1) = 0.2
    new, server_state, states = one_round(Scaffold())
    assert server_state["c"]["w"].item() == pytest.approx(1.25, rel=1e-12)
    assert new["w"].item() == pytest.approx(0.2, rel=1e-12)
    assert [s["c"]["w"].item() for s in states] == pytest.approx([0.0, -1.0, 0.0, 6.0], rel=1e-12, abs=0)


def test_feddyn_h_averages_over_all_clients():
    # α = 0.5, λ = 0: the steps are as SCAFFOLD's (the proximal term is 0 at w^r): w_1 = 0.6, w_3 = −0.1;
    # λ_1 = −0.5·0.1 = −0.05, λ_3 = −0.5·(−0.6) = 0.3.
    # h = 0 − α (1/N) Σ_S (w_k − w^r) = −0.5·(1/4)·(0.1 − 0.6) = 0.0625 (with 1/|S|: 0.125)
    # w^{r+1} = mean_S w_k − h/α = 0.25 − 0.125 = 0.125 (unweighted: the data-weighted mean would give 0.075)
    new, server_state, states = one_round(FedDyn(FedDynArgs(alpha=0.5)))
    assert server_state["h"]["w"].item() == pytest.approx(0.0625, rel=1e-12)
    assert new["w"].item() == pytest.approx(0.125, rel=1e-12)
    assert [s["lambda"]["w"].item() for s in states] == pytest.approx([0.0, -0.05, 0.0, 0.3], rel=1e-12, abs=0)


def test_fedopt_steps_along_the_sampled_data_weighted_mean():
    # FedAvg clients: w_1 = 0.6, w_3 = −0.1; their data-weighted mean 0.2, so Δ = 0.2 − 0.5 = −0.3
    # (the unweighted mean would give −0.25). FedAdam, η_s = 1, β1 = 0.9, β2 = 0.99, τ = 0.1:
    # m = 0.1·(−0.3) = −0.03; v = 0.99·0.01 + 0.01·0.09 = 0.0108; w = 0.5 − 0.03/(√0.0108 + 0.1)
    new, server_state, _ = one_round(FedAdam(FedAdamArgs(server_lr=1.0, beta1=0.9, beta2=0.99, tau=0.1)))
    assert server_state["m"]["w"].item() == pytest.approx(-0.03, rel=1e-12)
    assert server_state["v"]["w"].item() == pytest.approx(0.0108, rel=1e-12)
    assert new["w"].item() == pytest.approx(0.5 - 0.03 / (math.sqrt(0.0108) + 0.1), rel=1e-12)
    assert new["w"].item() == pytest.approx(0.35288568, rel=1e-7)


def test_pflalign_state_changes_only_for_the_clients_that_trained():
    # One step, β = 0.9, Δ = 0 (no correction), m, v, P = 0 at first; per client:
    # m = 0.1 g, v = 0.1 g², α = 1 − 0.1 g²/v = 0, P = 0.1 m²/v = 0.01, w = 0.5 − 0.1·0.01·g.
    # client 1 (g = −1): w = 0.501, Δ = 0.001, v = 0.1; client 3 (g = 6): w = 0.494, Δ = −0.006, v = 3.6.
    # Clients 0 and 2 did not train: their Δ, v, P stay 0. Global: (3/7)·0.501 + (4/7)·0.494 = 0.497.
    new, _, states = one_round(PFLAlign())
    assert [s["delta"]["w"].item() for s in states] == pytest.approx([0.0, 0.001, 0.0, -0.006], rel=1e-9, abs=0)
    assert [s["v"]["w"].item() for s in states] == pytest.approx([0.0, 0.1, 0.0, 3.6], rel=1e-9, abs=0)
    assert [s["P"]["w"].item() for s in states] == pytest.approx([0.0, 0.01, 0.0, 0.01], rel=1e-9, abs=0)
    assert new["w"].item() == pytest.approx(0.497, rel=1e-12)


# ---- the engine: who trains, what the server is told, whose state changes --------------------
@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """`sampled_federation` cuts the clients' data after the federation is made: tokenized, they
    must not land in the host's cache under the uncut data's key (a later test would read 8
    examples for key_value where there are 12)."""
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))


def sampled_federation(tmp_path, method: str):
    """Four synthetic clients of unequal sizes (4, 12, 8, 12), participation 0.5, 2 rounds."""
    cfg = build_config(None, {**json.loads(json.dumps(TINY)), "method": method, "participation": 0.5,
                              "data": {**TINY["data"], "clients": ["arithmetic", "sorting", "key_value", "uppercase"]}})
    fed = Federation(cfg, progress=False)
    for k, n in enumerate((4, 12, 8, 12)):
        fed.clients[k].data.train = fed.clients[k].data.train[:n]
    return cfg, fed


def test_engine_tells_the_server_all_n_and_weights_the_sampled_by_data(tmp_path, monkeypatch):
    cfg, fed = sampled_federation(tmp_path, "scaffold")
    seen, added = [], []
    original = fed.method.start_aggregation

    def spy(global_params, weights, server_state, ctx):  # the round's aggregation, its replies counted
        seen.append((ctx.round, ctx.num_clients, list(ctx.client_ids), list(weights)))
        aggregation = original(global_params, weights, server_state, ctx)
        add = aggregation.add
        monkeypatch.setattr(aggregation, "add", lambda i, message: (added.append(ctx.round), add(i, message)))
        return aggregation

    monkeypatch.setattr(fed.method, "start_aggregation", spy)
    rec = Recorder(tmp_path, resume=False, overwrite=False)
    rec.open(cfg)
    fed.train(rec, 0, cfg.rounds)
    rec.close()
    sizes = (4, 12, 8, 12)
    for r, num_clients, ids, weights in seen:
        assert ids == sample_clients(4, 0.5, cfg.seed, r) and len(ids) == 2 == added.count(r)
        assert num_clients == 4  # N: all clients, not the participants
        total = sum(sizes[k] for k in ids)
        assert weights == pytest.approx([sizes[k] / total for k in ids], rel=1e-15)
    assert len(seen) == 2


def test_engine_keeps_the_state_of_clients_that_did_not_train(tmp_path, monkeypatch):
    """pFLAlign: a client's Δ_k, v, P change only in the rounds it trains; a client never sampled has
    no state file; Δ_k is its last w_{k,T} − w^r of the round it trained in."""
    cfg, fed = sampled_federation(tmp_path, "pflalign")
    globals_before = []
    original = fed.train_round

    def spy(r):
        globals_before.append({n: t.clone() for n, t in fed.global_params.items()})
        return original(r)

    monkeypatch.setattr(fed, "train_round", spy)
    rec = Recorder(tmp_path, resume=False, overwrite=False)
    rec.open(cfg)
    fed.train(rec, 0, cfg.rounds)
    rec.close()
    rounds = [sample_clients(4, 0.5, cfg.seed, r) for r in range(cfg.rounds)]
    payload = ckpt.load_checkpoint(tmp_path / ckpt.CHECKPOINT)
    records = client_records(tmp_path, payload)
    for k, rec_k in enumerate(payload["client_records"]):
        trained = [r for r, ids in enumerate(rounds) if k in ids]
        if not trained:
            assert rec_k["file"] is None and records[k]["personalized"] is None
            continue
        last = trained[-1]
        assert rec_k["file"] == f"{k}.r{last + 1}.safetensors"  # written in its last round, not since
        assert rec_k["steps_taken"] == len(trained) * cfg.local_steps
        state, personal = records[k]["state"], records[k]["personalized"]
        for n, w in personal.items():
            assert torch.equal(state["delta"][n], w - globals_before[last][n]), n
    # on disk: the files that checkpoint.pt or checkpoint.prev.pt name, nothing stale
    previous = ckpt.load_checkpoint(tmp_path / ckpt.PREVIOUS)
    named = {r["file"] for p in (payload, previous) for r in p["client_records"] if r["file"]}
    assert {p.name for p in (tmp_path / "clients").iterdir()} == named
    assert any(not set(a) >= {0, 1, 2, 3} for a in rounds)  # the seed samples a strict subset
