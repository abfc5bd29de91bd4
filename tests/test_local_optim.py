"""The clients' local optimizer (sgd | adamw), the learning-rate schedule across rounds and
gradient accumulation (pflalign.optim, issue 42): AdamW's step against hand computations
and torch.optim.AdamW, cosine values by hand, batch 4 x accumulation 2 against batch 8,
which methods refuse AdamW, and runs through the engine."""

import json
import math

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.cli import main
from pflalign.run.client import Client, accumulated_loss_and_grads, client_lr, draw_batches
from pflalign.config import build_config, to_dict
from pflalign.run.engine import run as run_in_process
from pflalign.errors import UserError
from pflalign.methods import METHODS
from pflalign.methods.base import StepContext
from pflalign.optim import SGD, AdamW, round_lr
from pflalign.data.clients import ClientShare
from pflalign.prompts import collate_train, encode_train

from test_engine import TINY
from toy import quadratic

D = torch.float64


# ---- AdamW ------------------------------------------------------------------------
def test_adamw_first_two_steps_by_hand():
    """w = (1, −2), d1 = (0.5, −0.1), d2 = (−0.2, 0.3), η = 0.1, λ = 0.01, β = (0.9, 0.999), ε = 1e-8."""
    opt = AdamW(0.9, 0.999, 1e-8, weight_decay=0.01)
    w = torch.tensor([1.0, -2.0], dtype=D)
    opt.descend("w", w, torch.tensor([0.5, -0.1], dtype=D), lr=0.1)
    # step 1: decay w(1 − ηλ) = (0.999, −1.998); m = (0.05, −0.01), v = (2.5e-4, 1e-5);
    # m̂ = (0.5, −0.1), √v̂ = (0.5, 0.1): the step is η m̂ / (√v̂ + ε) = 0.1 (1 − 2e-8, −(1 − 1e-7))
    first = [0.999 - 0.1 * 0.5 / (0.5 + 1e-8), -1.998 + 0.1 * 0.1 / (0.1 + 1e-8)]
    assert first[0] == pytest.approx(0.899000002, abs=1e-12) and first[1] == pytest.approx(-1.89800001, abs=1e-12)
    assert w.tolist() == pytest.approx(first, abs=1e-15)
    opt.descend("w", w, torch.tensor([-0.2, 0.3], dtype=D), lr=0.1)
    # step 2: m = 0.9 m + 0.1 d2 = (0.025, 0.021); v = 0.999 v + 0.001 d2² = (2.8975e-4, 9.999e-5);
    # bias corrections 1 − 0.9² = 0.19 and 1 − 0.999² = 0.001999
    m, v = [0.025, 0.021], [2.8975e-4, 9.999e-5]
    second = [first[i] * (1 - 0.1 * 0.01) - 0.1 * (m[i] / 0.19) / (math.sqrt(v[i] / 0.001999) + 1e-8)
              for i in range(2)]
    assert w.tolist() == pytest.approx(second, abs=1e-15)
    state_m, state_v, _ = opt.state["w"]
    assert state_m.tolist() == pytest.approx(m, abs=1e-17) and state_v.tolist() == pytest.approx(v, abs=1e-18)


def test_adamw_matches_torch_optim_adamw():
    """Five steps on two tensors, with weight decay, against torch.optim.AdamW (float64)."""
    g = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(3, 4, generator=g, dtype=D), "b": torch.randn(5, generator=g, dtype=D)}
    directions = [{n: torch.randn(t.shape, generator=g, dtype=D) for n, t in start.items()} for _ in range(5)]
    ours = {n: t.clone() for n, t in start.items()}
    opt = AdamW(0.8, 0.99, 1e-6, weight_decay=0.05)
    reference = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    torch_opt = torch.optim.AdamW(reference.values(), lr=0.03, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05,
                                  foreach=False)
    for d in directions:
        for n, w in ours.items():
            opt.descend(n, w, d[n], lr=0.03)
        for n, p in reference.items():
            p.grad = d[n].clone()
        torch_opt.step()
    for n in start:
        torch.testing.assert_close(ours[n], reference[n].detach(), rtol=1e-14, atol=1e-15)


