"""The methods' update rules as plain functions over tensors (issue 40: torch.optim's shape,
`_single_tensor_adam` beside `Adam.step`), each checked against numbers worked out by hand from
its paper's equation on two-element tensors; and the structure around them: per-round scratch
kept out of the persistent client state, and a class tree that mirrors the math."""

from __future__ import annotations

import math

import pytest
import torch

from pflalign.methods import METHODS, REGISTRY, FedAvg
from pflalign.methods.base import Method, RoundContext, StepContext
from pflalign.methods.feddyn import feddyn_direction, feddyn_dual_update_, feddyn_server_step_
from pflalign.methods.fedgloss import fedgloss_direction, fedgloss_dual_update_
from pflalign.methods.fedopt import (adagrad_second_moment_, adam_second_moment_, fedopt_step_,
                                     yogi_second_moment_)
from pflalign.methods.fedprox import proximal_direction
from pflalign.methods.fedsam import sam_gradient
from pflalign.methods.pflalign import pflalign_step_
from pflalign.methods.scaffold import scaffold_control, scaffold_direction

D = torch.float64


def vec(*xs):
    return torch.tensor(xs, dtype=D)


def close(t: torch.Tensor, expected, rel=1e-12):
    return t.tolist() == pytest.approx(list(expected), rel=rel, abs=1e-15)


G, W, W_GLOBAL = vec(1.0, -2.0), vec(3.0, 0.5), vec(1.0, 1.0)  # a gradient, a client's w, w^r


# ---- local steps: the descent direction each method hands the optimizer ------------------
def test_fedprox_direction_is_the_gradient_of_the_proximal_objective():
    # g + μ (w − w^r), μ = 0.5: [1 + 0.5·2, −2 + 0.5·(−0.5)]
    assert close(proximal_direction(G, W, W_GLOBAL, 0.5), [2.0, -2.25])
    assert torch.equal(proximal_direction(G, W, W_GLOBAL, 0.0), G)  # μ = 0: FedAvg's direction, bit for bit


def test_feddyn_direction_and_dual_update():
    lam = vec(0.5, -1.0)
    # g − λ_k + α (w − w^r), α = 0.1: [1 − 0.5 + 0.2, −2 + 1 − 0.05]
    assert close(feddyn_direction(G, W, W_GLOBAL, lam, 0.1), [0.7, -1.05])
    # λ_k ← λ_k − α (w − w^r): [0.5 − 0.2, −1 + 0.05]
    feddyn_dual_update_(lam, W, W_GLOBAL, 0.1)
    assert close(lam, [0.3, -0.95])


def test_feddyn_server_step():
    # 2 of N = 4 clients, their mean [2, 0], w^r = [1, 1], α = 0.5:
    # h ← h − α (|S|/N) (mean − w^r) = [0.1 − 0.25, 0 + 0.25];  w^{r+1} = mean − h/α = [2 + 0.3, 0 − 0.5]
    h = vec(0.1, 0.0)
    new = feddyn_server_step_(h, vec(2.0, 0.0), W_GLOBAL, 0.5, participants=2, num_clients=4)
    assert close(h, [-0.15, 0.25]) and close(new, [2.3, -0.5])


def test_scaffold_direction_and_option_two_control():
    c_k, c = vec(0.5, 0.5), vec(0.25, -1.0)
    # g − c_k + c: [1 − 0.5 + 0.25, −2 − 0.5 − 1]
    assert close(scaffold_direction(G, c_k, c), [0.75, -3.5])
    # c_k − c + (w^r − w)/(Kη), w = [0.5, 2], Kη = 0.25: [0.5 − 0.25 + 2, 0.5 + 1 − 4]
    assert close(scaffold_control(c_k, c, W_GLOBAL, vec(0.5, 2.0), 0.25), [2.25, -2.5])
    # what option II estimates: K = 4 SGD steps of η = 0.1 along a constant g, from c_k = c = 0,
    # move w by K η g, so c_k⁺ = g
    zero = vec(0.0, 0.0)
    assert close(scaffold_control(zero, zero, W_GLOBAL, W_GLOBAL - 4 * 0.1 * G, 4 * 0.1), G.tolist())


