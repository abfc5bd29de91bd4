"""FedProx, FedSAM, SCAFFOLD, FedDyn, FedAdam/FedYogi/FedAdagrad and local training:
update rules against hand computations in plain floats, and behaviour on toy
quadratics (float64)."""

import math

import pytest
import torch

from pflalign.config import build_config
from pflalign.errors import UserError
from pflalign.methods import METHODS, FedAvg
from pflalign.methods.base import RoundContext, StepContext
from pflalign.methods.feddyn import FedDyn, FedDynArgs
from pflalign.methods.fedopt import FedAdagrad, FedAdam, FedAdamArgs, FedOptArgs, FedYogi
from pflalign.methods.fedprox import FedProx, FedProxArgs
from pflalign.methods.fedsam import FedSAM, FedSAMArgs
from pflalign.methods.local import Local
from pflalign.methods.scaffold import Scaffold

from toy import quadratic, simulate

D = torch.float64
NEW_METHODS = ["fedprox", "fedsam", "scaffold", "feddyn", "fedadam", "fedyogi", "fedadagrad", "local"]


def vec(*xs):
    return torch.tensor(xs, dtype=D)


def run_round(method, glob, states, server_state, participants, num_clients, grad_of, weights, steps, lr, r=0):
    """One round with only `participants` training (the engine's call order); returns w^{r+1}."""
    received = method.broadcast(glob, server_state)
    messages = []
    for k in participants:
        scratch = method.new_scratch()
        params = method.client_start(glob, states[k], received, scratch)
        for t in range(steps):
            ctx = StepContext(round=r, step=t, num_steps=steps, lr=lr, global_params=glob, scratch=scratch)
            method.local_step(params, lambda: grad_of[k](params), states[k], ctx)
        messages.append(method.client_end(glob, params, states[k], scratch))
    return method.aggregate(glob, messages, weights, server_state, RoundContext(r, num_clients, participants))


# ---- heterogeneous quadratics: client drift -----------------------------------
# Two clients with different curvatures and targets; with equal weights the global
# optimum argmin ½ Σ_k ½ a_k (w − c_k)² is the curvature-weighted mean of the targets.
A = [vec(1.0, 4.0), vec(10.0, 1.0)]
C = [vec(1.0, -2.0), vec(-1.0, 3.0)]
CLIENTS = [quadratic(A[k], C[k]) for k in range(2)]


def optimum(weights):
    return (weights[0] * A[0] * C[0] + weights[1] * A[1] * C[1]) / (weights[0] * A[0] + weights[1] * A[1])


def distance(params, target):
    return (params["w"] - target).abs().max().item()


def test_fedavg_drifts_while_scaffold_and_feddyn_reach_the_global_optimum():
    w0, best = {"w": torch.zeros(2, dtype=D)}, optimum([0.5, 0.5])
    run = dict(grad_of=CLIENTS, weights=[0.5, 0.5], rounds=60, steps=20, lr=0.05)
    fedavg, _, _ = simulate(FedAvg(), w0, **run)
    scaffold, _, _ = simulate(Scaffold(), w0, **run)
    feddyn, _, _ = simulate(FedDyn(FedDynArgs(alpha=1.0)), w0, **run)
    assert distance(fedavg, best) > 0.1
    assert distance(scaffold, best) < 1e-6
    assert distance(feddyn, best) < 1e-6


def test_feddyn_fixed_point_is_the_unweighted_optimum():
    # FedDyn averages unweighted (as the paper): data-size weights do not move its fixed point.
    w0 = {"w": torch.zeros(2, dtype=D)}
    glob, _, _ = simulate(FedDyn(FedDynArgs(alpha=1.0)), w0, CLIENTS, [0.9, 0.1], rounds=60, steps=20, lr=0.05)
    assert distance(glob, optimum([0.5, 0.5])) < 1e-6
    assert distance(glob, optimum([0.9, 0.1])) > 0.1


