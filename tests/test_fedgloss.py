"""FedGloSS against hand computations in plain Python floats, and its reductions."""

import io
import math

import pytest
import torch

from pflalign.methods import METHODS, FedAvg
from pflalign.methods.base import RoundContext, StepContext
from pflalign.methods.fedgloss import FedGloSS, FedGloSSArgs

from toy import quadratic, simulate

# Two participating clients out of N = 3, f_k(w) = ½ Σ a_k (w − c_k)².
CURV = [[1.0, 4.0], [2.0, 0.5]]
TARGET = [[1.0, -2.0], [-0.5, 3.0]]
WEIGHTS = [0.25, 0.75]
N_CLIENTS, LR, T = 3, 0.1, 2


def grad_fns():
    return [quadratic(torch.tensor(CURV[k], dtype=torch.float64), torch.tensor(TARGET[k], dtype=torch.float64))
            for k in range(2)]


def hand_rounds(rounds, rho_s, rho_l, beta, eta_s, w0):
    """The module docstring's equations, one scalar coordinate at a time."""
    w, sigma, pert = list(w0), [0.0, 0.0], [0.0, 0.0]
    sigma_k = [[0.0, 0.0], [0.0, 0.0]]
    for _ in range(rounds):
        start = [w[i] + pert[i] for i in range(2)]
        finals = []
        for k in range(2):
            x = list(start)
            for _ in range(T):
                g = [CURV[k][i] * (x[i] - TARGET[k][i]) for i in range(2)]
                norm = math.sqrt(sum(v * v for v in g))
                e = [rho_l * g[i] / norm for i in range(2)]
                g_e = [CURV[k][i] * (x[i] + e[i] - TARGET[k][i]) for i in range(2)]
                x = [x[i] - LR * (g_e[i] - sigma_k[k][i] + (x[i] - start[i]) / beta) for i in range(2)]
            sigma_k[k] = [sigma_k[k][i] - (x[i] - start[i]) / beta for i in range(2)]
            finals.append(x)
        deltas = [[finals[k][i] - start[i] for i in range(2)] for k in range(2)]
        sigma = [sigma[i] - (deltas[0][i] + deltas[1][i]) / (beta * N_CLIENTS * 2) for i in range(2)]
        d = [-(WEIGHTS[0] * deltas[0][i] + WEIGHTS[1] * deltas[1][i]) for i in range(2)]
        w = [w[i] - eta_s * d[i] - beta * sigma[i] for i in range(2)]
        norm_d = math.sqrt(sum(v * v for v in d))
        pert = [rho_s * d[i] / norm_d for i in range(2)]
    return w, sigma, sigma_k, pert


def run_rounds(method, rounds, w0):
    """The engine's call order with N = 3 clients of which 0 and 1 participate."""
    grads = grad_fns()
    glob = {"w": torch.tensor(w0, dtype=torch.float64)}
    server_state = method.init_server_state(glob)
    states = [method.init_client_state(glob) for _ in range(2)]
    for r in range(rounds):
        received = method.broadcast(glob, server_state)
        messages = []
        for k in range(2):
            scratch = method.new_scratch()
            params = method.client_start(glob, states[k], received, scratch)
            for t in range(T):
                method.local_step(params, lambda: grads[k](params), states[k], StepContext(r, t, T, LR, glob, scratch=scratch))
            messages.append(method.client_end(glob, params, states[k], scratch))
        glob = method.aggregate(glob, messages, WEIGHTS, server_state, RoundContext(r, N_CLIENTS, [0, 1]))
    return glob, server_state, states


def test_registered():
    assert METHODS["fedgloss"] is FedGloSS


def test_one_server_step_by_hand():
    method = FedGloSS(FedGloSSArgs(rho=0.5, beta=2.0, server_lr=0.5))
    glob = {"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    state = method.init_server_state(glob)
    state["perturbation"]["w"] = torch.tensor([0.25, 0.5], dtype=torch.float64)  # ε̃ of this round
    state["sigma"]["w"] = torch.tensor([0.1, -0.2], dtype=torch.float64)
    # w̃ = (1.25, −0.5); the clients' deltas are (1, 2) and (−3, 2)
    messages = [{"params": {"w": torch.tensor([2.25, 1.5], dtype=torch.float64)}},
                {"params": {"w": torch.tensor([-1.75, 1.5], dtype=torch.float64)}}]
    new = method.aggregate(glob, messages, [0.25, 0.75], state, RoundContext(0, 4, [0, 3]))
    sigma = [0.1 - (1 - 3) / (2.0 * 4 * 2), -0.2 - (2 + 2) / (2.0 * 4 * 2)]  # σ − Σ Δ_k / (β N |S|)
    d = [-(0.25 * 1 + 0.75 * -3), -(0.25 * 2 + 0.75 * 2)]  # −Σ p_k Δ_k = (2, −2)
    w = [1.0 - 0.5 * d[0] - 2.0 * sigma[0], -1.0 - 0.5 * d[1] - 2.0 * sigma[1]]
    assert state["sigma"]["w"].tolist() == pytest.approx(sigma, rel=1e-15)
    assert new["w"].tolist() == pytest.approx(w, rel=1e-15)
    # next round's ascent: ρ_s d / ‖d‖ = 0.5 (1, −1) / √2
    assert state["perturbation"]["w"].tolist() == pytest.approx([0.5 / math.sqrt(2), -0.5 / math.sqrt(2)], rel=1e-15)
    assert method.broadcast(new, state)["perturbation"]["w"] is state["perturbation"]["w"]


def test_two_rounds_match_hand_computation():
    args = dict(rho=0.3, rho_local=0.05, beta=2.0, server_lr=0.8)
    glob, server_state, states = run_rounds(FedGloSS(FedGloSSArgs(**args)), 2, [0.5, 0.5])
    w, sigma, sigma_k, pert = hand_rounds(2, rho_s=0.3, rho_l=0.05, beta=2.0, eta_s=0.8, w0=[0.5, 0.5])
    assert glob["w"].tolist() == pytest.approx(w, rel=1e-12)
    assert server_state["sigma"]["w"].tolist() == pytest.approx(sigma, rel=1e-12)
    assert server_state["perturbation"]["w"].tolist() == pytest.approx(pert, rel=1e-12)
    for k in range(2):
        assert states[k]["sigma"]["w"].tolist() == pytest.approx(sigma_k[k], rel=1e-12)
        assert set(states[k]) == {"sigma"}  # the round's scratch is gone
    # the state checkpoints with torch.save (tensors in nested dicts only)
    buffer = io.BytesIO()
    torch.save({"server": server_state, "clients": states}, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True)["server"]["sigma"]["w"], server_state["sigma"]["w"])