def test_fedgloss_direction_and_dual_update():
    sigma, start = vec(0.5, -0.5), vec(1.0, 1.0)
    # g_e − σ_k + (w − w̃)/β, β = 10: [1 − 0.5 + 0.2, −2 + 0.5 − 0.05]
    assert close(fedgloss_direction(G, W, sigma, start, 10.0), [0.7, -1.55])
    # σ_k ← σ_k − (w − w̃)/β: [0.5 − 0.2, −0.5 + 0.05]
    fedgloss_dual_update_(sigma, W, start, 10.0)
    assert close(sigma, [0.3, -0.45])


def test_sam_gradient_is_taken_at_w_plus_rho_g_over_the_joint_norm():
    # f = ½ (3 a² + 2 b²) at a = 1, b = 2: g = (3, 4), joint ‖g‖ = 5, ρ = 0.5 → ε = 0.1 g = (0.3, 0.4),
    # g_ε = (3 · 1.3, 2 · 2.4) = (3.9, 4.8); per-tensor norms would give ε = (0.5, 0.5) instead
    params = {"a": vec(1.0), "b": vec(2.0)}
    calls = []

    def grad_fn():
        calls.append({n: float(w) for n, w in params.items()})
        return 0.0, {"a": 3 * params["a"], "b": 2 * params["b"]}

    _, grads = grad_fn()
    got = sam_gradient(params, grads, grad_fn, 0.5)
    assert close(got["a"], [3.9]) and close(got["b"], [4.8])
    assert calls[1] == pytest.approx({"a": 1.3, "b": 2.4}, rel=1e-12)
    assert params["a"].item() == 1.0 and params["b"].item() == 2.0  # w put back exactly
    # ρ = 0 or g = 0: ε = 0, the gradient as it was and no second evaluation
    assert sam_gradient(params, grads, grad_fn, 0.0) is grads and len(calls) == 2
    zero = {"a": vec(0.0), "b": vec(0.0)}
    assert sam_gradient(params, zero, grad_fn, 0.5) is zero and len(calls) == 2


# ---- pFLAlign's step, term by term -------------------------------------------------------
# One step with β = 0.75, ε = 0 (so the hand numbers are exact), η = 0.1, T = 4, from
# m = (1, 1), v = (2, 1), P = (0.5, 0.5), Δ = (0.4, −0.4), w = (1, 1), g = (2, −1):
#   m = 0.75 m + 0.25 g        = (1.25, 0.5)
#   v = 0.75 v + 0.25 g²       = (2.5, 1)
#   α = 1 − 0.25 g²/v          = (0.6, 0.75)
#   P = α P + 0.25 m²/v        = (0.3 + 0.15625, 0.375 + 0.0625) = (0.45625, 0.4375)
#   γ (erf) = 0.5 + 0.5 erf(|m| / √(2 (v − m²))) sign(m Δ)
#           = (0.5 + 0.5 erf(1.25 / √1.875), 0.5 − 0.5 erf(0.5 / √1.5))
#   w = w − η P g − γ Δ / T    = (1 − 0.09125 − 0.1 γ_1, 1 + 0.04375 + 0.1 γ_2)
M0, V0, P0, DELTA, W0, G0 = (1.0, 1.0), (2.0, 1.0), (0.5, 0.5), (0.4, -0.4), (1.0, 1.0), (2.0, -1.0)
P1 = (0.45625, 0.4375)
GAMMA_ERF = (0.5 + 0.5 * math.erf(1.25 / math.sqrt(1.875)), 0.5 - 0.5 * math.erf(0.5 / math.sqrt(1.5)))


def _pflalign_step(**options):
    w, m, v, P = vec(*W0), vec(*M0), vec(*V0), vec(*P0)
    gamma = pflalign_step_(w, vec(*G0), m, v, P, vec(*DELTA), lr=0.1, beta=0.75, eps=0.0, num_steps=4, **options)
    return w, m, v, P, gamma


