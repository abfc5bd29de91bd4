"""Rules that only show with unequal inputs: pFLAlign's gate variants against hand
values, and |D_k| weighting (aggregation, aggregation consistency) with clients
of unequal size.

Each test here was written against a mutation that the rest of the suite let
through (issue 19): the hard gate's sign flipped, the constant gate another
constant, pFLAlign's aggregation unweighted, the consistency an unweighted mean.
"""

import json

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.run.client_store import client_records
from pflalign.config import build_config
from pflalign.run.engine import run
from pflalign.methods import METHODS
from pflalign.methods.base import RoundContext, StepContext

# One local step of a pFLAlign variant from a state with Δ ≠ 0 and v = P = 0:
#   w0 = w^r + Δ;  m = (1−β) g;  v = (1−β) g²;  P = (1−β) m²/v = (1−β)² = 0.01 (β = 0.9)
#   w1 = w0 − η P g − γ Δ / T,   η = 0.5, T = 4
W_GLOBAL = [0.1, 0.2, 0.3]
DELTA = [0.4, -0.4, 0.2]
GRAD = [1.0, 1.0, -2.0]  # sign(m Δ) = sign(g Δ) = +, −, −


def _one_step(name):
    method = METHODS[name]()
    glob = {"w": torch.tensor(W_GLOBAL, dtype=torch.float64)}
    state = method.init_client_state(glob)
    state["delta"]["w"] = torch.tensor(DELTA, dtype=torch.float64)
    scratch = method.new_scratch()
    params = method.client_start(glob, state, {}, scratch)
    grads = {"w": torch.tensor(GRAD, dtype=torch.float64)}
    method.local_step(params, lambda: (0.0, grads), state, StepContext(0, 0, 4, 0.5, glob, scratch=scratch))
    return params["w"].tolist()


def test_hard_gamma_is_one_where_momentum_agrees_with_delta():
    # γ = 0.5 + 0.5 sign(m Δ) = [1, 0, 0]
    #   [0.5 − 0.005 − 1·0.4/4,  −0.2 − 0.005 − 0,  0.5 + 0.01 − 0]
    assert _one_step("pflalign-hard-gamma") == pytest.approx([0.395, -0.205, 0.51], abs=1e-12)


def test_const_gamma_is_one_half():
    # γ = 0.5: [0.5 − 0.005 − 0.05,  −0.2 − 0.005 + 0.05,  0.5 + 0.01 − 0.025]
    assert _one_step("pflalign-const-gamma") == pytest.approx([0.445, -0.155, 0.485], abs=1e-12)


def test_no_correction_has_gamma_zero():
    assert _one_step("pflalign-no-correction") == pytest.approx([0.495, -0.205, 0.51], abs=1e-12)


def test_pflalign_aggregate_weights_by_data_size():
    # w^{r+1} = 0.25 · [1, 2] + 0.75 · [5, −2]
    method = METHODS["pflalign"]()
    glob = {"w": torch.zeros(2, dtype=torch.float64)}
    messages = [{"params": {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}},
                {"params": {"w": torch.tensor([5.0, -2.0], dtype=torch.float64)}}]
    new = method.aggregate(glob, messages, [0.25, 0.75], {}, RoundContext(0, 2, [0, 1]))
    assert new["w"].tolist() == pytest.approx([4.0, -1.0], abs=1e-12)


# ---- end to end, clients of 4 and 12 training examples ----------------------
def _flan_dir(root):
    """A FedDPA-format folder: coreference with 4 training examples, entailment with 12."""
    root.mkdir()

    def rec(i, category):
        return {"instruction": f"Q{i} {category}?", "output": f"a{i % 3}", "task": "t", "category": category}

    (root / "local_training_0.json").write_text(json.dumps([rec(i, "coreference") for i in range(4)]))
    (root / "local_training_1.json").write_text(json.dumps([rec(i, "entailment") for i in range(12)]))
    test = [rec(100 + i, c) for c in ("coreference", "entailment") for i in range(2)]
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    return root


@pytest.fixture(scope="module")
def unequal_run(tmp_path_factory):
    """One pFLAlign round on clients of |D| = 4 and 12 (weights 0.25, 0.75)."""
    base = tmp_path_factory.mktemp("unequal")
    cfg = build_config(None, {
        "method": "pflalign", "model": "tiny-llama", "lora": {"r": 4, "alpha": 8},
        "data": {"name": "flan", "dir": str(_flan_dir(base / "flan")), "clients": ["coreference", "entailment"]},
        "rounds": 1, "local_steps": 3, "batch_size": 2, "max_seq_len": 64, "lr": 0.5,
        "eval": {"max_new_tokens": 2, "batch_size": 4, "base_model": False},
    })
    out = base / "run"
    results = run(cfg, out, progress=False)
    rows = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
    payload = ckpt.load_checkpoint(out / ckpt.CHECKPOINT)
    return results, rows, {**payload, "clients": client_records(out, payload)}  # clients/ since issue 21


def test_pflalign_global_is_data_weighted_mean_of_client_models(unequal_run):
    results, _, payload = unequal_run
    assert [c["n_train"] for c in results["clients"]] == [4, 12]
    # after one round each client's personalized model is its w_{k,T}, the model it sent
    w0, w1 = (c["personalized"] for c in payload["clients"])
    gap = 0.0
    for n, t in payload["global"].items():
        assert torch.allclose(t, 0.25 * w0[n] + 0.75 * w1[n], atol=1e-6), n
        gap = max(gap, float((0.5 * w0[n] + 0.5 * w1[n] - t).abs().max()))
    assert gap > 1e-3  # the equal-weight mean is measurably different: the check can fail


def test_consistency_is_data_weighted(unequal_run):
    _, rows, _ = unequal_run
    clients = sorted((r for r in rows if r["event"] == "client_round"), key=lambda r: r["client"])
    (summary,) = [r for r in rows if r["event"] == "round"]
    for key, per_client in (("consistency_update_norm", "update_norm"), ("consistency_model_norm", "model_norm")):
        weighted = 0.25 * clients[0][per_client] + 0.75 * clients[1][per_client]
        plain = 0.5 * clients[0][per_client] + 0.5 * clients[1][per_client]
        assert summary[key] == pytest.approx(weighted, rel=1e-9)
        assert abs(weighted - plain) > 1e-6 * weighted, key  # the two differ: the check can fail
