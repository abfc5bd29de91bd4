"""Clients in lockstep (`--batch clients`): several adapters over one base in one pass
(model/multi_lora.py), each client's loss and gradient its own, and every method's run equal
to the one-client-at-a-time run within 1e-5 relative (every step's loss, every adapter)."""

from __future__ import annotations

import json

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.config import build_config, make_method
from pflalign.errors import UserError
from pflalign.methods import METHODS
from pflalign.model import FederatedLM, LoraSettings
from pflalign.prompts import IGNORE
from pflalign.run.client import local_round
from pflalign.run.client_store import client_records
from pflalign.run.engine import run
from pflalign.run.lockstep import lockstep_round, own_adapter, resolve_batch

from test_engine import TINY

TOL = 1e-5


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    """‖a − b‖ ≤ tol · ‖b‖ (a tensor of zeros: equal)."""
    return float((a.double() - b.double()).norm()) <= tol * float(b.double().norm())


def assert_close_params(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    bad = [n for n in a if not close(a[n], b[n])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[0]}"


def assert_close_state(a: dict, b: dict, what: str) -> None:
    """A method state's group (SCAFFOLD's c, pFLAlign's v ...) within TOL over all its tensors
    together. Per tensor would be too strict for state made of differences of near-equal
    weights: SCAFFOLD's c = (w^r − w_T) / (Tη) for a LoRA A that barely moves (B starts at 0)
    keeps float32's rounding of w over a tiny difference (2e-5 relative there, with every
    adapter within 2e-7)."""
    assert a.keys() == b.keys(), what
    diff = sum(float((a[n].double() - b[n].double()).norm()) ** 2 for n in a) ** 0.5
    norm = sum(float(b[n].double().norm()) ** 2 for n in b) ** 0.5
    assert diff <= TOL * norm, f"{what}: {diff:.3g} apart, norm {norm:.3g}"


def batch(lm, lengths: list[int], seed: int) -> dict:
    """A right-padded minibatch of random tokens, the second half of each example the response."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 200, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), IGNORE)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        labels[i, n // 2:n] = ids[i, n // 2:n]
    ids[mask == 0] = lm.tokenizer.pad_token_id
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def adapters_apart(lm, count: int) -> list[dict]:
    """`count` client adapters, each the model's moved by its own noise (B ≠ 0: every branch counts)."""
    out = []
    g = torch.Generator().manual_seed(7)
    for _ in range(count):
        live = own_adapter(lm.lora)
        with torch.no_grad():
            for t in live.values():
                t.add_(torch.randn(t.shape, generator=g) * 0.05)
        out.append(live)
    return out


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_opt"])
@pytest.mark.parametrize("unpadded", [True, False], ids=["packed-rows", "padded"])
def test_one_pass_gives_each_client_its_own_loss_and_gradient(request, family, unpadded):
    """Three clients of unequal lengths and batch sizes in one pass (packed rows of 128 tokens: a
    row holds several clients' examples, a client spans rows, one example is longer than a row),
    against each client alone through `loss_and_grads`."""
    lm = request.getfixturevalue(family)
    batches = [batch(lm, [30, 50], 1), batch(lm, [200, 17, 90], 2), batch(lm, [64, 64], 3)]
    adapters = adapters_apart(lm, 3)
    saved = lm.get_lora()
    try:
        losses = lm.routed_loss_and_grads(batches, adapters, unpadded=unpadded, pack_tokens=128)
        for j, (b, adapter) in enumerate(zip(batches, adapters)):
            lm.set_lora(adapter)
            loss, grads = lm.loss_and_grads(b, unpadded=unpadded, pack_tokens=128)
            assert losses[j] == pytest.approx(loss, rel=TOL), j
            assert_close_params({n: p.grad for n, p in adapter.items()}, grads, f"client {j}'s gradient")
            assert float(grads[next(n for n in grads if "lora_B" in n)].norm()) > 0  # a gradient to compare
    finally:
        lm.set_lora(saved)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_opt"])
def test_a_padded_pass_of_equal_batches_takes_every_clients_lora_products_in_batched_matmuls(
        request, family, monkeypatch):
    """A GPU's padded pass of clients with equal batch sizes: every client's run of tokens has one
    size, so each routed projection computes all clients' LoRA products in two torch.bmm calls
    over the stacked adapters instead of two products per client; still each client's own loss
    and gradient, as alone."""
    lm = request.getfixturevalue(family)
    batches = [batch(lm, [30, 50], 1), batch(lm, [64, 12], 2), batch(lm, [40, 40], 3)]
    adapters = adapters_apart(lm, 3)
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(a[0].shape[0]) or real_bmm(*a, **k))
    saved = lm.get_lora()
    try:
        losses = lm.routed_loss_and_grads(batches, adapters, unpadded=False)
        assert calls and set(calls) == {3}  # every batched product over the 3 clients
        monkeypatch.setattr(torch, "bmm", real_bmm)
        for j, (b, adapter) in enumerate(zip(batches, adapters)):
            lm.set_lora(adapter)
            loss, grads = lm.loss_and_grads(b, unpadded=False)
            assert losses[j] == pytest.approx(loss, rel=TOL), j
            assert_close_params({n: p.grad for n, p in adapter.items()}, grads, f"client {j}'s gradient")
    finally:
        lm.set_lora(saved)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_opt"])