def test_pflalign_step_by_hand():
    w, m, v, P, gamma = _pflalign_step()
    assert close(m, [1.25, 0.5]) and close(v, [2.5, 1.0]) and close(P, P1) and close(gamma, GAMMA_ERF)
    assert close(w, [1 - 0.09125 - 0.1 * GAMMA_ERF[0], 1 + 0.04375 + 0.1 * GAMMA_ERF[1]])


@pytest.mark.parametrize("rule, gamma", [("hard", (1.0, 0.0)), ("const", (0.5, 0.5)), ("zero", (0.0, 0.0))])
def test_pflalign_step_gate_variants(rule, gamma):
    # hard: 0.5 + 0.5 sign(m Δ), sign(m Δ) = (+1, −1)
    w, _, _, P, got = _pflalign_step(gamma=rule)
    assert close(got, gamma) and close(P, P1)
    assert close(w, [W0[i] - 0.1 * P1[i] * G0[i] - gamma[i] * DELTA[i] / 4 for i in range(2)])


def test_pflalign_step_without_preconditioner_or_correction():
    # P ≡ 1: w − η g − γ Δ / T, P left as it was
    w, m, v, P, gamma = _pflalign_step(precondition=False)
    assert close(P, P0) and close(gamma, GAMMA_ERF) and close(m, [1.25, 0.5]) and close(v, [2.5, 1.0])
    assert close(w, [W0[i] - 0.1 * G0[i] - GAMMA_ERF[i] * DELTA[i] / 4 for i in range(2)])
    # no personal start: no correction term, no γ
    w, _, _, P, gamma = _pflalign_step(personal_init=False)
    assert gamma is None and close(w, [1 - 0.09125, 1 + 0.04375])


# ---- the adaptive server steps (FedAdam, FedYogi, FedAdagrad) ----------------------------
# w^r = (1, −1), Δ = (0.5, −0.2), m = (0.1, 0), v = (0.04, 0.09), η = 0.1, β1 = 0.9, τ = 0.01:
#   m = 0.9 m + 0.1 Δ = (0.14, −0.02),  Δ² = (0.25, 0.04)
#   Adam (β2 0.99):  v = 0.99 v + 0.01 Δ²              = (0.0421, 0.0895)
#   Yogi (β2 0.99):  v = v − 0.01 Δ² sign(v − Δ²)      = (0.04 + 0.0025, 0.09 − 0.0004)
#   Adagrad:         v = v + Δ²                        = (0.29, 0.13)
#   w^{r+1} = w^r + η m / (√v + τ)
@pytest.mark.parametrize("update_v, v_new", [
    (lambda v, d2: adam_second_moment_(v, d2, 0.99), (0.0421, 0.0895)),
    (lambda v, d2: yogi_second_moment_(v, d2, 0.99), (0.0425, 0.0896)),
    (adagrad_second_moment_, (0.29, 0.13)),
], ids=["adam", "yogi", "adagrad"])
def test_fedopt_server_step_by_hand(update_v, v_new):
    w, m, v = vec(1.0, -1.0), vec(0.1, 0.0), vec(0.04, 0.09)
    new = fedopt_step_(w, vec(0.5, -0.2), m, v, lr=0.1, beta1=0.9, tau=0.01, update_v=update_v)
    assert close(m, [0.14, -0.02]) and close(v, v_new)
    assert close(new, [1.0 + 0.1 * 0.14 / (math.sqrt(v_new[0]) + 0.01),
                       -1.0 + 0.1 * -0.02 / (math.sqrt(v_new[1]) + 0.01)])


