"""Scoring in one decoding loop (`--batch clients`, run/batched_scoring.py): each row generates
with its own adapter (model/multi_lora.py's routing, nothing merged), and the predictions are the
sequential path's word for word (each adapter merged into the base, its prompts alone)."""

from __future__ import annotations

import json

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.config import build_config
from pflalign.data import Example
from pflalign import evaluate
from pflalign.evaluate import generate
from pflalign.model import multi_lora
from pflalign.prompts import encode_prompt
from pflalign.run import batched_scoring
from pflalign.run.batched_scoring import generate_per_adapter
from pflalign.run.engine import Federation, run

from test_engine import TINY

TEXTS = ("Hi", "Sort these numbers: 5, 3, 9, 1", "Name a colour.", "Translate to French: the cat sits on the mat",
         "2+2=?", "Why?", "List three fruits, then say which one is the sweetest and why.", "ok")


def prompts_of(lm, texts, start: str = "") -> list[list[int]]:
    return [encode_prompt(lm.tokenizer, Example(start + t, ""), 256)[0] for t in texts]


def adapters_apart(lm, count: int, seed: int = 1) -> list[dict]:
    """`count` adapters far from each other: the model's plus noise of 0.2 on every tensor (B ≠ 0)."""
    g = torch.Generator().manual_seed(seed)
    return [{n: t + 0.2 * torch.randn(t.shape, generator=g) for n, t in lm.get_lora().items()} for _ in range(count)]


def one_at_a_time(lm, sets, max_new_tokens: int, batch_size: int) -> list[list[str]]:
    """The sequential path (client.score_client): each set's adapter merged into the base, its prompts alone."""
    saved = lm.get_lora()
    try:
        outputs = []
        for adapter, prompts in sets:
            lm.set_lora(adapter)
            with lm.merged():
                outputs.append(generate(lm.model, lm.tokenizer, prompts, max_new_tokens, batch_size, progress=False))
        return outputs
    finally:
        lm.set_lora(saved)


def federation_sets(lm, texts=TEXTS, start: str = ""):
    """Two clients' personalized adapters over 3 and 5 prompts of their own, and the global adapter
    (one object) over each client's prompts: 4 sets, 3 adapters, 8 prompts of 7 lengths (two alike)."""
    prompts = prompts_of(lm, texts, start)
    assert len({len(p) for p in prompts}) == 7
    mine, yours, global_ = adapters_apart(lm, 3)
    first, second = prompts[:3], prompts[3:]
    return [(mine, first), (yours, second), (global_, first), (global_, second)]


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_opt"])
@pytest.mark.parametrize("gather", [False, True], ids=["runs", "gathered"])
def test_one_loop_gives_each_adapter_its_own_predictions(request, family, gather, monkeypatch):
    """Clients of 3 and 5 prompts, each with its personalized adapter and the global one, in one loop:
    word for word each adapter's merged generation alone, in groups of 1, 3 (rows of several
    adapters and lengths, groups joining as rows end) and all. `gathered`: each row's factors
    gathered for two batched products a projection (multi_lora.GATHER_DEVICES, CUDA's path, here
    forced on the CPU) instead of a pair of products per run of rows."""
    lm = request.getfixturevalue(family)
    sets = federation_sets(lm)
    calls = []
    if gather:
        monkeypatch.setattr(multi_lora, "GATHER_DEVICES", {"cpu", "cuda"})
        real_bmm = torch.bmm
        monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or real_bmm(*a, **k))
    for batch_size in (1, 3, 64):
        expected = one_at_a_time(lm, sets, 12, batch_size)
        assert generate_per_adapter(lm, sets, 12, batch_size) == expected, batch_size
    assert bool(calls) == gather  # the gathered path ran, and only where asked
    # the adapters really differ: a loop that mixed them up could not give every set its own answers
    assert expected[0] != expected[2] and expected[1] != expected[3]
    assert all(any(answer) for answers in expected for answer in answers)


