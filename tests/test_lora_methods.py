"""FFA-LoRA, FedSA-LoRA and FedSVD: which LoRA factor is trained, shared and kept,
by hand on a toy LoRA pair whose loss is ½‖B A − M_k‖² (M_k: client k's target)."""

import pytest
import torch

from pflalign.methods import METHODS
from pflalign.methods.base import RoundContext, StepContext
from pflalign.methods.fedsa_lora import FedSALoRA, FedSALoRAArgs
from pflalign.methods.fedsvd import FedSVD, FedSVDArgs, svd_refactor
from pflalign.methods.ffa_lora import FFALoRA

from toy import simulate

A, B = "layer.lora_A.default.weight", "layer.lora_B.default.weight"
OUT, IN, R = 5, 4, 2


def lora_init(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {A: torch.randn(R, IN, generator=g, dtype=torch.float64), B: torch.zeros(OUT, R, dtype=torch.float64)}


def lora_target_loss(target: torch.Tensor):
    """f(A, B) = ½‖B A − M‖²: ∇_B = (B A − M) Aᵀ, ∇_A = Bᵀ (B A − M)."""
    def grad_of(params):
        residual = params[B] @ params[A] - target
        return float(0.5 * (residual**2).sum()), {A: params[B].T @ residual, B: residual @ params[A].T}
    return grad_of


def targets(n=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(OUT, IN, generator=g, dtype=torch.float64) for _ in range(n)]


def test_lora_methods_are_registered():
    for name, cls in (("ffa-lora", FFALoRA), ("fedsa-lora", FedSALoRA), ("fedsvd", FedSVD)):
        assert METHODS[name] is cls


# ---- FFA-LoRA ---------------------------------------------------------------
def test_ffa_lora_never_changes_a_and_trains_b():
    init = lora_init()
    glob, personal, _ = simulate(FFALoRA(), init, [lora_target_loss(m) for m in targets()], [0.5, 0.5],
                                 rounds=3, steps=4, lr=0.1)
    assert torch.equal(glob[A], init[A])  # bit for bit, after averaging too
    assert all(torch.equal(p[A], init[A]) for p in personal)
    assert glob[B].abs().sum() > 0 and not torch.equal(personal[0][B], personal[1][B])


def test_ffa_lora_sends_b_only_and_averages_it_by_weight():
    method, init = FFALoRA(), lora_init()
    b0, b1 = torch.full((OUT, R), 1.0, dtype=torch.float64), torch.full((OUT, R), 5.0, dtype=torch.float64)
    params = {A: init[A].clone(), B: b0}
    assert set(method.client_end(init, params, {}, {})["params"]) == {B}
    new = method.aggregate(init, [{"params": {B: b0}}, {"params": {B: b1}}], [0.25, 0.75], {}, RoundContext(0, 2, [0, 1]))
    assert torch.equal(new[B], torch.full((OUT, R), 4.0, dtype=torch.float64))
    assert torch.equal(new[A], init[A]) and new[A] is not init[A]


def test_ffa_lora_step_is_sgd_on_b_only():
    method, init = FFALoRA(), lora_init()
    params = {A: init[A].clone(), B: torch.ones(OUT, R, dtype=torch.float64)}
    grads = {A: torch.ones(R, IN, dtype=torch.float64), B: torch.full((OUT, R), 2.0, dtype=torch.float64)}
    method.local_step(params, lambda: (0.0, grads), {}, StepContext(0, 0, 1, 0.25, init))
    assert torch.equal(params[A], init[A])
    assert torch.equal(params[B], torch.full((OUT, R), 0.5, dtype=torch.float64))


# ---- FedSA-LoRA -------------------------------------------------------------
def test_fedsa_lora_averages_a_by_weight_and_keeps_b_per_client():
    init, weights = lora_init(), [0.25, 0.75]
    glob, personal, states = simulate(FedSALoRA(), init, [lora_target_loss(m) for m in targets()], weights,
                                      rounds=1, steps=3, lr=0.1)
    # A: the weighted average of the clients' trained A's (their local models).
    assert torch.allclose(glob[A], 0.25 * personal[0][A] + 0.75 * personal[1][A], rtol=0, atol=1e-15)
    # B: each client keeps its own, and they differ.
    for k in range(2):
        assert torch.equal(states[k]["B"][B], personal[k][B])
    assert not torch.allclose(states[0]["B"][B], states[1]["B"][B])
    # The global (evaluation) B is the weighted mean of the clients' B's, as documented.
    assert torch.allclose(glob[B], 0.25 * personal[0][B] + 0.75 * personal[1][B], rtol=0, atol=1e-15)


def test_fedsa_lora_never_starts_from_an_averaged_b():
    method, init = FedSALoRA(), lora_init()
    grads = [lora_target_loss(m) for m in targets()]
    states = [method.init_client_state(init) for _ in range(2)]
    glob = init
    for r in range(2):
        messages = []
        for k in range(2):
            own_b = states[k]["B"][B].clone()
            scratch = method.new_scratch()
            params = method.client_start(glob, states[k], {}, scratch)
            assert torch.equal(params[B], own_b)  # its own B, whatever the global B is
            assert torch.equal(params[A], glob[A])  # the shared A
            for t in range(3):
                method.local_step(params, lambda: grads[k](params), states[k], StepContext(r, t, 3, 0.1, glob, scratch=scratch))
            messages.append(method.client_end(glob, params, states[k], scratch))
            assert B not in messages[-1]["shared"]  # B is not part of what is aggregated
        glob = method.aggregate(glob, messages, [0.5, 0.5], {}, RoundContext(r, 2, [0, 1]))
        assert not torch.equal(glob[B], states[0]["B"][B]) and not torch.equal(glob[B], states[1]["B"][B])


def test_fedsa_lora_personalized_model_is_aggregated_a_with_own_b():
    init, weights = lora_init(), [0.25, 0.75]
    method = FedSALoRA()
    glob, personal, states = simulate(method, init, [lora_target_loss(m) for m in targets()], weights,
                                      rounds=1, steps=3, lr=0.1)
    for k in range(2):
        evaluated = method.personalized_after_aggregation(glob, personal[k], states[k])
        # A^{r+1} = 0.25 A_0 + 0.75 A_1, the server's; B_k, the client's own
        assert torch.allclose(evaluated[A], 0.25 * personal[0][A] + 0.75 * personal[1][A], rtol=0, atol=1e-15)
        assert torch.equal(evaluated[A], glob[A]) and not torch.equal(evaluated[A], personal[k][A])
        assert torch.equal(evaluated[B], personal[k][B]) and not torch.equal(evaluated[B], glob[B])
    before = FedSALoRA(FedSALoRAArgs(personalized="before_aggregation"))
    assert before.personalized_after_aggregation(glob, personal[0], states[0]) is personal[0]  # own A_0, B_0
    with pytest.raises(ValueError, match="personalized"):
        FedSALoRAArgs(personalized="both")


def test_other_methods_evaluate_the_model_their_last_round_left():
    init = lora_init()
    for name in ("fedavg", "ffa-lora", "fedsvd", "pflalign"):
        from pflalign.methods import METHODS

        method = METHODS[name]()
        glob, personal, states = simulate(method, init, [lora_target_loss(m) for m in targets()], [0.5, 0.5],
                                          rounds=1, steps=2, lr=0.1)
        assert method.personalized_after_aggregation(glob, personal[0], states[0]) is personal[0], name


def test_fedsa_lora_global_b_init_keeps_the_initial_b():
    init = lora_init()
    glob, _, states = simulate(FedSALoRA(FedSALoRAArgs(global_b="init")), init,
                               [lora_target_loss(m) for m in targets()], [0.5, 0.5], rounds=2, steps=2, lr=0.1)
    assert torch.equal(glob[B], init[B]) and not torch.equal(glob[A], init[A])
    assert states[0]["B"][B].abs().sum() > 0
    with pytest.raises(ValueError, match="global_b"):
        FedSALoRAArgs(global_b="median")


# ---- FedSVD -----------------------------------------------------------------
def random_pair(out=64, inp=48, r=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, r, generator=g).to(dtype), torch.randn(r, inp, generator=g).to(dtype)


def test_fedsvd_refactorization_preserves_the_product_and_orthonormalizes_a():
    b0, a = random_pair(seed=0)
    b1, _ = random_pair(seed=1)
    glob = {A: a, B: torch.zeros_like(b0)}
    new = FedSVD().aggregate(glob, [{"params": {B: b0}}, {"params": {B: b1}}], [0.25, 0.75], {},
                             RoundContext(0, 2, [0, 1]))
    mean_b = 0.25 * b0 + 0.75 * b1
    assert new[A].dtype == a.dtype and new[B].dtype == b0.dtype
    assert torch.allclose(new[B] @ new[A], mean_b @ a, rtol=0, atol=1e-5)
    assert torch.allclose(new[A] @ new[A].T, torch.eye(4), rtol=0, atol=1e-5)
    # new B = U S: its columns are orthogonal with norms the singular values of B̄ A
    s = torch.linalg.svdvals((mean_b @ a).double())[:4].float()
    assert torch.allclose(new[B].norm(dim=0), s, rtol=1e-5)


def test_fedsvd_refactor_every_two_keeps_a_on_the_other_rounds():
    b0, a = random_pair(seed=2)
    method = FedSVD(FedSVDArgs(refactor_every=2))
    glob = {A: a, B: torch.zeros_like(b0)}
    after_first = method.aggregate(glob, [{"params": {B: b0}}], [1.0], {}, RoundContext(0, 1, [0]))
    assert torch.equal(after_first[A], a) and torch.equal(after_first[B], b0)  # round 1: B averaged, A kept
    after_second = method.aggregate(after_first, [{"params": {B: b0}}], [1.0], {}, RoundContext(1, 1, [0]))
    assert not torch.allclose(after_second[A], a)  # round 2: re-factorised
    assert torch.allclose(after_second[A] @ after_second[A].T, torch.eye(4), rtol=0, atol=1e-5)
    assert torch.allclose(after_second[B] @ after_second[A], b0 @ a, rtol=0, atol=1e-5)


def test_fedsvd_trains_b_only_within_a_round_and_a_adapts_across_rounds():
    init = lora_init()
    glob, personal, _ = simulate(FedSVD(), init, [lora_target_loss(m) for m in targets()], [0.5, 0.5],
                                 rounds=1, steps=3, lr=0.1)
    assert all(torch.equal(p[A], init[A]) for p in personal)  # A fixed within the round
    mean_b = 0.5 * personal[0][B] + 0.5 * personal[1][B]
    assert torch.allclose(glob[B] @ glob[A], mean_b @ init[A], rtol=0, atol=1e-12)
    assert torch.allclose(glob[A] @ glob[A].T, torch.eye(R, dtype=torch.float64), rtol=0, atol=1e-12)


def test_svd_refactor_when_rank_exceeds_a_dimension():
    b, a = random_pair(out=3, inp=6, r=4, seed=3, dtype=torch.float64)  # B A has rank ≤ 3 < r
    new_b, new_a = svd_refactor(b, a)
    assert new_b.shape == b.shape and new_a.shape == a.shape
    assert torch.allclose(new_b @ new_a, b @ a, rtol=0, atol=1e-12)
    assert torch.allclose(new_a[:3] @ new_a[:3].T, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-12)


def test_fedsvd_refuses_refactor_every_below_one():
    with pytest.raises(ValueError, match="refactor_every"):
        FedSVDArgs(refactor_every=0)