# ---- FedProx ---------------------------------------------------------------------
@pytest.mark.parametrize("method", [FedProx(FedProxArgs(mu=0.0)), FedSAM(FedSAMArgs(rho=0.0))], ids=["fedprox-mu0", "fedsam-rho0"])
def test_reduces_to_fedavg_exactly(method):
    w0 = {"w": vec(0.3, -0.2)}
    run = dict(grad_of=CLIENTS, weights=[0.3, 0.7], rounds=4, steps=5, lr=0.05)
    ref_glob, ref_personal, _ = simulate(FedAvg(), w0, **run)
    glob, personal, _ = simulate(method, w0, **run)
    assert torch.equal(glob["w"], ref_glob["w"])
    assert all(torch.equal(p["w"], q["w"]) for p, q in zip(personal, ref_personal))


def test_fedprox_step_by_hand():
    mu, lr, a, c = 0.5, 0.1, [1.0, 4.0], [1.0, -2.0]
    w, w_global = [0.5, -1.0], [0.0, 0.25]
    params = {"w": vec(*w)}
    grad = quadratic(vec(*a), vec(*c))
    ctx = StepContext(round=0, step=1, num_steps=2, lr=lr, global_params={"w": vec(*w_global)})
    loss = FedProx(FedProxArgs(mu=mu)).local_step(params, lambda: grad(params), {}, ctx)
    expected = [w[i] - lr * (a[i] * (w[i] - c[i]) + mu * (w[i] - w_global[i])) for i in range(2)]
    assert params["w"].tolist() == pytest.approx(expected, rel=1e-14)
    assert loss == pytest.approx(sum(0.5 * a[i] * (w[i] - c[i]) ** 2 for i in range(2)))


# ---- FedSAM ----------------------------------------------------------------------
def two_tensor_quadratic(ax, cx, ay, cy, calls=None):
    """f = ½ Σ ax (x − cx)² + ½ ay (y − cy)² over two tensors "x" and "y"."""
    def grad_of(params):
        if calls is not None:
            calls.append(1)
        x, y = params["x"], params["y"]
        loss = float((0.5 * ax * (x - cx) ** 2).sum() + (0.5 * ay * (y - cy) ** 2).sum())
        return loss, {"x": ax * (x - cx), "y": ay * (y - cy)}
    return grad_of


def test_fedsam_step_by_hand_with_the_joint_norm():
    rho, lr = 0.3, 0.1
    ax, cx, ay, cy = [1.0, 3.0], [1.0, -1.0], [2.0], [0.5]
    x, y = [0.0, 0.5], [-1.0]
    params = {"x": vec(*x), "y": vec(*y)}
    grad_of = two_tensor_quadratic(vec(*ax), vec(*cx), vec(*ay), vec(*cy))
    ctx = StepContext(round=0, step=0, num_steps=1, lr=lr, global_params={})
    loss = FedSAM(FedSAMArgs(rho=rho)).local_step(params, lambda: grad_of(params), {}, ctx)

    gx = [ax[i] * (x[i] - cx[i]) for i in range(2)]
    gy = [ay[0] * (y[0] - cy[0])]
    norm = math.sqrt(sum(g * g for g in gx + gy))  # one norm over both tensors
    ex, ey = [rho * g / norm for g in gx], [rho * g / norm for g in gy]
    gx_adv = [ax[i] * (x[i] + ex[i] - cx[i]) for i in range(2)]
    gy_adv = [ay[0] * (y[0] + ey[0] - cy[0])]
    assert params["x"].tolist() == pytest.approx([x[i] - lr * gx_adv[i] for i in range(2)], rel=1e-14)
    assert params["y"].tolist() == pytest.approx([y[0] - lr * gy_adv[0]], rel=1e-14)
    # the reported loss is the one at w, not at w + ε
    assert loss == pytest.approx(0.5 * sum(ax[i] * (x[i] - cx[i]) ** 2 for i in range(2)) + 0.5 * ay[0] * (y[0] - cy[0]) ** 2)
    # per-tensor norms would have moved y by a full ρ: the joint norm does not
    assert abs(ey[0]) < rho