def test_one_loop_under_cudas_memory_bound_keeps_each_adapters_predictions(tiny_llama, monkeypatch):
    """`eval.batch_size=auto` on CUDA (`evaluate.decode_plan`, forced here on the CPU): groups of
    as many rows as half the memory bound holds, each group's rows ordered by adapter, so that every
    prefill routes runs of rows, not a change of adapter per row; the answers stay each adapter's alone."""
    lm = tiny_llama
    sets = federation_sets(lm)
    per_token, _ = evaluate.kv_bytes_per_token(lm.model.get_base_model().config, torch.float32)
    longest = max(len(p) for _, prompts in sets for p in prompts) + 12
    memory = evaluate.DecodeMemory(8 * longest * per_token, per_token, 0, 0)  # 4 of the longest rows a group
    monkeypatch.setattr(evaluate, "decode_plan", lambda model, batch_size: (64, memory))
    routed = []
    real_router = multi_lora.row_router

    def spying_router(*args, **kwargs):
        route = real_router(*args, **kwargs)
        return lambda owners, n: routed.append((list(owners), n)) or route(owners, n)

    monkeypatch.setattr(multi_lora, "row_router", spying_router)
    assert generate_per_adapter(lm, sets, 12, "auto") == one_at_a_time(lm, sets, 12, 1)
    prefills = [owners for owners, n in routed if n > 1]
    assert len(prefills) >= 3  # 16 prompts, 64 rows allowed: the bound cut them into groups
    assert all(owners == sorted(owners) for owners in prefills)  # a group's rows by adapter


def test_a_shared_start_is_prefilled_once_per_adapter(tiny_llama):
    """Prompts that share their first tokens (a chat template's system prompt): the shared start's
    keys and values depend on the adapter, so it is prefilled in one forward of a row per adapter
    and each prompt continues from its adapter's row; the answers stay each adapter's alone."""
    lm = tiny_llama
    sets = federation_sets(lm, start="You are a careful assistant who answers in few words. ")
    widths = []
    original = lm.model.forward
    lm.model.forward = lambda *a, **k: widths.append(tuple(k["input_ids"].shape)) or original(*a, **k)
    try:
        got = generate_per_adapter(lm, sets, 12, 3)
    finally:
        lm.model.forward = original
    assert widths[0][0] == 3 and widths[0][1] >= 12  # the first forward: the shared start, one row per adapter
    assert got == one_at_a_time(lm, sets, 12, 3)


def test_the_comparison_catches_rows_on_the_wrong_adapter(tiny_llama, monkeypatch):
    """The check above can fail: with every row routed to adapter 0 the predictions are no longer
    each adapter's."""
    lm = tiny_llama
    sets = federation_sets(lm)
    right = generate_per_adapter(lm, sets, 12, 3)
    wrong_router = multi_lora.row_router

    def all_on_the_first(model, names, adapters):
        route = wrong_router(model, names, adapters)
        return lambda owners, n: route([0] * len(owners), n)

    monkeypatch.setattr(multi_lora, "row_router", all_on_the_first)
    assert generate_per_adapter(lm, sets, 12, 3) != right


# ---- a run -------------------------------------------------------------------------------------
@pytest.fixture
def far_start(monkeypatch, tmp_path):
    """Runs whose w^0 is the seeded LoRA plus noise of 0.2 (B ≠ 0), and a cache of their own: the
    tiny random models answer only a special token (text "") from the base and from adapters
    near it, so without it every model's predictions would be "" and equal whatever the loop did."""
    from pflalign.model import FederatedLM

    build = FederatedLM.build

    def far(*args, **kwargs):
        lm = build(*args, **kwargs)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for t in lm.lora.values():
                t.add_(0.2 * torch.randn(t.shape, generator=g))
        return lm

    monkeypatch.setattr(FederatedLM, "build", classmethod(lambda cls, *a, **k: far(*a, **k)))
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))


def own_data(tmp_path):
    """A `files` federation of three clients of 10, 20 and 30 rows: 2, 4 and 6 test prompts of many lengths."""
    rows = []
    for who, n in (("alpha", 10), ("beta", 20), ("gamma", 30)):
        for i in range(n):
            rows.append({"instruction": f"{who} question {i}: " + "why " * (i % 7), "response": f"answer {i % 5}",
                         "who": who})
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"name": "files", "dir": str(path), "partition_by": "who", "test_fraction": 0.2}