def test_no_sam_no_admm_unit_server_lr_is_exactly_fedavg():
    # dyadic numbers: every operation is exact in float64, so the equality is bit for bit
    init = {"w": torch.tensor([0.0, 1.0], dtype=torch.float64)}
    grads = [quadratic(torch.ones(2, dtype=torch.float64), torch.tensor(c, dtype=torch.float64))
             for c in ([1.0, -1.0], [0.5, 2.0])]
    reduced = FedGloSS(FedGloSSArgs(rho=0.0, rho_local=0.0, admm=False, server_lr=1.0))
    ours = simulate(reduced, init, grads, [0.5, 0.5], rounds=2, steps=2, lr=0.5)
    theirs = simulate(FedAvg(), init, grads, [0.5, 0.5], rounds=2, steps=2, lr=0.5)
    assert torch.equal(ours[0]["w"], theirs[0]["w"])
    assert all(torch.equal(a["w"], b["w"]) for a, b in zip(ours[1], theirs[1]))


def test_no_server_sam_no_admm_is_fedsam():
    # ρ_s = 0 and no ADMM: clients take SAM steps from w^r and the server averages (FedSAM).
    rho_l = 0.05
    glob, _, _ = run_rounds(FedGloSS(FedGloSSArgs(rho=0.0, rho_local=rho_l, admm=False)), 2, [0.5, 0.5])
    w = [0.5, 0.5]
    for _ in range(2):
        finals = []
        for k in range(2):
            x = list(w)
            for _ in range(T):
                g = [CURV[k][i] * (x[i] - TARGET[k][i]) for i in range(2)]
                norm = math.sqrt(sum(v * v for v in g))
                x = [x[i] - LR * CURV[k][i] * (x[i] + rho_l * g[i] / norm - TARGET[k][i]) for i in range(2)]
            finals.append(x)
        w = [WEIGHTS[0] * finals[0][i] + WEIGHTS[1] * finals[1][i] for i in range(2)]
    assert glob["w"].tolist() == pytest.approx(w, rel=1e-12)


def test_zero_server_radius_never_perturbs():
    method = FedGloSS(FedGloSSArgs(rho=0.0))
    glob, server_state, _ = run_rounds(method, 2, [0.5, 0.5])
    assert torch.equal(server_state["perturbation"]["w"], torch.zeros(2, dtype=torch.float64))
    _, sigma, _, _ = hand_rounds(2, rho_s=0.0, rho_l=0.15, beta=10.0, eta_s=1.0, w0=[0.5, 0.5])
    assert server_state["sigma"]["w"].tolist() == pytest.approx(sigma, rel=1e-12)


def test_radius_warmup_and_defaults():
    method = FedGloSS(FedGloSSArgs(warmup_rounds=4, rho0=0.01, rho=0.21))
    assert [method.radius(0.21, t) for t in (0, 2, 4, 9)] == pytest.approx([0.01, 0.11, 0.21, 0.21])
    defaults = FedGloSSArgs()
    assert (defaults.rho, defaults.rho_local, defaults.beta, defaults.server_lr) == (0.15, 0.15, 10.0, 1.0)
    assert FedGloSS().radius(0.15, 0) == 0.15
    # after round t the server prepares round t+1's ascent, with ρ_s(t+1)
    _, server_state, _ = run_rounds(method, 1, [0.5, 0.5])
    assert server_state["perturbation"]["w"].norm().item() == pytest.approx(0.06, rel=1e-12)


def test_invalid_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="beta"):
        FedGloSSArgs(beta=0.0)
    with pytest.raises(ValueError, match="rho_local"):
        FedGloSSArgs(rho_local=-0.1)
    with pytest.raises(ValueError, match="server_lr"):
        FedGloSSArgs(server_lr=0.0)
    with pytest.raises(ValueError, match="warmup_rounds"):
        FedGloSSArgs(warmup_rounds=-1)