def test_fedsam_zero_gradient_is_a_no_op_without_a_second_evaluation():
    calls = []
    params = {"x": vec(1.0, -1.0), "y": vec(0.5)}
    grad_of = two_tensor_quadratic(vec(1.0, 3.0), vec(1.0, -1.0), vec(2.0), vec(0.5), calls)
    ctx = StepContext(round=0, step=0, num_steps=1, lr=0.1, global_params={})
    FedSAM().local_step(params, lambda: grad_of(params), {}, ctx)
    assert params["x"].tolist() == [1.0, -1.0] and params["y"].tolist() == [0.5]
    assert len(calls) == 1


# ---- SCAFFOLD --------------------------------------------------------------------
def test_scaffold_controls_by_hand_with_partial_participation():
    # Three scalar clients, N = 3; round 0: clients 0 and 2 take part, round 1: 1 and 2.
    a, c = [1.0, 2.0, 5.0], [1.0, -1.0, 0.5]
    N, K, lr = 3, 3, 0.1
    grad_of = [quadratic(vec(a[k]), vec(c[k])) for k in range(N)]
    method = Scaffold()
    glob = {"w": vec(0.2)}
    server_state = method.init_server_state(glob)
    states = [method.init_client_state(glob) for _ in range(N)]

    hand_w, hand_c, hand_ck = 0.2, 0.0, [0.0] * N
    for r, (participants, weights) in enumerate((([0, 2], [0.25, 0.75]), ([1, 2], [0.5, 0.5]))):
        ends, delta_cs = [], []
        for k in participants:
            w = hand_w
            for _ in range(K):
                w -= lr * (a[k] * (w - c[k]) - hand_ck[k] + hand_c)
            c_plus = hand_ck[k] - hand_c + (hand_w - w) / (K * lr)
            delta_cs.append(c_plus - hand_ck[k])
            hand_ck[k] = c_plus
            ends.append(w)
        hand_w = sum(p * w for p, w in zip(weights, ends))
        mean_delta_c = sum(delta_cs) / len(delta_cs)
        hand_c += len(participants) / N * mean_delta_c

        glob = run_round(method, glob, states, server_state, participants, N, grad_of, weights, K, lr, r)
        assert glob["w"].item() == pytest.approx(hand_w, rel=1e-13)
        assert [s["c"]["w"].item() for s in states] == pytest.approx(hand_ck, rel=1e-13)
        assert server_state["c"]["w"].item() == pytest.approx(hand_c, rel=1e-13)
        assert all(s.keys() == {"c"} for s in states)  # the round's scratch is gone
        if r == 0:  # c started at 0: it is (|S|/N) · mean Δc_k = ⅔ of the plain mean
            assert server_state["c"]["w"].item() == pytest.approx(2 / 3 * mean_delta_c, rel=1e-13)
            assert abs(mean_delta_c) > 0.1


def test_scaffold_option_two_control_is_the_mean_local_gradient():
    # Option II's c_k⁺ = c_k − c + (w^r − w_K)/(Kη) equals the mean of the K gradients g_t
    # taken along the way, since w^r − w_K = η Σ_t (g_t − c_k + c).
    a, c, K, lr = 4.0, -1.0, 5, 0.05
    method = Scaffold()
    glob = {"w": vec(0.7)}
    server_state, state = method.init_server_state(glob), method.init_client_state(glob)
    grads = []

    def grad_of(params):
        loss, g = quadratic(vec(a), vec(c))(params)
        grads.append(g["w"].item())
        return loss, g

    run_round(method, glob, [state], server_state, [0], 1, [grad_of], [1.0], K, lr)
    assert state["c"]["w"].item() == pytest.approx(sum(grads) / K, rel=1e-12)


