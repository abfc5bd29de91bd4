"""Issue 21: aggregation keeps running sums instead of every reply.

(a) every method's streaming aggregation (`start_aggregation`, `add` per reply, `finish`) gives
    the bits of its rule as a list rule (the code before streaming, kept below as the
    reference), server state included, over two rounds, with unequal weights;
(b) the in-process engine and the Flower strategy never hold a second client's update while
    they hold one (weak references to each update's tensors);
(c) the order of the additions is enforced, the server state changes only in `finish`, and the
    methods that say they need only the data-weighted sum (`needs_each_upload`) keep only that.
"""

from __future__ import annotations

import copy
import json
import weakref

import pytest
import torch

from pflalign.config import build_config
from pflalign.run.engine import Federation
from pflalign.flower import validate
from pflalign.methods import METHODS
from pflalign.methods.base import Method, RoundContext, WeightedSum, clone, data_weights, zeros_like
from pflalign.methods.feddyn import FedDyn
from pflalign.methods.fedgloss import FedGloSS, joint_norm
from pflalign.methods.fedopt import FedOpt
from pflalign.methods.fedsa_lora import FedSALoRA
from pflalign.methods.fedsvd import FedSVD, svd_refactor
from pflalign.methods.ffa_lora import FFALoRA
from pflalign.methods.local import Local
from pflalign.methods.scaffold import Scaffold
from pflalign.params import is_lora_a, is_lora_b, lora_b_name

from test_engine import TINY


# ---- (a) the list rules before streaming (verbatim), the reference ------------------------------
def list_average(items, weights):
    out = zeros_like(items[0])
    for item, w in zip(items, weights):
        for n, t in item.items():
            out[n].add_(t, alpha=w)
    return out


def fedavg_rule(m, w, messages, weights, state, ctx):
    return list_average([x["params"] for x in messages], weights)


def scaffold_rule(m, w, messages, weights, state, ctx):
    participants = len(messages)
    mean_delta_c = list_average([x["delta_c"] for x in messages], [1.0 / participants] * participants)
    for n, c in state["c"].items():
        c.add_(mean_delta_c[n], alpha=participants / ctx.num_clients)
    return list_average([x["params"] for x in messages], weights)


def feddyn_rule(m, w, messages, weights, state, ctx):
    alpha, participants = m.args.alpha, len(messages)
    mean_params = list_average([x["params"] for x in messages], [1.0 / participants] * participants)
    new = {}
    for n, h in state["h"].items():
        h.sub_(mean_params[n] - w[n], alpha=alpha * participants / ctx.num_clients)
        new[n] = mean_params[n] - h / alpha
    return new


def fedopt_rule(m, w, messages, weights, state, ctx):
    average = list_average([x["params"] for x in messages], weights)
    beta1, lr, tau = m.args.beta1, m.args.server_lr, m.args.tau
    new = {}
    for n, g in w.items():
        delta = average[n] - g
        mom, v = state["m"][n], state["v"][n]
        mom.mul_(beta1).add_(delta, alpha=1 - beta1)
        m.update_v(v, delta * delta)
        new[n] = g + lr * mom / (v.sqrt() + tau)
    return new


def fedgloss_rule(m, w, messages, weights, state, ctx):
    beta, sigma, perturbation = m.args.beta, state["sigma"], state["perturbation"]
    participants = len(messages)
    pseudo_grad, new = {}, {}
    for n, g in w.items():
        start = g + perturbation[n]
        deltas = [x["params"][n] - start for x in messages]
        pseudo_grad[n] = -sum(p * d for p, d in zip(weights, deltas))
        new[n] = g - m.args.server_lr * pseudo_grad[n]
        if m.args.admm:
            sigma[n].sub_(sum(deltas) / (beta * ctx.num_clients * participants))
            new[n] = new[n] - beta * sigma[n]
    rho, norm = m.radius(m.args.rho, ctx.round + 1), joint_norm(pseudo_grad)
    for n, d in pseudo_grad.items():
        perturbation[n] = d * (rho / norm) if rho > 0 and norm > 0 else torch.zeros_like(d)
    return new


def ffa_rule(m, w, messages, weights, state, ctx):
    averaged = list_average([x["params"] for x in messages], weights)
    return {n: g.clone() if is_lora_a(n) else averaged[n] for n, g in w.items()}


def fedsvd_rule(m, w, messages, weights, state, ctx):
    new = ffa_rule(m, w, messages, weights, state, ctx)
    if (ctx.round + 1) % m.args.refactor_every == 0:
        for a_name in [n for n in new if is_lora_a(n)]:
            b_name = lora_b_name(a_name)
            new[b_name], new[a_name] = svd_refactor(new[b_name], new[a_name])
    return new


def fedsa_rule(m, w, messages, weights, state, ctx):
    new = list_average([x["shared"] for x in messages], weights)
    if m.args.global_b == "mean":
        new.update(list_average([x["eval_B"] for x in messages], weights))
    else:
        new.update({n: g.clone() for n, g in w.items() if is_lora_b(n)})
    return {n: new[n] for n in w}


