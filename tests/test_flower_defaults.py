"""Issue 20, item 4: the Flower server refuses a poisoned update by default (no processes:
the strategy's `aggregate_train` on crafted replies)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from pflalign.config import build_config
from pflalign.flower import validate, wire
from pflalign.flower.strategy import MethodStrategy, RoundFailed
from pflalign.methods import METHODS, method_class
from pflalign.run.server import Server

from test_engine import TINY

LR, STEPS = 0.04, 2


@pytest.fixture(scope="module")
def w0(tiny_llama):
    return tiny_llama.get_lora()


def honest_round(lm, w0, method: str):
    from pflalign.run.client import local_round
    from pflalign.data import Example
    from pflalign.prompts import collate_train, encode_train

    tok = lm.tokenizer
    rule = METHODS[method]()
    batch = collate_train([encode_train(tok, Example("What is 1 plus 2?", "3"), 64)] * 2, tok.pad_token_id)
    result = local_round(lm, rule, rule.init_client_state(w0), w0, rule.broadcast(w0, rule.init_server_state(w0)),
                         [batch] * STEPS, LR, 0)
    lm.set_lora(w0)
    return rule, result


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_methods_honest_update_passes_the_default_checks(tiny_llama, w0, method):
    rule, result = honest_round(tiny_llama, w0, method)
    update = wire.unpack(RecordDict(wire.pack(wire.MESSAGE, result.message)), wire.MESSAGE, dtype=None)
    assert validate.validate_update(update, validate.expected_message(rule, w0), 0.0,
                                    {g: w0 for g in rule.weight_groups}, wire.RUN_DEFAULTS["max-update-ratio"],
                                    LR * STEPS) is None


def test_the_default_ratio_refuses_a_finite_1e30_update_and_a_huge_control_variate(tiny_llama, w0):
    ratio = wire.RUN_DEFAULTS["max-update-ratio"]
    assert ratio > 0  # on by default
    for method, group in (("fedavg", "params"), ("scaffold", "delta_c")):
        rule, result = honest_round(tiny_llama, w0, method)
        expected, reference = validate.expected_message(rule, w0), {g: w0 for g in rule.weight_groups}
        poisoned = {g: dict(ts) for g, ts in result.message.items()}
        poisoned[group] = {n: (t * 1e30 if group != "params" else w0[n] + 1e30 * (t - w0[n]))
                           for n, t in poisoned[group].items()}
        reason = validate.validate_update(poisoned, expected, 0.0, reference, ratio, LR * STEPS)
        assert reason is not None and "exceeds max-update-ratio=10" in reason, reason


def test_an_all_zero_or_unchanged_update_is_refused(w0):
    expected = validate.expected_message(METHODS["fedavg"](), w0)
    reference = {"params": w0}
    zeros = {"params": {n: torch.zeros_like(t) for n, t in w0.items()}}
    assert validate.validate_update(zeros, expected, reference=reference, max_ratio=10) == "the update is all zeros"
    same = {"params": {n: t.clone() for n, t in w0.items()}}
    assert "unchanged" in validate.validate_update(same, expected, reference=reference, max_ratio=10)


GOOD_METRICS = {"n_train": 4, "losses": [1.0, 0.5], "update_norm": 0.1, "model_norm": 4.0, "gsnr_mean": 0.2,
                "gsnr_ratio": 1.1}


@pytest.mark.parametrize("key,value,declared,needle", [
    ("losses", [1.0, -0.5], None, "negative loss"),
    ("update_norm", -1.0, None, "'update_norm' must be a finite number >= 0"),
    ("model_norm", -1.0, None, "'model_norm' must be a finite number >= 0"),
    ("gsnr_mean", -0.1, None, "'gsnr_mean' must be a finite number >= 0"),
    ("gsnr_ratio", -2.0, None, "'gsnr_ratio' must be a finite number >= 0"),
    ("n_train", 10**9, 4, "more than the 4 the client declared at the start"),
])
def test_bad_training_metrics_are_refused(key, value, declared, needle):
    assert validate.validate_train_metrics(GOOD_METRICS, STEPS, 4) is None
    reason = validate.validate_train_metrics({**GOOD_METRICS, key: value}, STEPS, declared)
    assert reason is not None and needle in reason, reason


def test_an_eval_reply_over_zero_test_examples_is_refused():
    good = {"task": "sorting", "n_train": 4, "n_test": 2, "truncated": 0, "rouge_l_personalized": 10.0,
            "rouge_l_global": 9.0}
    assert validate.validate_eval_metrics(good) is None
    assert "'n_test' is 0" in validate.validate_eval_metrics({**good, "n_test": 0})


def test_an_array_record_the_method_did_not_ask_for_is_refused(w0):
    expected = validate.expected_message(METHODS["fedavg"](), w0)
    assert validate.validate_records(["message/params"], expected, wire.MESSAGE) is None
    assert "unexpected ArrayRecord 'global'" in validate.validate_records(["message/params", "global"], expected,
                                                                          wire.MESSAGE)


# ---- the strategy: a poisoned client among honest ones ------------------------------------------
def _strategy(tiny_llama, w0, min_clients=0):
    cfg = build_config(None, {**json.loads(json.dumps(TINY)), "method": "fedavg", "lr": LR, "local_steps": STEPS,
                              "data": {**TINY["data"], "clients": ["arithmetic", "sorting", "uppercase"]}})
    strategy = MethodStrategy(Server(method_class("fedavg")(), w0, 3), cfg, experiment="t", min_clients=min_clients)
    # as if round messages went to clients 0, 1, 2 (the replies come from a patched _match)
    strategy._pending = [(SimpleNamespace(content=RecordDict()), k) for k in range(3)]
    strategy._unreached = {}
    return strategy


def _reply(message: dict, n_train: int = 4, extra_records: dict | None = None):
    content = RecordDict({**wire.pack(wire.MESSAGE, message), **(extra_records or {}),
                          "metrics": MetricRecord({**GOOD_METRICS, "n_train": n_train}),
                          "info": ConfigRecord({"task": "x"})})
    return SimpleNamespace(content=content, metadata=SimpleNamespace(src_node_id=77))


def test_a_poisoned_client_is_rejected_by_default_and_the_round_goes_on(tiny_llama, w0, monkeypatch):
    _, honest = honest_round(tiny_llama, w0, "fedavg")
    good = honest.message
    poisoned = {"params": {n: w0[n] + 1e30 * (t - w0[n]) for n, t in good["params"].items()}}
    strategy = _strategy(tiny_llama, w0)
    replies = {0: _reply(good), 1: _reply(poisoned), 2: _reply(good)}
    monkeypatch.setattr(strategy, "_match", lambda _: (replies, {}))
    outcome = strategy.collect_train(1, [])
    assert list(outcome.rejected) == [1] and "max-update-ratio" in outcome.rejected[1]
    assert outcome.record.clients == [0, 2]
    assert all(torch.isfinite(t).all() and (t - w0[n]).abs().max() < 1
               for n, t in outcome.record.global_params.items())
    assert outcome.record.global_params is strategy.server.global_params  # w^1, the server's now

    # next round: client 0 claims a larger n_train than it declared, client 2 sends an extra ArrayRecord
    moved = {"params": {n: t + 1e-3 for n, t in good["params"].items()}}  # w^1 is `good` itself
    replies = {0: _reply(moved, n_train=10**9), 1: _reply(moved),
               2: _reply(moved, extra_records={"global": ArrayRecord()})}
    outcome = strategy.collect_train(2, [])
    assert sorted(outcome.rejected) == [0, 2] and outcome.record.clients == [1]
    assert "declared at the start" in outcome.rejected[0] and "unexpected ArrayRecord" in outcome.rejected[2]


def test_rejected_clients_do_not_count_toward_min_clients(tiny_llama, w0, monkeypatch):
    _, honest = honest_round(tiny_llama, w0, "fedavg")
    poisoned = {"params": {n: torch.zeros_like(t) for n, t in honest.message["params"].items()}}
    strategy = _strategy(tiny_llama, w0, min_clients=3)
    before = {n: t.clone() for n, t in strategy.server.global_params.items()}
    monkeypatch.setattr(strategy, "_match", lambda _: ({0: _reply(honest.message), 1: _reply(poisoned),
                                                        2: _reply(honest.message)}, {}))
    with pytest.raises(RoundFailed, match="2 valid updates, fewer than min-clients=3.*all zeros"):
        strategy.aggregate_train(1, [])
    assert all(torch.equal(before[n], t) for n, t in strategy.server.global_params.items())  # nothing aggregated


# ---- issue 41, item 1: a client that lies about its size ------------------------------------------
def test_size_bound_is_the_ratio_times_the_lower_median():
    assert validate.lower_median([5, 1, 3]) == 3 and validate.lower_median([4, 10**12]) == 4
    assert validate.lower_median([1, 2, 3, 4]) == 2
    sizes = {0: 4, 1: 40, 2: 41, 3: 5}  # lower median 5: the bound is 50 at ratio 10, 25 at ratio 5
    assert validate.oversized(sizes, 10.0) == {}
    assert set(validate.oversized(sizes, 5.0)) == {1, 2}
    assert "max-size-ratio=5 x the round's median declared n_train (5)" in validate.oversized(sizes, 5.0)[1]
    assert validate.oversized({0: 4, 1: 10**12}, 0.0) == {}  # 0: off
    assert list(validate.oversized({0: 4, 1: 10**12}, 10.0)) == [1]  # two clients: the smaller one sets the bound


def test_a_client_declaring_a_huge_first_n_train_is_rejected_and_gets_no_weight(tiny_llama, w0, monkeypatch,
                                                                                caplog):
    assert wire.RUN_DEFAULTS["max-size-ratio"] == 10  # on by default
    _, honest = honest_round(tiny_llama, w0, "fedavg")
    good = honest.message
    other = {"params": {n: t + 1e-3 for n, t in good["params"].items()}}
    strategy = _strategy(tiny_llama, w0)
    # client 1's first reply in the run: a well-formed update that claims 10^12 examples
    replies = {0: _reply(good), 1: _reply(other, n_train=10**12), 2: _reply(good)}
    monkeypatch.setattr(strategy, "_match", lambda _: (replies, {}))
    with caplog.at_level("WARNING", logger="flwr.pflalign"):
        outcome = strategy.collect_train(1, [])
    assert list(outcome.rejected) == [1] and "max-size-ratio=10" in outcome.rejected[1]
    assert outcome.record.clients == [0, 2] and outcome.record.weights == [0.5, 0.5]
    assert any("rejected the update of client 1" in r.message and "max-size-ratio" in r.message
               for r in caplog.records)
    assert all(torch.equal(t, good["params"][n]) for n, t in outcome.record.global_params.items())  # 1: no weight
    assert 1 not in strategy.n_train  # its claim is not remembered as its size


def test_an_evaluation_reply_with_inflated_counts_is_left_out(tiny_llama, w0, monkeypatch):
    strategy = _strategy(tiny_llama, w0)
    strategy.n_train = {0: 4, 1: 4, 2: 4}  # what they declared in training

    def reply(n_train=4, n_test=2):
        metrics = MetricRecord({"n_train": n_train, "n_test": n_test, "truncated": 0, "rouge_l_personalized": 10.0,
                                "rouge_l_global": 9.0})
        return SimpleNamespace(content=RecordDict({"metrics": metrics, "info": ConfigRecord({"task": "x"})}),
                               metadata=SimpleNamespace(src_node_id=77))

    for replies, bad, needle in [
        ({0: reply(), 1: reply(n_train=10**9), 2: reply()}, 1, "more than the 4 the client declared in training"),
        ({0: reply(), 1: reply(), 2: reply(n_test=10**9)}, 2, "max-size-ratio=10 x the round's median declared n_test"),
    ]:
        monkeypatch.setattr(strategy, "_match", lambda _, replies=replies: (replies, {}))
        outcome = strategy.collect_evaluate(2, [])
        assert sorted(outcome.scores) == sorted({0, 1, 2} - {bad}) and list(outcome.missing) == [bad]
        assert needle in outcome.missing[bad], outcome.missing[bad]
    strategy.n_train = {}  # a client the server has no training size of: held against the others'
    monkeypatch.setattr(strategy, "_match", lambda _: ({0: reply(), 1: reply(n_train=10**9), 2: reply()}, {}))
    outcome = strategy.collect_evaluate(2, [])
    assert list(outcome.missing) == [1] and "median declared n_train" in outcome.missing[1]


@pytest.mark.parametrize("key, value, needle", [
    ("max-size-ratio", -1, "run config max-size-ratio must be a number >= 1 (or 0: off), got -1"),
    ("max-size-ratio", 0.5, "run config max-size-ratio must be a number >= 1 (or 0: off), got 0.5"),
    ("max-size-ratio", "abc", "run config max-size-ratio must be a number >= 1 (or 0: off), got 'abc'"),
    ("max-size-ratio", float("nan"), "run config max-size-ratio must be a number"),
    ("max-update-ratio", -2.0, "run config max-update-ratio must be a number >= 0, got -2.0"),
    ("min-clients", 1.5, "run config min-clients must be an integer >= 0, got 1.5"),
    ("round-timeout", 0, "run config round-timeout must be a number > 0, got 0"),
    ("resume", "yes", "run config resume must be true or false, got 'yes'"),
    ("dp-delta", 2.0, "run config dp-delta must be < 1"),
])
def test_a_bad_run_config_value_is_refused_before_the_run_folder_is_touched(tmp_path, caplog, key, value, needle):
    """Issue 57: every run-config value is checked where the privacy ones are, before the first
    round and before `out` is made: max-size-ratio=-1 no longer turns the size bound off in
    silence, 'abc' is not a ValueError deep in the ServerApp. (`flwr run` itself returns 0 once
    the run has started: Flower's CLI has no hook to refuse a run config.)"""
    from pflalign.errors import UserError
    from pflalign.flower import server_app

    out = tmp_path / "run"
    context = SimpleNamespace(run_config={**wire.RUN_DEFAULTS, "out": str(out), key: value})
    with caplog.at_level("ERROR", logger="flwr.pflalign"), pytest.raises(UserError) as info:
        server_app.main(grid=None, context=context)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert any(needle in r.message for r in caplog.records)  # the ServerApp's log says why, in one line
    assert not out.exists()


def test_max_size_ratio_0_is_off_and_says_so_at_the_start(tiny_llama, w0, caplog):
    options = wire.run_options({"max-size-ratio": 0, "max-update-ratio": 10})
    assert options["max-size-ratio"] == 0.0 and options["max-update-ratio"] == 10.0
    assert wire.run_options({})["max-size-ratio"] == wire.RUN_DEFAULTS["max-size-ratio"]
    strategy = _strategy(tiny_llama, w0)
    strategy.checks.max_size_ratio = 0.0
    with caplog.at_level("INFO", logger="flwr.pflalign"):
        strategy.summary()
    said = [r.message for r in caplog.records]
    assert any("replies checked: max-update-norm off, max-update-ratio 10, max-size-ratio off" in m for m in said), said
    assert any(r.levelname == "WARNING" and "max-size-ratio=0: the bound on the sizes clients declare is off" in r.message
               for r in caplog.records)