def test_sgd_is_the_methods_former_step_bit_for_bit():
    w, d = torch.randn(7, generator=torch.Generator().manual_seed(1)), torch.randn(7)
    expected = w.clone().add_(d, alpha=-0.04)
    SGD().descend("w", w, d, 0.04)
    assert torch.equal(w, expected)


# ---- schedule ---------------------------------------------------------------------
def test_cosine_schedule_by_hand():
    """lr 0.1, min_lr 0.01, 4 rounds: 0.01 + 0.045 (1 + cos(π r/4)) at r = 0..3, the first round at lr,
    and torch's CosineAnnealingLR (T_max = rounds, stepped once a round) gives the same values."""
    got = [round_lr(0.1, "cosine", 0.01, 4, r) for r in range(4)]
    # cos(π r/4), r = 0..3: 1, √2/2, 0, −√2/2
    assert got == pytest.approx([0.1, 0.0868198051533946, 0.055, 0.02318019484660537], abs=1e-15)
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=0.01)
    by_torch = []
    for _ in range(4):
        by_torch.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert got == pytest.approx(by_torch, abs=1e-15)
    assert [round_lr(0.1, "constant", 0.01, 4, r) for r in range(4)] == [0.1] * 4
    cfg = build_config(None, {"lr": 0.1, "rounds": 4, "optimizer": {"schedule": "cosine", "min_lr": 0.01}})
    assert [client_lr(cfg, r) for r in range(4)] == got


@pytest.mark.parametrize("rounds", [1, 2, 3, 10])
def test_cosine_never_trains_a_round_at_lr_0(rounds):
    """The default min_lr = 0: every round trains (issue 56: a one-round smoke test under the 1-based
    count trained at lr 0 and left every client where it started); a one-round run trains at lr."""
    lrs = [round_lr(0.04, "cosine", 0.0, rounds, r) for r in range(rounds)]
    assert lrs[0] == 0.04 and min(lrs) > 0
    assert lrs == sorted(lrs, reverse=True)


def test_the_engine_trains_each_round_at_the_scheduled_lr(tmp_path, monkeypatch):
    import pflalign.run.jobs as jobs

    seen = []
    real = jobs.local_round

    def spy(lm, method, state, glob, received, batches, lr, round_index, *rest):
        seen.append((round_index, lr))
        return real(lm, method, state, glob, received, batches, lr, round_index, *rest)

    monkeypatch.setattr(jobs, "local_round", spy)
    over = {**json.loads(json.dumps(TINY)), "method": "fedavg", "rounds": 3, "lr": 0.2,
            "optimizer": {"schedule": "cosine", "min_lr": 0.02}, "eval": {**TINY["eval"], "base_model": False}}
    run_in_process(build_config(None, over), tmp_path / "run", progress=False)
    expected = [0.02 + 0.09 * (1 + math.cos(math.pi * r / 3)) for r in (0, 1, 2)]
    assert sorted(set(seen)) == [(r, pytest.approx(expected[r], abs=1e-15)) for r in range(3)]
    assert json.loads((tmp_path / "run" / ckpt.CONFIG).read_text())["optimizer"]["schedule"] == "cosine"


# ---- gradient accumulation --------------------------------------------------------
def test_batch_4_with_accumulation_2_is_batch_8(tiny_llama):
    """The same 8 examples (of different lengths): one batch of 8 against 2 microbatches of 4."""
    from pflalign.data import Example

    lm = tiny_llama
    lm.set_lora({n: p.detach().clone().normal_(0, 0.05) for n, p in lm.lora.items()})  # B ≠ 0: A's grads too
    examples = [Example(f"question {i}: " + "x" * (3 * i), "answer " + "y" * (i % 3 + 1)) for i in range(8)]
    encoded = [encode_train(lm.tokenizer, ex, 96) for ex in examples]
    pad = lm.tokenizer.pad_token_id
    big_loss, big = lm.loss_and_grads(collate_train(encoded, pad))
    big = {n: g.clone() for n, g in big.items()}
    buffer = {n: torch.zeros_like(g) for n, g in big.items()}
    micro_loss, micro = accumulated_loss_and_grads(lm, [collate_train(encoded[:4], pad),
                                                        collate_train(encoded[4:], pad)], buffer)
    assert micro_loss == pytest.approx(big_loss, rel=1e-6)
    assert any(g.abs().max() > 0 for g in big.values())
    for n in big:
        torch.testing.assert_close(micro[n], big[n], rtol=1e-5, atol=1e-7)
    # the two halves weigh by their tokens, not equally: their counts differ here
    halves = [int((collate_train(part, pad)["labels"][:, 1:] != -100).sum()) for part in (encoded[:4], encoded[4:])]
    assert halves[0] != halves[1]