def tiny_run(tmp_path, method: str, **over):
    """TINY on `own_data` at lr 0.5 (clients' models apart), 8 new tokens, scored after every round
    too (its first 3 test prompts), with `over` (``eval``: keys added to TINY's)."""
    cfg = json.loads(json.dumps(TINY))
    cfg["eval"].update({"max_new_tokens": 8, "every": 1, "every_max_test": 3, **over.pop("eval", {})})
    cfg.update({"method": method, "data": own_data(tmp_path), "lr": 0.5, **over})
    return build_config(None, cfg)


TIMINGS = {"seconds_eval", "seconds_train_this_session", "seconds_eval_by_model"}


def written(out) -> tuple[dict, list[dict], list[dict]]:
    """results.json without its timings and "batch", predictions.jsonl, the round_eval lines."""
    results = json.loads((out / ckpt.RESULTS).read_text())
    assert set(results["seconds_eval_by_model"]) == {"personalized", "global", "base"}
    results = {k: v for k, v in results.items() if k not in TIMINGS | {"batch"}}
    rounds = [r for r in ckpt.metrics_rows(out / ckpt.METRICS) if r["event"] == "round_eval"]
    return results, [json.loads(line) for line in (out / ckpt.PREDICTIONS).read_text().splitlines()], rounds


def scored_again(out, batch: str) -> tuple[dict, list[dict]]:
    """The finished run in `out` scored again from its checkpoint, `batch` one way or the other."""
    cfg = build_config(None, json.loads((out / ckpt.CONFIG).read_text()))
    fed = Federation(cfg, progress=False, out=out, batch=batch)
    try:
        fed.restore(ckpt.load_run_checkpoint(out))
        results, predictions = fed.evaluate()
    finally:
        fed.close()
    return {k: v for k, v in results.items() if k != "seconds_eval_by_model"}, predictions


@pytest.mark.parametrize("method", ["fedavg", "fedsa-lora"])  # the client's own model; one made at the end
def test_a_run_with_batched_clients_writes_the_sequential_results(tmp_path, far_start, method):
    """A run with --batch clients (training in lockstep, scoring in one loop, also each round's
    `eval.every` scoring) writes the sequential run's results.json, predictions and round_eval
    lines; and the sequential run's own checkpoint scored in one loop gives its scores exactly."""
    cfg = tiny_run(tmp_path, method, participation=0.67, rounds=1)  # one client never trains: w^r is its model
    run(cfg, tmp_path / "one", progress=False)
    results = run(cfg, tmp_path / "together", progress=False, batch="clients")
    assert results["batch"] == "clients"
    sequential = written(tmp_path / "one")
    assert [c["n_test"] for c in sequential[0]["clients"]] == [2, 4, 6]
    predictions = sequential[1]
    # models that answer apart, so that a mix-up of adapters would show
    assert sum(p["personalized"] != p["global"] for p in predictions) >= 3
    assert len({p["personalized"] for p in predictions}) >= 6
    assert written(tmp_path / "together") == sequential
    assert scored_again(tmp_path / "one", "clients") == scored_again(tmp_path / "one", "none")


def test_the_loop_scores_a_run_without_merging(tmp_path, far_start, monkeypatch):
    """--batch clients scores no adapter by merging it into the base (the base model aside)."""
    from pflalign.model import FederatedLM

    merges = []
    original = FederatedLM.merged
    monkeypatch.setattr(FederatedLM, "merged", lambda self: merges.append(1) or original(self))
    spy = []
    monkeypatch.setattr(batched_scoring, "generate_per_adapter",
                        lambda lm, sets, *a, **k: spy.append(len(sets)) or generate_per_adapter(lm, sets, *a, **k))
    run(tiny_run(tmp_path, "fedavg", eval={"base_model": False}), tmp_path / "x", progress=False, batch="clients")
    assert merges == [] and spy == [6, 6, 6]  # rounds 1 and 2 (eval.every), the end: 3 clients × 2 models