def test_a_batched_pass_hands_each_client_its_gradients_without_copying_them(request, family, monkeypatch):
    """On CUDA (flat buffers, forced here) autograd hands each LoRA tensor its gradient, and copies
    one laid out otherwise than its tensor (a clone: an allocation and a copy). The batched products
    of a padded pass are taken so that the stacked factors' gradients come back in their own
    layout: a client more adds no such copy for its tensors (before: two operations a routed
    tensor a client, 10,080 a step at SmolLM2's 420 tensors and 12 clients)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pflalign import params as P

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket.__name__ in ("copy_", "new_empty_strided")
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(P, "FLAT_DEVICES", {"cpu", "cuda"})
    lm = request.getfixturevalue(family)
    copies = {}
    for k in (2, 3):
        batches = [batch(lm, [20, 20], seed) for seed in range(k)]
        adapters = adapters_apart(lm, k)
        lm.routed_loss_and_grads(batches, adapters, unpadded=False)  # the first pass makes the buffers
        counted = Copies()
        with counted:
            lm.routed_loss_and_grads(batches, adapters, unpadded=False)
        copies[k] = counted.n
    assert copies[3] - copies[2] <= 1, copies  # 1 measured (2026-11-29); 33 and 49 before


def test_a_shared_pass_runs_the_fused_mlp_with_each_clients_adapter(tiny_llama, monkeypatch):
    """On a Llama model the shared pass takes the fused LoRA MLP (model/lora_mlp.py) under the
    routing, every MLP call with runs of more than one client (the equalities above then hold
    for that kernel, not PEFT's modules)."""
    from pflalign.model import lora_mlp

    seen, apply = [], lora_mlp.LoraSwiGLU.apply
    monkeypatch.setattr(lora_mlp.LoraSwiGLU, "apply", lambda *a: seen.append(a[6]) or apply(*a))
    tiny_llama.routed_loss_and_grads([batch(tiny_llama, [40], 4), batch(tiny_llama, [60], 5)],
                                     adapters_apart(tiny_llama, 2), pack_tokens=512)
    assert len(seen) == tiny_llama.model.config.num_hidden_layers  # one packed row holds both clients
    assert all(runs is not None and {j for j, _ in runs} == {0, 1} for runs in seen)


def test_a_client_in_the_pass_changes_no_other_clients_gradient(tiny_llama):
    """Client 1's gradient is the same whether client 0 shares its pass or not: no cross-talk
    between the rows of one pass (the test that would fail if an adapter leaked into another
    client's tokens)."""
    lm = tiny_llama
    batches = [batch(lm, [40, 80], 4), batch(lm, [60, 30], 5)]
    adapters = adapters_apart(lm, 2)
    lm.routed_loss_and_grads(batches, adapters, pack_tokens=512)  # one row holds both clients
    shared = {n: p.grad.clone() for n, p in adapters[1].items()}
    lm.routed_loss_and_grads(batches[1:], adapters[1:], pack_tokens=512)
    assert_close_params({n: p.grad for n, p in adapters[1].items()}, shared, "client 1's gradient")
    with torch.no_grad():  # and a changed client 0 changes nothing of client 1's
        for t in adapters[0].values():
            t.mul_(3.0)
    lm.routed_loss_and_grads(batches, adapters, pack_tokens=512)
    assert_close_params({n: p.grad for n, p in adapters[1].items()}, shared, "client 1's gradient")


@pytest.mark.parametrize("method", ["fedavg", "fedsam", "pflalign"])
def test_clients_with_fewer_steps_drop_out_of_the_pass(tiny_llama, method):
    """Clients of 3, 1 and 2 local steps in lockstep, against each one's `local_round` alone: the
    same losses and adapters (FedSAM's second gradient, taken for one client alone, too)."""
    lm = tiny_llama
    rule = METHODS[method]()
    w0 = lm.get_lora()
    steps = [[batch(lm, [40, 70], 10 + t) for t in range(3)], [batch(lm, [90], 20)],
             [batch(lm, [20, 30, 25], 30 + t) for t in range(2)]]
    received = rule.broadcast(w0, rule.init_server_state(w0))
    states = [rule.init_client_state(w0) for _ in steps]
    together = lockstep_round(lm, rule, states, w0, received, steps, 0.5, 0, ["a", "b", "c"])
    for k, batches in enumerate(steps):
        alone_state = rule.init_client_state(w0)
        alone = local_round(lm, rule, alone_state, w0, received, batches, 0.5, 0)
        assert together[k].losses == pytest.approx(alone.losses, rel=TOL)
        assert_close_params(together[k].personalized, alone.personalized, f"client {k}")
        for group in alone_state:
            assert_close_state(states[k][group], alone_state[group], f"client {k}'s state {group}")
    lm.set_lora(w0)


def train_steps(out) -> list[tuple]:
    rows = [json.loads(line) for line in (out / ckpt.METRICS).read_text().splitlines()]
    return [(r["round"], r["client"], r["step"], r["loss"]) for r in rows if r["event"] == "train_step"]


def assert_runs_close(a, b) -> None:
    """Every train-step loss and every adapter (global, each client's personalized one) of run `b`
    within TOL of run `a`'s, tensor by tensor; the server's and clients' method states by group."""
    steps_a, steps_b = train_steps(a), train_steps(b)
    assert [s[:3] for s in steps_b] == [s[:3] for s in steps_a]
    for (r, k, t, la), (_, _, _, lb) in zip(steps_a, steps_b):
        assert lb == pytest.approx(la, rel=TOL), f"round {r} client {k} step {t}"
    saved_a, saved_b = ckpt.load_checkpoint(a / ckpt.CHECKPOINT), ckpt.load_checkpoint(b / ckpt.CHECKPOINT)
    assert_close_params(saved_b["global"], saved_a["global"], "global adapter")
    for group in saved_a["server_state"]:
        assert_close_state(saved_b["server_state"][group], saved_a["server_state"][group], f"server {group}")
    method = make_method(build_config(None, json.loads((a / ckpt.CONFIG).read_text())))
    fresh = lambda: method.init_client_state(saved_a["global"])  # noqa: E731
    for ca, cb in zip(client_records(a, saved_a, fresh), client_records(b, saved_b, fresh)):
        assert (ca["personalized"] is None) == (cb["personalized"] is None)
        if ca["personalized"] is not None:
            assert_close_params(cb["personalized"], ca["personalized"], f"{ca['name']} personalized")
        for group in ca["state"]:
            assert_close_state(cb["state"][group], ca["state"][group], f"{ca['name']} state {group}")
        assert ca["steps_taken"] == cb["steps_taken"]


def tiny(method: str, **over):
    return build_config(None, {**json.loads(json.dumps(TINY)), "method": method, **over})


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_in_lockstep_equals_one_client_at_a_time(tmp_path, method):
    """The pinned tiny run of every method (test_pinned_results.py), with --batch clients."""
    run(tiny(method), tmp_path / "one", progress=False)
    results = run(tiny(method), tmp_path / "lockstep", progress=False, batch="clients")
    assert results["batch"] == "clients"
    assert_runs_close(tmp_path / "one", tmp_path / "lockstep")


def test_sampled_clients_of_unequal_sizes_in_lockstep(tmp_path):
    """Partial participation (a round's sample), three clients of unequal data sizes, SCAFFOLD's
    control variates: equal to the sequential run."""
    over = {"participation": 0.67, "rounds": 3,
            "data": {**TINY["data"], "clients": ["arithmetic", "sorting", "key_value"], "max_train": None}}
    cfg = tiny("scaffold", **over)
    run(cfg, tmp_path / "one", progress=False)
    run(cfg, tmp_path / "lockstep", progress=False, batch="clients")
    assert_runs_close(tmp_path / "one", tmp_path / "lockstep")


@pytest.mark.parametrize("args, why", [
    ({"batch": "rows"}, "--batch must be one of auto, none, clients"),
    ({"batch": "clients", "workers": 2}, "use --workers 1"),
])
def test_lockstep_refusals(tmp_path, args, why):
    with pytest.raises(UserError, match=why):
        run(tiny("fedavg"), tmp_path / "x", progress=False, **args)
    assert not (tmp_path / "x" / ckpt.RESULTS).exists()


def test_gradient_accumulation_refused_in_one_line(tmp_path):
    cfg = tiny("fedavg", optimizer={"grad_accumulation": 2}, batch_size=1)
    with pytest.raises(UserError, match="gradient accumulation") as info:
        run(cfg, tmp_path / "x", progress=False, batch="clients")
    assert "\n" not in str(info.value)


def test_refused_on_the_command_line_with_status_2(tmp_path, capsys):
    from pflalign.cli import main

    code = main(["run", "--out", str(tmp_path / "x"), "--batch", "clients", "--workers", "2",
                 "--set", "model=tiny-llama", "--set", "data.max_train=12", "--set", "rounds=1"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--workers 1" in err[0]


def test_divergence_names_the_client_and_keeps_the_last_checkpoint(tmp_path):
    """A run that diverges in lockstep says which client, round and step, as the sequential engine
    does (test_engine.py), and leaves the folder as after the last good round."""
    from pflalign.errors import TrainingDiverged

    out = tmp_path / "run"
    run(tiny("fedavg", rounds=3), out, stop_after=1, progress=False, batch="clients")
    before = (out / ckpt.CHECKPOINT).read_bytes(), (out / ckpt.METRICS).read_bytes()
    cfg = json.loads((out / ckpt.CONFIG).read_text())
    cfg["lr"] = 1e30
    (out / ckpt.CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(TrainingDiverged, match=r"client 0 \(arithmetic\).*round 2, local step \d.*lower learning rate; "
                                               r"the checkpoint after round 1 is kept$"):
        run(None, out, resume=True, progress=False, batch="clients", allow_recipe_change=True)
    assert ((out / ckpt.CHECKPOINT).read_bytes(), (out / ckpt.METRICS).read_bytes()) == before
    assert not (out / ckpt.RESULTS).exists()


def test_a_pass_that_runs_out_of_memory_is_split_and_the_size_that_fit_is_kept(tiny_llama, monkeypatch):
    """A device that holds at most 2 clients' activations (an OutOfMemoryError above that, as
    CUDA raises it): 5 clients in lockstep are run 2, 2, 1 per pass, the size kept for the next
    step, and each client's round is still its own (`local_round` alone)."""
    from pflalign.run.lockstep import PassSize

    lm = tiny_llama
    rule = METHODS["fedavg"]()
    w0 = lm.get_lora()
    steps = [[batch(lm, [30 + 10 * k, 50], 40 + 2 * k + t) for t in range(2)] for k in range(5)]
    received = rule.broadcast(w0, rule.init_server_state(w0))
    real, passes = type(lm).routed_loss_and_grads, []

    def small_device(self, batches, adapters, *args, **kwargs):
        passes.append(len(batches))
        if len(batches) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(self, batches, adapters, *args, **kwargs)

    one = type(lm).loss_and_grads

    def one_client(self, *args, **kwargs):  # a pass of one client takes the one-client path
        passes.append(1)
        return one(self, *args, **kwargs)

    monkeypatch.setattr(type(lm), "routed_loss_and_grads", small_device)
    monkeypatch.setattr(type(lm), "loss_and_grads", one_client)
    size = PassSize()
    states = [rule.init_client_state(w0) for _ in steps]
    together = lockstep_round(lm, rule, states, w0, received, steps, 0.5, 0, list("abcde"), size=size)
    assert passes == [5, 3, 2, 2, 1, 2, 2, 1]  # step 0: all, then halves (3 is too many), 2, 2, 1; step 1 at 2
    assert size.clients == 2
    monkeypatch.undo()
    for k, batches in enumerate(steps):
        alone = local_round(lm, rule, rule.init_client_state(w0), w0, received, batches, 0.5, 0)
        assert together[k].losses == pytest.approx(alone.losses, rel=TOL)
        assert_close_params(together[k].personalized, alone.personalized, f"client {k}")
    lm.set_lora(w0)


def test_one_client_that_does_not_fit_is_the_callers_out_of_memory(tiny_llama, monkeypatch):
    from pflalign.run.lockstep import PassSize, shared_pass

    lm = tiny_llama

    def no_device(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(type(lm), "routed_loss_and_grads", no_device)
    monkeypatch.setattr(type(lm), "loss_and_grads", no_device)
    with pytest.raises(torch.OutOfMemoryError):
        shared_pass(lm, [batch(lm, [20], 1), batch(lm, [20], 2)], adapters_apart(lm, 2), PassSize())


def test_auto_trains_clients_in_lockstep_on_cuda_only_where_lockstep_runs():
    """--batch auto (the default): lockstep on CUDA, where a shared pass of 4 clients measured
    1.25-1.81x one client's tokens/s (benchmarks/results/gpu-batched.json); one at a time on the
    CPU (its pinned results bit for bit) and wherever lockstep refuses (workers, accumulation)."""
    cfg = build_config(None, {"model": "tiny-llama"})
    accumulating = build_config(None, {"model": "tiny-llama", "optimizer": {"grad_accumulation": 2}})
    assert resolve_batch("auto", 1, cfg, "cuda") == resolve_batch("auto", 1, cfg, "cuda:1") == "clients"
    assert resolve_batch("auto", 1, cfg, "cpu") == "none"
    assert resolve_batch("auto", 2, cfg, "cuda") == resolve_batch("auto", 1, accumulating, "cuda") == "none"
    for explicit in ("none", "clients", "runs"):
        assert resolve_batch(explicit, 1, cfg, "cpu") == resolve_batch(explicit, 1, cfg, "cuda") == explicit


def test_auto_on_cuda_trains_in_lockstep_and_scores_one_model_at_a_time(tmp_path, monkeypatch):
    """--batch auto where it resolves to lockstep (CUDA; here forced on the CPU): the clients train
    in lockstep, but their models are scored one merged model at a time, the per-row decoding loop
    being unmeasured on a GPU; an explicit --batch clients scores them in one loop."""
    import pflalign.run.engine as engine

    monkeypatch.setattr(engine, "resolve_batch", lambda batch, *a: "clients" if batch == "auto" else batch)
    used = {"lockstep": 0, "one_loop": 0}
    for name, key in (("run_train_jobs_lockstep", "lockstep"), ("score_jobs_together", "one_loop")):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _real=real, _key=key, **k: used.__setitem__(_key, used[_key] + 1)
                            or _real(*a, **k))
    cfg = tiny("fedavg")
    results = run(cfg, tmp_path / "auto", progress=False)
    assert used == {"lockstep": cfg.rounds, "one_loop": 0} and results["batch"] == "clients"
    run(cfg, tmp_path / "clients", progress=False, batch="clients")
    assert used["lockstep"] == 2 * cfg.rounds and used["one_loop"] == 1


# ---- flat updates (params.aligned): CUDA's one operation over a flat buffer per update ---------
def test_aligned_gives_the_flat_buffers_only_of_consecutive_views_on_a_flat_device(monkeypatch):
    from pflalign import params as P

    like = {"a": torch.ones(2, 3), "b": torch.ones(4)}
    flat, other = P.zeros_like(like), P.zeros_like(like)
    apart = {n: torch.zeros_like(t) for n, t in like.items()}  # separately allocated
    reordered = {"b": flat["b"], "a": flat["a"]}
    assert P.flat_buffer(flat).shape == (10,) and P.flat_buffer(apart) is None and P.flat_buffer(reordered) is None
    assert P.flat_buffers(flat, other) is None  # the CPU updates tensor by tensor
    assert [tuple(t.shape) for t in P.aligned(flat, other)[1]] == [(4,), (4,)]
    monkeypatch.setattr(P, "FLAT_DEVICES", {"cpu", "cuda"})
    one, two = P.flat_buffers(flat, other)
    one.add_(1.0)  # a view: the dict's tensors see it
    assert bool((flat["a"] == 1).all() and (flat["b"] == 1).all()) and bool((two == 0).all())
    assert P.flat_buffers(flat, {"a": other["a"]}) is None
    for bad in ((flat, apart), (flat, reordered)):
        assert P.flat_buffers(*bad) is None and len(P.aligned(*bad)) == len(bad[0])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_flat_updates_train_exactly_what_tensor_by_tensor_updates_train(tmp_path, method, monkeypatch):
    """Where updates run over flat buffers (CUDA: params.FLAT_DEVICES, forced here on the CPU), a
    lockstep run's losses, adapters and method states are those of the tensor-by-tensor run bit for
    bit (the same arithmetic, coordinate by coordinate), every method, with the records between
    checkpoints in memory as on CUDA; its measurements (GSNR,
    norms, pFLAlign's step ratio) are sums in another order, equal within 1e-12. pFLAlign's step
    really ran once over the flat buffers; FFA-LoRA's (A frozen) takes the tensor-by-tensor path."""
    from pflalign import params as P
    from pflalign.methods import pflalign as pflalign_module

    run(tiny(method), tmp_path / "tensors", progress=False, batch="clients")
    monkeypatch.setattr(P, "FLAT_DEVICES", {"cpu", "cuda"})
    sizes, flat_steps = [], []
    from pflalign import optim

    descend = optim.SGD.descend
    monkeypatch.setattr(optim.SGD, "descend", lambda self, name, *a: flat_steps.append(name == P.FLAT_PIECE)
                        or descend(self, name, *a))
    step = pflalign_module.pflalign_step_
    monkeypatch.setattr(pflalign_module, "pflalign_step_", lambda w, *a, **k: sizes.append(w.shape) or step(w, *a, **k))
    # with the clients' records held in memory between checkpoints, as on CUDA (its 60 s: here one
    # checkpoint, after the last round): the combination a CUDA run takes, every method
    run(tiny(method), tmp_path / "flat", progress=False, batch="clients", checkpoint_every=3600)
    assert train_steps(tmp_path / "flat") == train_steps(tmp_path / "tensors")  # losses bit for bit
    a, b = (ckpt.load_checkpoint(tmp_path / name / ckpt.CHECKPOINT) for name in ("tensors", "flat"))
    assert all(torch.equal(a["global"][n], b["global"][n]) for n in a["global"])
    cfg = tiny(method)
    fresh = lambda: make_method(cfg).init_client_state(a["global"])  # noqa: E731
    for ca, cb in zip(client_records(tmp_path / "tensors", a, fresh), client_records(tmp_path / "flat", b, fresh)):
        assert all(torch.equal(ca["personalized"][n], cb["personalized"][n]) for n in ca["personalized"])
        for group in ca["state"]:
            assert all(torch.equal(ca["state"][group][n], cb["state"][group][n]) for n in ca["state"][group])
    rows = lambda name: [json.loads(l) for l in (tmp_path / name / ckpt.METRICS).read_text().splitlines()  # noqa: E731
                         if json.loads(l)["event"] == "client_round"]
    for ra, rb in zip(rows("tensors"), rows("flat"), strict=True):
        for key, value in ra.items():
            if isinstance(value, float) and key != "seconds":
                assert rb[key] == pytest.approx(value, rel=1e-12, abs=1e-300), key
    total = sum(t.numel() for t in a["global"].values())
    preconditioned = method.startswith("pflalign")
    assert preconditioned == bool(sizes) and all(s == (total,) for s in sizes)
    # every method that steps through the optimizer does it once over the flat buffers, where it
    # trains every tensor; FFA-LoRA and FedSVD keep A frozen: their B in one multi-tensor update
    # (SGD.descend_each), no step tensor by tensor
    descends = not preconditioned and method not in ("scaffold", "ffa-lora", "fedsvd")
    assert set(flat_steps) == ({True} if descends else set()), set(flat_steps)


def test_a_clients_file_loads_each_group_as_one_flat_buffer_in_the_adapters_order():
    """The file keeps a group's tensors in an order of its own; loaded with the adapter's order, each group
    is one flat buffer in that order (so it lines up with the live adapter: params.aligned), values
    unchanged; `moved` takes such a buffer across in one transfer."""
    from pflalign import params as P
    from pflalign.run.client_store import decode, encode
    from torch.utils._python_dispatch import TorchDispatchMode

    gen = torch.Generator().manual_seed(0)
    adapter = P.clone({n: torch.randn(s, generator=gen) for n, s in (("z.lora_A", (2, 3)), ("a.lora_B", (3, 2)),
                                                                      ("m.lora_A", (4,)))})
    state = {"v": P.clone(adapter), "P": P.zeros_like(adapter)}
    loaded, personalized = decode(encode(state, adapter), "cpu", adapter)
    for group in (*loaded.values(), personalized):
        assert list(group) == list(adapter) and P.flat_buffer(group) is not None
    assert all(torch.equal(loaded["v"][n], adapter[n]) and torch.equal(personalized[n], adapter[n]) for n in adapter)
    assert set(decode(encode(state, None), "cpu")[0]["v"]) == set(adapter)  # no order given: the file's

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += func.__name__.startswith("_to_copy")
            return func(*args, **(kwargs or {}))

    with Copies():
        there = P.moved(adapter, "meta")
    assert Copies.count == 1 and list(there) == list(adapter) and there["a.lora_B"].shape == (3, 2)


@pytest.mark.parametrize("flat", [False, True], ids=["tensor-by-tensor", "flat"])
def test_a_non_finite_value_is_found_and_named_either_way(flat, monkeypatch):
    from pflalign import params as P
    from pflalign.run.client import _non_finite

    if flat:
        monkeypatch.setattr(P, "FLAT_DEVICES", {"cpu", "cuda"})
    adapter = P.zeros_like({"a": torch.ones(2, 2), "b": torch.ones(3), "c": torch.ones(1)})
    assert _non_finite(adapter) is None
    adapter["b"][1] = float("nan")
    assert _non_finite(adapter) == "b"
    adapter["b"][1], adapter["c"][0] = 0.0, float("-inf")
    assert _non_finite(adapter) == "c"


def _peft_adapter(pairs: int, seed: int) -> dict:
    """An adapter of `pairs` LoRA pairs under PEFT's names, as one flat buffer (params.clone)."""
    from pflalign import params as P

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(pairs):
        prefix = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.default.weight"] = torch.randn(2, 6, generator=g, dtype=torch.float64)
        tensors[f"{prefix}.lora_B.default.weight"] = torch.randn(6, 2, generator=g, dtype=torch.float64)
    return P.clone(tensors)


def _hook_operations(method_name: str, pairs: int, monkeypatch) -> dict[str, int]:
    """Operations (views apart) each of a method's hooks dispatches in two client rounds of two
    clients and their aggregations, over an adapter of `pairs` LoRA pairs, updates flat (forced)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from pflalign import params as P
    from pflalign.methods.base import RoundContext, StepContext

    monkeypatch.setattr(P, "FLAT_DEVICES", {"cpu", "cuda"})
    counts, where = Counter(), ["setup"]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[where[0]] += not func.is_view
            return func(*args, **(kwargs or {}))

    def hook(name, fn, *args):
        where[0] = name
        try:
            return fn(*args)
        finally:
            where[0] = "setup"

    method = METHODS[method_name]()
    glob = _peft_adapter(pairs, 0)
    grads = [_peft_adapter(pairs, 1 + k) for k in range(2)]
    server_state = method.init_server_state(glob)
    states = [method.init_client_state(glob) for _ in range(2)]
    with Counting():
        for r in range(2):
            received, messages = method.broadcast(glob, server_state), []
            for k in range(2):
                scratch = method.new_scratch()
                start = hook("client start", method.client_start, glob, states[k], received, scratch)
                live = P.clone(start)  # the live adapter: one flat buffer, loaded with the start
                for t in range(2):
                    ctx = StepContext(r, t, 2, 0.01, glob, scratch=scratch)
                    hook("step", method.local_step, live, lambda k=k: (0.0, grads[k]), states[k], ctx)
                hook("metrics", method.round_metrics, glob, live, states[k], scratch)
                messages.append(hook("client end", method.client_end, glob, live, states[k], scratch))
            glob = hook("aggregation", method.aggregate, glob, messages, [0.5, 0.5], server_state,
                        RoundContext(r, 2, [0, 1]))
    return counts


@pytest.mark.parametrize("method", sorted(METHODS))
def test_flat_updates_take_as_many_operations_for_any_number_of_tensors(method, monkeypatch):
    """Where updates run flat (CUDA, each operation a kernel launch), a client round's start, its end,
    its measurements and the server's aggregation dispatch as many operations for 12 LoRA pairs as for
    3: nothing in them runs once per tensor (pFLAlign's w^r + Δ_k and Δ_k = w_T − w^r, SCAFFOLD's
    control variates, FedSA-LoRA's and FFA-LoRA's subsets, the server rules). Nor does the step
    (FFA-LoRA's and FedSVD's B: one multi-tensor update); only FedSVD's server, which factorises
    each pair's product."""
    few, many = (_hook_operations(method, pairs, monkeypatch) for pairs in (3, 12))
    per_tensor = {"fedsvd": {"aggregation"}}.get(method, set())
    for hook in ("client start", "step", "metrics", "client end", "aggregation"):
        if hook not in per_tensor:
            assert many[hook] == few[hook], (hook, few[hook], many[hook])
    assert few["step"] > 0


@pytest.mark.parametrize("method", ["pflalign", "scaffold", "fedsam", "ffa-lora"])
def test_the_one_client_engine_with_its_adapter_in_one_buffer_trains_bit_for_bit_the_same(tmp_path, method,
                                                                                         monkeypatch):
    """Where updates run flat (CUDA; forced here), the model's own adapter, which PEFT allocates
    tensor by tensor, is re-pointed at one flat buffer (the modules keep their Parameters), so the
    one-client engine (--batch none, Flower's clients) updates it once; its run is the
    tensor-by-tensor one bit for bit."""
    from pflalign import params as P

    run(tiny(method), tmp_path / "tensors", progress=False, batch="none")
    monkeypatch.setattr(P, "FLAT_DEVICES", {"cpu", "cuda"})
    lm = FederatedLM.build("tiny-llama", LoraSettings(r=2, alpha=4), seed=0)
    flat = P.flat_buffer({n: p.detach() for n, p in lm.lora.items()})
    assert flat is not None
    module_weights = [m.weight for name, m in lm.model.named_modules() if name.endswith("lora_A.default")]
    assert module_weights and all(w.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                                  for w in module_weights)
    run(tiny(method), tmp_path / "flat", progress=False, batch="none")
    assert train_steps(tmp_path / "flat") == train_steps(tmp_path / "tensors")
    a, b = (ckpt.load_checkpoint(tmp_path / name / ckpt.CHECKPOINT) for name in ("tensors", "flat"))
    assert all(torch.equal(a["global"][n], b["global"][n]) for n in a["global"])


def test_on_a_flat_device_the_gradients_land_in_one_buffer_of_the_adapters_kept_across_steps(monkeypatch):
    """Where updates run flat (CUDA; forced here), a backward's gradients are copied into the
    adapter's own flat buffer (one multi-tensor copy), the same buffer at every step, as the CPU's
    ``.grad`` buffers are; their values are the tensor-by-tensor gradients bit for bit, and a tensor
    the backward did not reach gets zeros there, not the last step's gradient."""
    from pflalign import params as P

    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]]), "attention_mask": torch.ones(1, 6, dtype=torch.long),
             "labels": torch.tensor([[IGNORE, IGNORE, IGNORE, 8, 9, 10]])}
    plain = FederatedLM.build("tiny-llama", LoraSettings(r=2, alpha=4), seed=0)
    with torch.no_grad():  # B != 0, so that every LoRA tensor gets a gradient
        for p in plain.lora.values():
            p.add_(0.05)
    want = P.clone(plain.loss_and_grads(batch, unpadded=False)[1])
    monkeypatch.setattr(P, "FLAT_DEVICES", {"cpu", "cuda"})
    lm = FederatedLM.build("tiny-llama", LoraSettings(r=2, alpha=4), seed=0)
    P.copy_into({n: p.detach() for n, p in lm.lora.items()}, plain.get_lora())
    _, first = lm.loss_and_grads(batch, unpadded=False)
    buffer = P.flat_buffer(first)
    assert buffer is not None and all(torch.equal(first[n], want[n]) for n in want)
    assert all(p.grad is first[n] for n, p in lm.lora.items())
    _, again = lm.loss_and_grads(batch, unpadded=False)
    assert P.flat_buffer(again).data_ptr() == buffer.data_ptr() and all(torch.equal(again[n], want[n]) for n in want)
    # a tensor the next backward does not reach (frozen for it): zeros in the buffer
    name = next(iter(lm.lora))
    lm.lora[name].requires_grad_(False)
    _, third = lm.loss_and_grads(batch, unpadded=False)
    lm.lora[name].requires_grad_(True)
    assert bool((third[name] == 0).all()) and all(torch.equal(third[n], want[n]) for n in want if n != name)