# ---- FedDyn ----------------------------------------------------------------------
def test_feddyn_two_rounds_by_hand():
    alpha, lr, K, N = 0.5, 0.1, 2, 3
    a, c = [1.0, 3.0, 2.0], [1.0, -1.0, 0.0]
    grad_of = [quadratic(vec(a[k]), vec(c[k])) for k in range(N)]
    method = FedDyn(FedDynArgs(alpha=alpha))
    glob = {"w": vec(0.4)}
    server_state = method.init_server_state(glob)
    states = [method.init_client_state(glob) for _ in range(N)]

    hand_w, hand_h, hand_lam = 0.4, 0.0, [0.0] * N
    for r, participants in enumerate(([0, 1], [1, 2])):
        ends = []
        for k in participants:
            w = hand_w
            for _ in range(K):
                w -= lr * (a[k] * (w - c[k]) - hand_lam[k] + alpha * (w - hand_w))
            hand_lam[k] -= alpha * (w - hand_w)
            ends.append(w)
        hand_h -= alpha / N * sum(w - hand_w for w in ends)
        hand_w = sum(ends) / len(ends) - hand_h / alpha

        # weights deliberately unequal: FedDyn's server ignores them
        glob = run_round(method, glob, states, server_state, participants, N, grad_of, [0.9, 0.1], K, lr, r)
        assert [s["lambda"]["w"].item() for s in states] == pytest.approx(hand_lam, rel=1e-13)
        assert server_state["h"]["w"].item() == pytest.approx(hand_h, rel=1e-13)
        assert glob["w"].item() == pytest.approx(hand_w, rel=1e-13)


def test_feddyn_at_small_alpha_is_fedavg_plus_undamped_server_momentum():
    """Why FedDyn's tuning scores were the same for α = 0.001 and 0.01 and 6.5 points above
    FedAvg (docs/results/tune-flan): as α → 0 its client terms vanish, but −h/α does not, since
    h is itself α × the participants' accumulated drift. With full participation the server
    step becomes w^{r+1} = w^r + d_r + Σ_{s≤r} d_s, d_r the clients' mean update: the paper's
    rule, acting as heavy-ball momentum of coefficient 1 at any small α."""
    lr, K, N = 0.1, 3, 2
    a, c = [1.0, 3.0], [1.0, -1.0]
    grad_of = [quadratic(vec(a[k]), vec(c[k])) for k in range(N)]
    for alpha in (1e-9, 1e-6):
        method = FedDyn(FedDynArgs(alpha=alpha))
        glob = {"w": vec(0.4)}
        server_state = method.init_server_state(glob)
        states = [method.init_client_state(glob) for _ in range(N)]
        hand_w, accumulated = 0.4, 0.0
        for r in range(3):
            ends = []
            for k in range(N):  # plain local SGD: the α terms are negligible
                w = hand_w
                for _ in range(K):
                    w -= lr * a[k] * (w - c[k])
                ends.append(w)
            d = sum(ends) / N - hand_w
            accumulated += d
            hand_w = hand_w + d + accumulated
            glob = run_round(method, glob, states, server_state, range(N), N, grad_of, [0.5, 0.5], K, lr, r)
            assert glob["w"].item() == pytest.approx(hand_w, abs=1e-4)
        # and it is not FedAvg: the momentum term moved the model by the accumulated drift
        assert abs(accumulated) > 0.1


# ---- FedAdam / FedYogi / FedAdagrad -------------------------------------------------
def hand_fedopt(kind, w, averages, lr, beta1, beta2, tau):
    """Algorithm 2 of Reddi et al. in floats; returns w after each server step."""
    m, v, out = [0.0] * len(w), [tau * tau] * len(w), []
    for avg in averages:
        for i in range(len(w)):
            delta = avg[i] - w[i]
            m[i] = beta1 * m[i] + (1 - beta1) * delta
            if kind == "adam":
                v[i] = beta2 * v[i] + (1 - beta2) * delta ** 2
            elif kind == "yogi":
                v[i] = v[i] - (1 - beta2) * delta ** 2 * math.copysign(1.0, v[i] - delta ** 2)
            else:
                v[i] = v[i] + delta ** 2
            w[i] = w[i] + lr * m[i] / (math.sqrt(v[i]) + tau)
        out.append(list(w))
    return out