def local_rule(m, w, messages, weights, state, ctx):
    return clone(w)


LIST_RULES = {Scaffold: scaffold_rule, FedDyn: feddyn_rule, FedOpt: fedopt_rule, FedGloSS: fedgloss_rule,
              FedSVD: fedsvd_rule, FFALoRA: ffa_rule, FedSALoRA: fedsa_rule, Local: local_rule, Method: fedavg_rule}


def list_rule(method: Method):
    return next(LIST_RULES[cls] for cls in type(method).__mro__ if cls in LIST_RULES)


# every method with its default arguments, and the arguments that change its server rule
CASES = [(name, {}) for name in sorted(METHODS)] + [
    ("fedgloss", {"admm": False}), ("fedsa-lora", {"global_b": "init"}), ("fedsvd", {"refactor_every": 2})]
SHAPES = {"l0.lora_A.default.weight": (4, 6), "l0.lora_B.default.weight": (5, 4),
          "l1.lora_A.default.weight": (4, 3), "l1.lora_B.default.weight": (7, 4)}


def random_messages(method, w, count):
    shape = validate.expected_message(method, w)
    return [{g: {n: torch.randn(s) for n, (s, _) in ts.items()} for g, ts in shape.items()} for _ in range(count)]


def assert_same_bits(a, b, what):
    assert a.keys() == b.keys(), what
    for n in a:
        if isinstance(a[n], dict):
            assert_same_bits(a[n], b[n], f"{what}/{n}")
        else:
            assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), f"{what}/{n}"


@pytest.mark.parametrize("name, args", CASES, ids=[f"{n}{a or ''}" for n, a in CASES])
def test_streaming_gives_the_list_rules_bits_and_touches_the_state_only_in_finish(name, args):
    torch.manual_seed(0)
    cls = METHODS[name]
    method = cls(cls.Args(**args))
    w = {n: torch.randn(s) for n, s in SHAPES.items()}
    streamed_state = method.init_server_state(w)
    listed_state = copy.deepcopy(streamed_state)
    streamed = listed = w
    for r, (ids, sizes) in enumerate([([0, 2, 3], [3, 7, 5]), ([1, 3, 4], [11, 2, 6])]):  # 3 of N = 5, unequal
        weights = data_weights(sizes)
        ctx = RoundContext(r, 5, ids)
        messages = random_messages(method, w, len(ids))
        before = copy.deepcopy(streamed_state)
        aggregation = method.start_aggregation(streamed, weights, streamed_state, ctx)
        for i, message in enumerate(messages):
            aggregation.add(i, message)
        assert_same_bits(streamed_state, before, f"{name} round {r}: server state before finish")
        streamed = aggregation.finish()
        listed = list_rule(method)(method, listed, messages, weights, listed_state, ctx)
        assert_same_bits(streamed, listed, f"{name} round {r}: global")
        assert_same_bits(streamed_state, listed_state, f"{name} round {r}: server state")
        assert list(streamed) == list(w), "the engine's order of names"


# ---- (c) the contract of the streaming interface --------------------------------------------------
def test_replies_are_added_once_each_in_client_order_and_all_before_finish():
    weights = [0.25, 0.75]
    message = {"params": {"x": torch.tensor([1.0, 2.0])}}
    aggregation = METHODS["fedavg"]().start_aggregation({"x": torch.zeros(2)}, weights, {}, RoundContext(0, 2, [0, 1]))
    with pytest.raises(ValueError, match="reply 1 added, expected reply 0"):
        aggregation.add(1, message)
    aggregation.add(0, message)
    with pytest.raises(ValueError, match="reply 0 added, expected reply 1"):
        aggregation.add(0, message)
    with pytest.raises(ValueError, match="1 of 2 replies added"):
        aggregation.finish()
    aggregation.add(1, {"params": {"x": torch.tensor([5.0, 6.0])}})
    with pytest.raises(ValueError, match="reply 2 added, but the round has 2 participants"):
        aggregation.add(2, message)
    assert aggregation.finish()["x"].tolist() == [0.25 * 1 + 0.75 * 5, 0.25 * 2 + 0.75 * 6]  # [4, 5]
    with pytest.raises(ValueError, match="a second time"):
        aggregation.finish()


