"""Issue 40, items 1 and 2: one `Server` for both engines, and each engine's own round loop.

(a) a round on the `Server` (`start_round`, `RoundPlan.add` per message, `finish_round`) gives
    the bits of the method's list rule (`Method.aggregate`), server state included, over two
    rounds; the presummed path (Flower's SecAgg+ / DP) runs the rule on the mean with weight 1;
    a round stopped midway leaves the server as it was; `state_dict` / `load_state_dict` resume
    a server to the bits of an uninterrupted one;
(b) the in-process engine and the Flower strategy both build their rounds on it, and both
    checkpoints hold its `state_dict`;
(c) the `Recorder` only writes: the in-process round loop is `Federation.train`, one short loop.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import textwrap

import pytest
import torch

from pflalign.config import build_config
from pflalign.run.engine import Federation
from pflalign.run.lifecycle import Recorder
from pflalign.methods import METHODS
from pflalign.methods.base import RoundContext, data_weights
from pflalign.run.server import RoundPlan, Server

from test_engine import TINY
from test_streaming_aggregation import SHAPES, assert_same_bits, random_messages

ROUNDS = [([0, 2, 3], [3, 7, 5]), ([1, 3, 4], [11, 2, 6])]  # 3 of N = 5 per round, unequal sizes


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_round_on_the_server_is_the_methods_rule_bit_for_bit(name):
    torch.manual_seed(0)
    method = METHODS[name]()
    w = {n: torch.randn(s) for n, s in SHAPES.items()}
    server = Server(method, w, 5)
    listed, listed_state = w, method.init_server_state(w)
    for r, (ids, sizes) in enumerate(ROUNDS):
        messages = random_messages(method, w, len(ids))
        received = server.broadcast()
        assert_same_bits(received, method.broadcast(listed, listed_state), f"{name} round {r}: broadcast")
        plan = server.start_round(r, ids, sizes)
        assert plan.weights == data_weights(sizes) and plan.ctx == RoundContext(r, 5, ids)
        for i, message in enumerate(messages):
            plan.add(i, message)
        results = [object()] * len(ids)  # what the engine hands over for the metrics lines, as it is
        record = server.finish_round(plan, results, {"x": 1})
        listed = method.aggregate(listed, messages, data_weights(sizes), listed_state, RoundContext(r, 5, ids))
        assert_same_bits(record.global_params, listed, f"{name} round {r}: global")
        assert record.global_params is server.global_params  # w^{r+1}, returned and held
        assert_same_bits(server.state, listed_state, f"{name} round {r}: server state")
        assert (record.clients, record.results, record.weights, record.extra) == (ids, results, plan.weights,
                                                                                   {"x": 1})


@pytest.mark.parametrize("name", ["fedavg", "fedadam", "scaffold"])
def test_a_presummed_round_runs_the_rule_on_the_mean_with_weight_one(name):
    """Flower under SecAgg+ or DP: the server gets Σ_k p_k m_k and the method's rule runs on it as
    on one message of weight 1 (`Method.needs_each_upload`); `plan.weights` are still the p_k."""
    torch.manual_seed(1)
    method = METHODS[name]()
    w = {n: torch.randn(s) for n, s in SHAPES.items()}
    server, state = Server(method, w, 5), method.init_server_state(w)
    mean = random_messages(method, w, 1)[0]
    plan = server.start_round(0, [0, 2, 3], [3, 7, 5], presummed=True)
    assert plan.weights == data_weights([3, 7, 5])
    plan.add(0, mean)
    with pytest.raises(ValueError, match="reply 1 added, but the round has 1 participants"):
        plan.add(1, mean)
    got = server.finish_round(plan, []).global_params
    assert_same_bits(got, method.aggregate(w, [mean], [1.0], state, RoundContext(0, 5, [0, 2, 3])), name)
    assert_same_bits(server.state, state, f"{name}: server state")


def test_a_round_stopped_midway_leaves_the_server_as_it_was():
    torch.manual_seed(2)
    method = METHODS["scaffold"]()
    w = {n: torch.randn(s) for n, s in SHAPES.items()}
    server = Server(method, w, 5)
    before = copy.deepcopy(server.state_dict())
    plan = server.start_round(0, [0, 1], [4, 4])
    plan.add(0, random_messages(method, w, 1)[0])  # the second client never replies
    assert_same_bits(server.state_dict(), before, "server")
    assert server.global_params is w


@pytest.mark.parametrize("name", ["scaffold", "fedadam", "fedgloss"])
def test_a_resumed_server_goes_on_with_the_bits_of_an_uninterrupted_one(name, tmp_path):
    """`state_dict` through a checkpoint file and `load_state_dict` into a fresh server (the one
    restore both engines use), then round 2: the same bits as a server that never stopped."""
    from pflalign import checkpoint as ckpt

    torch.manual_seed(3)
    method = METHODS[name]()
    w = {n: torch.randn(s) for n, s in SHAPES.items()}
    messages = [random_messages(method, w, 3) for _ in ROUNDS]

    def round_on(server, r):
        ids, sizes = ROUNDS[r]
        plan = server.start_round(r, ids, sizes)
        for i, message in enumerate(messages[r]):
            plan.add(i, copy.deepcopy(message))
        return server.finish_round(plan, [])

    uninterrupted = Server(method, w, 5)
    round_on(uninterrupted, 0)
    ckpt.save_checkpoint(tmp_path / "c.pt", {"rounds_done": 1, **uninterrupted.state_dict()})
    resumed = Server(METHODS[name](), {n: torch.zeros_like(t) for n, t in w.items()}, 5)
    resumed.load_state_dict(ckpt.load_checkpoint(tmp_path / "c.pt"))
    round_on(uninterrupted, 1)
    round_on(resumed, 1)
    assert_same_bits(resumed.state_dict(), uninterrupted.state_dict(), name)


# ---- (b) both engines build their rounds on the server ------------------------------------------
def test_both_engines_build_their_rounds_and_checkpoints_on_the_server(tmp_path, tiny_llama, monkeypatch):
    from pflalign.flower import server_app
    from test_flower_defaults import _reply, _strategy, honest_round

    calls = []
    start, finish = Server.start_round, Server.finish_round
    monkeypatch.setattr(Server, "start_round", lambda self, r, chosen, sizes, presummed=False: (
        calls.append(("start", r, list(chosen), list(sizes))), start(self, r, chosen, sizes, presummed))[1])
    monkeypatch.setattr(Server, "finish_round", lambda self, plan, results, extra=None: (
        calls.append(("finish", plan.ctx.round)), finish(self, plan, results, extra))[1])

    cfg = build_config(None, {**json.loads(json.dumps(TINY)), "method": "scaffold", "rounds": 1})
    fed = Federation(cfg, progress=False, out=tmp_path)
    record = fed.train_round(0)
    sizes = [c.n_train for c in fed.clients]
    assert calls == [("start", 0, list(range(len(sizes))), sizes), ("finish", 0)]
    assert record.global_params is fed.server.global_params is fed.global_params
    assert {k: fed.checkpoint()[k] for k in ("global", "server_state")} == fed.server.state_dict()

    calls.clear()
    w0 = tiny_llama.get_lora()
    _, honest = honest_round(tiny_llama, w0, "fedavg")
    strategy = _strategy(tiny_llama, w0)
    monkeypatch.setattr(strategy, "_match", lambda _: ({k: _reply(honest.message, n_train=4 + k) for k in range(3)},
                                                       {}))
    outcome = strategy.collect_train(1, [])
    assert calls == [("start", 0, [0, 1, 2], [4, 5, 6]), ("finish", 0)]
    assert outcome.record.global_params is strategy.server.global_params
    saved = server_app.checkpoint(strategy.server, strategy)
    assert {k: saved[k] for k in ("global", "server_state")} == strategy.server.state_dict()
    assert saved["flower"] == strategy.state_dict()


# ---- (c) the loop --------------------------------------------------------------------------------
def test_the_recorder_only_writes_and_the_engine_owns_a_short_round_loop():
    """`Recorder` takes no callables (it drives nothing); `Federation.train` is one `for r in`
    loop of at most 20 lines that calls the round and `keep_round`: the Recorder's writers and
    the checkpoint."""
    for name, fn in inspect.getmembers(Recorder, inspect.isfunction):
        hints = inspect.signature(fn).parameters.values()
        assert not any("Callable" in str(p.annotation) for p in hints), f"Recorder.{name} takes a callable"
    assert not hasattr(Recorder, "train")
    tree = ast.parse(textwrap.dedent(inspect.getsource(Federation.train)))
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.For)]
    assert len(loops) == 1 and len(tree.body[0].body) < 12
    loop = loops[0]
    assert loop.end_lineno - loop.lineno + 1 <= 20
    called = {node.func.attr for node in ast.walk(loop) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute)}
    assert {"train_round", "keep_round"} <= called
    # keep_round (shared with the runs in lockstep, run/together.py): the Recorder's writers and the checkpoint
    kept = ast.parse(textwrap.dedent(inspect.getsource(Federation.keep_round)))
    assert len(kept.body[0].body) < 10
    called = {node.func.attr for node in ast.walk(kept) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute)}
    assert {"round", "round_eval", "save", "checkpoint"} <= called
    assert RoundPlan.__dataclass_fields__.keys() == {"ctx", "weights", "aggregation"}