def test_the_fedopt_methods_use_their_second_moment():
    """FedAdam, FedYogi and FedAdagrad's server rule is `fedopt_step_` with their own v update:
    one round of each from the same start gives the hand numbers above (m = 0, v = τ² = 1e-6 at first)."""
    glob = {"w": vec(1.0, -1.0)}
    average = {"w": vec(1.5, -1.2)}  # Δ = (0.5, −0.2)
    for name, expected_v in [("fedadam", lambda d2: 0.99 * 1e-6 + 0.01 * d2),
                             ("fedyogi", lambda d2: 1e-6 + 0.01 * d2),  # τ² < Δ²: v grows
                             ("fedadagrad", lambda d2: 1e-6 + d2)]:
        method = METHODS[name]()
        state = method.init_server_state(glob)
        new = method.aggregate(glob, [{"params": average}], [1.0], state, RoundContext(0, 1, [0]))
        v = [expected_v(d * d) for d in (0.5, -0.2)]
        m = [0.1 * d for d in (0.5, -0.2)]
        assert close(state["v"]["w"], v) and close(state["m"]["w"], m), name
        assert close(new["w"], [w + 0.01 * m[i] / (math.sqrt(v[i]) + 1e-3) for i, w in enumerate((1.0, -1.0))]), name


# ---- per-round scratch is not client state -----------------------------------------------
A, B = "l0.lora_A.default.weight", "l0.lora_B.default.weight"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_rounds_scratch_never_enters_the_client_state(name):
    """What a round needs from its start to its end (pFLAlign's m, SCAFFOLD's c and Σ η, FedGloSS's
    w̃) lives in the round's scratch: at no point of a round, nor after it, does the persistent state
    (what checkpoints hold) have a group beyond those `init_client_state` made."""
    method = METHODS[name]()
    torch.manual_seed(0)
    glob = {A: torch.randn(2, 3, dtype=D), B: torch.randn(4, 2, dtype=D)}
    state = method.init_client_state(glob)
    groups = set(state)
    server_state = method.init_server_state(glob)
    for r in range(2):
        scratch = method.new_scratch()
        params = method.client_start(glob, state, method.broadcast(glob, server_state), scratch)
        assert set(state) == groups
        for t in range(2):
            ctx = StepContext(round=r, step=t, num_steps=2, lr=0.1, global_params=glob, scratch=scratch)
            method.local_step(params, lambda: (0.0, {n: 0.5 * w for n, w in params.items()}), state, ctx)
            assert set(state) == groups
        method.round_metrics(glob, params, state, scratch)
        message = method.client_end(glob, params, state, scratch)
        assert set(state) == groups
        glob = method.aggregate(glob, [message], [1.0], server_state, RoundContext(r, 1, [0]))
    if name in ("pflalign", "scaffold", "fedgloss"):
        assert scratch  # these do keep something for the round, just not in `state`


# ---- the class tree mirrors the math -----------------------------------------------------
def test_method_is_abstract_and_fedavg_is_the_base_of_its_variants():
    with pytest.raises(TypeError, match="abstract"):
        Method()
    for cls in REGISTRY:
        cls()  # every registered method is complete
    fedavg_family = {"fedavg", "fedprox", "fedsam", "fedadam", "fedyogi", "fedadagrad", "local", "ffa-lora",
                     "fedsvd", "fedsa-lora"} | {n for n in METHODS if n.startswith("pflalign")}
    assert {n for n, cls in METHODS.items() if issubclass(cls, FedAvg)} == fedavg_family
    # the rest have a server rule of their own (two sums, or a server dual)
    assert set(METHODS) - fedavg_family == {"scaffold", "feddyn", "fedgloss"}
    # a method that keeps FedAvg's server rule does not restate it
    for name in ("fedprox", "fedsam", "pflalign"):
        cls = METHODS[name]
        assert cls.aggregation_sums is FedAvg.aggregation_sums and cls.finish_aggregation is FedAvg.finish_aggregation
    # one that keeps FedAvg's local step does not restate it (FFA-LoRA's frozen A is `trains`)
    for name in ("fedadam", "fedyogi", "fedadagrad", "local", "ffa-lora", "fedsvd", "fedsa-lora"):
        assert METHODS[name].local_step is FedAvg.local_step, name