def test_accumulation_draws_the_examples_of_the_big_batch(tiny_llama):
    from pflalign.data import Example

    examples = [Example(f"q{i}", f"a{i}") for i in range(10)]
    encoded = [encode_train(tiny_llama.tokenizer, ex, 32) for ex in examples]

    def client():
        return Client(3, ClientShare("c", examples, []), encoded, {})

    big = build_config(None, {"batch_size": 8, "local_steps": 3})
    small = build_config(None, {"batch_size": 4, "local_steps": 3, "optimizer": {"grad_accumulation": 2}})
    pad = tiny_llama.tokenizer.pad_token_id
    a, b = client(), client()
    for whole, parts in zip(draw_batches(a, big, pad), draw_batches(b, small, pad)):
        assert isinstance(whole, dict) and len(parts) == 2
        ids = [row for part in parts for row in part["input_ids"].tolist()]
        assert [[t for t in r if t != pad] for r in ids] == [[t for t in r if t != pad]
                                                           for r in whole["input_ids"].tolist()]
    assert a.steps_taken == b.steps_taken == 3


def test_a_run_with_accumulation_matches_the_big_batch_run(tmp_path):
    """Two rounds of FedAvg, batch 2 × accumulation 2 against batch 4: the same global adapter
    up to float error."""
    base = {**json.loads(json.dumps(TINY)), "method": "fedavg", "eval": {**TINY["eval"], "base_model": False}}
    run_in_process(build_config(None, {**base, "batch_size": 4}), tmp_path / "big", progress=False)
    run_in_process(build_config(None, {**base, "batch_size": 2, "optimizer": {"grad_accumulation": 2}}),
                   tmp_path / "acc", progress=False)
    big = ckpt.load_checkpoint(tmp_path / "big" / ckpt.CHECKPOINT)["global"]
    acc = ckpt.load_checkpoint(tmp_path / "acc" / ckpt.CHECKPOINT)["global"]
    for n in big:
        torch.testing.assert_close(acc[n], big[n], rtol=1e-4, atol=1e-6)
    assert any(big[n].abs().max() > 0 for n in big if "lora_B" in n)  # B left its zero start: it trained


def test_too_few_examples_for_the_accumulated_batch_is_one_line(tmp_path):
    over = {**json.loads(json.dumps(TINY)), "batch_size": 4, "optimizer": {"grad_accumulation": 4}}
    with pytest.raises(UserError, match=r"fewer than batch_size=4 x optimizer.grad_accumulation=4"):
        run_in_process(build_config(None, over), tmp_path / "run", progress=False)


# ---- which methods take AdamW -----------------------------------------------------
REFUSING = {"pflalign", "pflalign-no-precond", "pflalign-no-correction", "pflalign-const-gamma",
            "pflalign-hard-gamma", "pflalign-no-personal-init", "scaffold"}


def test_adamw_is_refused_with_one_line_where_it_is_not_defined():
    assert {name for name, cls in METHODS.items() if cls.refuses_adamw} == REFUSING
    for name in REFUSING:
        with pytest.raises(UserError, match=rf"optimizer.name=adamw is not defined for method {name}: .*"
                                            "use optimizer.name=sgd"):
            build_config(None, {"method": name, "optimizer": {"name": "adamw"}})
    for name in set(METHODS) - REFUSING:
        build_config(None, {"method": name, "optimizer": {"name": "adamw"}})