def test_a_running_sum_is_the_weighted_sum_by_hand_and_leaves_the_messages_alone():
    a, b = {"x": torch.tensor([2.0, -4.0])}, {"x": torch.tensor([6.0, 8.0])}
    running = WeightedSum([0.5, 0.25], "g")
    running.add(0, {"g": a})
    running.add(1, {"g": b})
    assert running.result()["x"].tolist() == [0.5 * 2 + 0.25 * 6, 0.5 * -4 + 0.25 * 8]  # [2.5, 0]
    assert a["x"].tolist() == [2.0, -4.0] and b["x"].tolist() == [6.0, 8.0]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_method_that_needs_only_the_data_weighted_sum_keeps_only_that(name):
    """`needs_each_upload` None: each running sum is Σ_k p_k m_k of one message group, so the
    Flower app may hand the rule a sum it never saw the terms of (SecAgg+, DP)."""
    method = METHODS[name]()
    w = {n: torch.zeros(s) for n, s in SHAPES.items()}
    weights = data_weights([3, 7, 5])
    sums = method.aggregation_sums(w, weights, method.init_server_state(w), RoundContext(0, 5, [0, 1, 2]))
    data_weighted = all(type(s) is WeightedSum and s.weights == weights for s in sums.values())
    groups = [s.group for s in sums.values() if type(s) is WeightedSum]
    if method.needs_each_upload() is None:
        assert data_weighted and len(set(groups)) == len(groups), name
    elif name in ("scaffold", "feddyn", "fedgloss"):  # the others upload nothing (local)
        assert not data_weighted, name


def test_the_dp_running_mean_gives_the_list_means_bits():
    """`privacy.WeightedMean` (the Flower server's mean under DP) against the list expression it
    replaced: Σ_k p_k m_k in float64, cast back to the uploads' dtype."""
    from pflalign.flower import privacy

    torch.manual_seed(0)
    messages = [{"params": {n: torch.randn(s) for n, s in SHAPES.items()}, "other": {"x": torch.randn(9)}}
                for _ in range(3)]
    weights = data_weights([3, 7, 5])
    listed = {g: {n: sum(w * m[g][n].double() for m, w in zip(messages, weights)).to(t.dtype)
                  for n, t in ts.items()} for g, ts in messages[0].items()}
    running = privacy.WeightedMean(weights)
    for i, message in enumerate(messages):
        running.add(i, message)
    assert_same_bits(running.result(), listed, "mean")


# ---- (b) one client's update at a time ----------------------------------------------------------
def tensors_alive(refs) -> int:
    return sum(ref() is not None for ref in refs)


@pytest.mark.parametrize("method", ["fedavg", "scaffold"])
def test_the_engine_holds_one_clients_message_at_a_time(tmp_path, monkeypatch, method):
    """When a client's rule returns its message, every earlier participant's message of the round
    is gone (its tensors freed), and the last one is gone once the round is aggregated."""
    cfg = build_config(None, {**json.loads(json.dumps(TINY)), "method": method, "rounds": 1,
                              "data": {**TINY["data"], "clients": ["arithmetic", "sorting", "key_value", "uppercase"]}})
    fed = Federation(cfg, progress=False, out=tmp_path)
    earlier, alive_at_end = [], []  # weak references to the messages' tensors, per client
    client_end = fed.method.client_end

    def spy(global_params, params, state, scratch):
        alive_at_end.append(sum(tensors_alive(refs) for refs in earlier))
        message = client_end(global_params, params, state, scratch)
        earlier.append([weakref.ref(t) for ts in message.values() for t in ts.values()])
        return message

    monkeypatch.setattr(fed.method, "client_end", spy)
    record = fed.train_round(0)
    assert len(earlier) == 4 and all(earlier)
    assert alive_at_end == [0, 0, 0, 0], "earlier participants' messages still held"
    assert sum(tensors_alive(refs) for refs in earlier) == 0 and all(not res.message for res in record.results)


def test_the_flower_strategy_decodes_one_update_at_a_time(tiny_llama, monkeypatch):
    """`collect_train`: every update that the strategy decodes (to check it, then to add it) is
    freed before the next is decoded; the result is the data-weighted average of the updates."""
    from pflalign.flower import wire
    from test_flower_defaults import _reply, _strategy, honest_round

    w0 = tiny_llama.get_lora()
    _, honest = honest_round(tiny_llama, w0, "fedavg")
    updates = [{"params": {n: t + 1e-3 * (k + 1) for n, t in honest.message["params"].items()}} for k in range(3)]
    strategy = _strategy(tiny_llama, w0)
    replies = {k: _reply(update, n_train=4 * (k + 1)) for k, update in enumerate(updates)}
    monkeypatch.setattr(strategy, "_match", lambda _: (replies, {}))
    decoded, alive_at_decode = [], []
    unpack = wire.unpack

    def spy(*args, **kwargs):
        alive_at_decode.append(sum(tensors_alive(refs) for refs in decoded))
        update = unpack(*args, **kwargs)
        decoded.append([weakref.ref(t) for ts in update.values() for t in ts.values()])
        return update

    monkeypatch.setattr(wire, "unpack", spy)
    outcome = strategy.collect_train(1, [])
    assert outcome.record.clients == [0, 1, 2] and not outcome.rejected
    assert alive_at_decode == [0] * len(decoded), "an earlier decoded update still held"
    assert len(decoded) == 6  # each update twice: to check it, then to add it
    expected = fedavg_rule(None, w0, updates, data_weights([4, 8, 12]), {}, None)
    assert_same_bits(outcome.record.global_params, expected, "global")