@pytest.mark.parametrize("kind, cls, args", [
    ("adam", FedAdam, FedAdamArgs(server_lr=0.5, beta1=0.9, beta2=0.99, tau=0.1)),
    ("yogi", FedYogi, FedAdamArgs(server_lr=0.5, beta1=0.9, beta2=0.99, tau=0.1)),
    ("adagrad", FedAdagrad, FedOptArgs(server_lr=0.5, beta1=0.9, tau=0.1)),
])
def test_fedopt_two_server_steps_by_hand(kind, cls, args):
    # The two clients' models in each round, weights 0.25 / 0.75. Round 1's Δ = (0.4, 0.02, 0):
    # Δ² = 0.16 > v = τ² = 0.01 > 4e-4 > 0, so Yogi's sign takes both values.
    rounds = [([1.0, 0.0, 0.5], [0.2, 0.04, 0.5]), ([0.5, 0.1, -1.0], [0.3, 0.0, 0.9])]
    weights = [0.25, 0.75]
    w0 = [0.0, 0.01, 0.5]
    method = cls(args)
    glob = {"w": vec(*w0)}
    server_state = method.init_server_state(glob)
    averages = []
    for r, (first, second) in enumerate(rounds):
        messages = [{"params": {"w": vec(*first)}}, {"params": {"w": vec(*second)}}]
        averages.append([weights[0] * first[i] + weights[1] * second[i] for i in range(3)])
        glob = method.aggregate(glob, messages, weights, server_state, RoundContext(r, 2, [0, 1]))
        expected = hand_fedopt(kind, list(w0), averages, 0.5, 0.9, 0.99, 0.1)[-1]
        assert glob["w"].tolist() == pytest.approx(expected, rel=1e-13, abs=1e-15)


def test_fedyogi_v_moves_towards_delta_squared_additively():
    # Δ² > v: v grows by (1−β2)Δ²; Δ² < v: v shrinks by (1−β2)Δ²; Δ² = v: unchanged.
    args = FedAdamArgs(server_lr=0.5, beta1=0.9, beta2=0.9, tau=0.5)  # v starts at 0.25
    method = FedYogi(args)
    glob = {"w": vec(0.0, 0.0, 0.0)}
    server_state = method.init_server_state(glob)
    method.aggregate(glob, [{"params": {"w": vec(1.0, 0.1, 0.5)}}], [1.0], server_state, RoundContext(0, 1, [0]))
    assert server_state["v"]["w"].tolist() == pytest.approx([0.25 + 0.1 * 1.0, 0.25 - 0.1 * 0.01, 0.25], rel=1e-13)
    # Adam, by contrast, would decay v multiplicatively towards Δ²
    adam = FedAdam(args)
    adam_state = adam.init_server_state(glob)
    adam.aggregate(glob, [{"params": {"w": vec(1.0, 0.1, 0.5)}}], [1.0], adam_state, RoundContext(0, 1, [0]))
    assert adam_state["v"]["w"].tolist() == pytest.approx([0.9 * 0.25 + 0.1, 0.9 * 0.25 + 0.001, 0.25], rel=1e-13)


def test_fedopt_clients_are_fedavg_clients():
    w0 = {"w": vec(0.3, -0.2)}
    _, ref_personal, _ = simulate(FedAvg(), w0, CLIENTS, [0.5, 0.5], rounds=1, steps=4, lr=0.05)
    _, personal, _ = simulate(FedAdam(), w0, CLIENTS, [0.5, 0.5], rounds=1, steps=4, lr=0.05)
    assert all(torch.equal(p["w"], q["w"]) for p, q in zip(personal, ref_personal))