@pytest.mark.parametrize("key, value, message", [
    ("name", "adam", "optimizer.name must be one of sgd, adamw, got 'adam'"),
    ("schedule", "linear", "optimizer.schedule must be one of constant, cosine, got 'linear'"),
    ("beta2", 1.0, r"optimizer.beta2 must be in \[0, 1\), got 1.0"),
    ("eps", 0, "optimizer.eps must be > 0"),
    ("weight_decay", -1, "optimizer.weight_decay must be >= 0"),
    ("min_lr", 1.0, r"optimizer.min_lr must be in \[0, lr=0.04\], got 1.0"),
    ("grad_accumulation", 0, "optimizer.grad_accumulation must be > 0"),
])
def test_bad_optimizer_values_are_one_line(key, value, message):
    with pytest.raises(UserError, match=message):
        build_config(None, {"method": "fedavg", "optimizer": {key: value}})


def test_cli_refusal_exits_2(capsys, tmp_path):
    code = main(["run", "--out", str(tmp_path / "r"), "--set", "optimizer.name=adamw", "--set", "method=scaffold"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optimizer.name=adamw is not defined for method scaffold" in err[0]
    assert not (tmp_path / "r").exists()


class Spy(SGD):
    def __init__(self):
        self.names = []

    def descend(self, name, w, d, lr):
        self.names.append(name)
        super().descend(name, w, d, lr)


@pytest.mark.parametrize("name", sorted(set(METHODS) - REFUSING))
def test_every_method_that_takes_adamw_steps_through_the_optimizer(name):
    """A method that takes AdamW must move its trained tensors through `ctx.descend` only
    (else optimizer.name=adamw would silently run SGD): a spy optimizer sees each trained
    tensor once per step, and the step is the SGD step it always was."""
    method = METHODS[name]()
    init = {"w": torch.tensor([0.5, -1.0], dtype=D), "x.lora_A.weight": torch.tensor([0.3], dtype=D),
            "x.lora_B.weight": torch.tensor([0.2], dtype=D)}
    f = quadratic(torch.tensor([1.0, 2.0], dtype=D), torch.tensor([1.0, 1.0], dtype=D))

    def grad_fn():
        loss, grads = f({"w": params["w"]})
        return loss, {**grads, **{n: 0.5 * params[n] for n in init if n != "w"}}

    state = method.init_client_state(init)
    scratch = method.new_scratch()
    params = method.client_start(init, state, method.broadcast(init, method.init_server_state(init)), scratch)
    spy = Spy()
    ctx = StepContext(round=0, step=0, num_steps=2, lr=0.1, global_params=init, optimizer=spy, scratch=scratch)
    method.local_step(params, grad_fn, state, ctx)
    assert sorted(spy.names) == sorted(n for n in init if method.trains(n))


def test_an_adamw_run_differs_from_sgd_and_records_its_optimizer(tmp_path):
    base = {**json.loads(json.dumps(TINY)), "method": "fedprox", "rounds": 1,
            "eval": {**TINY["eval"], "base_model": False}}
    run_in_process(build_config(None, base), tmp_path / "sgd", progress=False)
    adamw = {**base, "lr": 1e-3, "optimizer": {"name": "adamw", "weight_decay": 0.01}}
    run_in_process(build_config(None, adamw), tmp_path / "adamw", progress=False)
    assert "optimizer" not in json.loads((tmp_path / "sgd" / ckpt.CONFIG).read_text())  # the config.json of before
    saved = json.loads((tmp_path / "adamw" / ckpt.CONFIG).read_text())
    assert saved["optimizer"]["name"] == "adamw" and build_config(None, saved).optimizer.weight_decay == 0.01
    sgd_w = ckpt.load_checkpoint(tmp_path / "sgd" / ckpt.CHECKPOINT)["global"]
    adamw_w = ckpt.load_checkpoint(tmp_path / "adamw" / ckpt.CHECKPOINT)["global"]
    assert any(not torch.equal(sgd_w[n], adamw_w[n]) for n in sgd_w)


def test_default_config_json_has_no_optimizer_section():
    cfg = build_config(None, {})
    assert "optimizer" not in to_dict(cfg)
    assert "optimizer" in to_dict(build_config(None, {"optimizer": {"schedule": "cosine"}}))