# ---- local -----------------------------------------------------------------------
def test_local_never_changes_the_global_and_clients_continue_their_own_model():
    w0, lr, T, R = {"w": vec(0.3, -0.2)}, 0.05, 4, 3
    glob, personal, states = simulate(Local(), w0, CLIENTS, [0.5, 0.5], rounds=R, steps=T, lr=lr)
    assert torch.equal(glob["w"], w0["w"])
    for k in range(2):
        # R rounds of T SGD steps on ½ a (w − c)² from w0, uninterrupted: c + (1 − η a)^{RT} (w0 − c)
        expected = C[k] + (1 - lr * A[k]) ** (R * T) * (w0["w"] - C[k])
        assert personal[k]["w"].tolist() == pytest.approx(expected.tolist(), rel=1e-12)
        assert torch.equal(states[k]["model"]["w"], personal[k]["w"])
        assert torch.equal(Local().client_start(glob, states[k], {}, {})["w"], personal[k]["w"])


# ---- all new methods: registry, state, arguments ---------------------------------
@pytest.mark.parametrize("name", NEW_METHODS)
def test_state_is_tensors_only_and_round_trips_through_torch_save(name, tmp_path):
    method = METHODS[name]()
    w0 = {"w": vec(0.3, -0.2)}
    server_state = method.init_server_state(w0)
    states = [method.init_client_state(w0) for _ in range(2)]
    run_round(method, w0, states, server_state, [0, 1], 2, CLIENTS, [0.5, 0.5], 2, 0.05)
    for state in states + [server_state]:
        assert all(isinstance(t, torch.Tensor) for group in state.values() for t in group.values())
    torch.save({"clients": states, "server": server_state}, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    assert loaded["clients"][0].keys() == states[0].keys()


@pytest.mark.parametrize("args_cls, bad", [
    (FedProxArgs, {"mu": -0.1}),
    (FedSAMArgs, {"rho": -0.01}),
    (FedDynArgs, {"alpha": 0.0}),
    (FedDynArgs, {"alpha": -1.0}),
    (FedOptArgs, {"server_lr": 0.0}),
    (FedOptArgs, {"beta1": 1.0}),
    (FedOptArgs, {"tau": 0.0}),
    (FedAdamArgs, {"beta2": 1.0}),
    (FedAdamArgs, {"beta2": -0.1}),
])
def test_invalid_arguments_are_refused(args_cls, bad):
    with pytest.raises(ValueError):
        args_cls(**bad)


def test_arguments_reach_the_methods_through_the_config():
    cfg = build_config(None, {"method": "fedprox", "method_args": {"mu": 0.1}})
    assert cfg.method_args == {"mu": 0.1}
    with pytest.raises(UserError, match="mu must be >= 0"):
        build_config(None, {"method": "fedprox", "method_args": {"mu": -1.0}})
    with pytest.raises(UserError, match="unknown argument 'beta2'"):
        build_config(None, {"method": "fedadagrad", "method_args": {"beta2": 0.9}})
    assert FedAdam.arg_names() == ["server_lr", "beta1", "tau", "beta2"]
    assert set(NEW_METHODS) <= set(METHODS)


# ---- the class hierarchy mirrors the math (issue 40) ------------------------------
@pytest.mark.parametrize("cls", [FedProx, FedSAM])
def test_fedavg_variants_change_only_the_client_step(cls):
    """FedProx and FedSAM are FedAvg with another local step (their papers' server rule is
    FedAvg's data-weighted mean): subclasses of FedAvg whose classes, up to FedAvg, define no
    rule but `local_step`."""
    assert issubclass(cls, FedAvg)
    mro = cls.__mro__[:cls.__mro__.index(FedAvg)]
    rules = {n for klass in mro for n, v in vars(klass).items()
             if n != "Args" and not n.startswith("__") and (callable(v) or isinstance(v, (classmethod, staticmethod)))}
    assert rules == {"local_step"}
