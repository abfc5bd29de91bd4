"""FedAvg: weighted averaging (and its properties), and the drift on heterogeneous quadratics that motivates the other methods."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pflalign.methods import METHODS, FedAvg
from pflalign.methods.base import RoundContext, clone, data_weights, weighted_average, zeros_like

from toy import quadratic, simulate


def test_weighted_average_by_hand():
    a = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([[4.0]])}
    b = {"x": torch.tensor([3.0, -2.0]), "y": torch.tensor([[0.0]])}
    out = FedAvg().aggregate({}, [{"params": a}, {"params": b}], [0.25, 0.75], {}, RoundContext(0, 2, [0, 1]))
    assert out["x"].tolist() == [2.5, -1.0]
    assert out["y"].tolist() == [[1.0]]
    assert weighted_average([a], [1.0])["x"].tolist() == [1.0, 2.0]


def test_local_sgd_step_and_personalized_is_local_model():
    w0 = {"w": torch.tensor([0.0, 0.0], dtype=torch.float64)}
    grad = quadratic(torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64))
    glob, personal, _ = simulate(FedAvg(), w0, [grad], [1.0], rounds=1, steps=2, lr=0.5)
    # two SGD steps on ½(w−c)²: w ← w − ½(w − c) → c/2 → 3c/4
    assert personal[0]["w"].tolist() == pytest.approx([0.75, -0.75])
    assert glob["w"].tolist() == pytest.approx([0.75, -0.75])


def test_fedavg_drifts_off_the_global_optimum_with_many_local_steps():
    # Two clients with different curvatures: the global optimum of the sum is the
    # curvature-weighted mean of the targets, FedAvg's fixed point is not.
    a = [torch.tensor([1.0], dtype=torch.float64), torch.tensor([10.0], dtype=torch.float64)]
    c = [torch.tensor([1.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)]
    optimum = (a[0] * c[0] + a[1] * c[1]) / (a[0] + a[1])
    glob, _, _ = simulate(FedAvg(), {"w": torch.zeros(1, dtype=torch.float64)},
                          [quadratic(a[k], c[k]) for k in range(2)], [0.5, 0.5], rounds=200, steps=20, lr=0.05)
    assert abs(glob["w"].item() - optimum.item()) > 0.1


# ---- properties of the aggregation (hypothesis) ------------------------------------------

PROPERTY = settings(max_examples=60, deadline=None)
sizes = st.lists(st.integers(1, 10_000), min_size=1, max_size=8)
values = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@st.composite
def client_models(draw, min_clients=1):
    """Several clients' adapters: the same names and shapes, random values (float64)."""
    shapes = draw(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=2), min_size=1, max_size=3))
    n = draw(st.integers(min_clients, 6))

    def tensor(shape):
        count = int(torch.tensor(shape).prod())
        return torch.tensor(draw(st.lists(values, min_size=count, max_size=count)), dtype=torch.float64).reshape(shape)

    return [{f"layer{i}.lora_A": tensor(shape) for i, shape in enumerate(shapes)} for _ in range(n)]


@PROPERTY
@given(sizes=sizes, data=st.data())
def test_data_weights_sum_to_one_and_follow_the_sizes(sizes, data):
    weights = data_weights(sizes)
    assert sum(weights) == pytest.approx(1.0, abs=1e-12)
    assert all(0 < w <= 1 for w in weights)
    assert all(w * sizes[0] == pytest.approx(weights[0] * n) for w, n in zip(weights, sizes))
    order = data.draw(st.permutations(range(len(sizes))))
    assert data_weights([sizes[i] for i in order]) == [weights[i] for i in order]


@PROPERTY
@given(models=client_models(min_clients=2), sizes=sizes, data=st.data())
def test_weighted_average_does_not_depend_on_the_clients_order(models, sizes, data):
    weights = data_weights((sizes * len(models))[: len(models)])
    order = data.draw(st.permutations(range(len(models))))
    a = weighted_average(models, weights)
    b = weighted_average([models[i] for i in order], [weights[i] for i in order])
    for n in a:
        assert torch.allclose(a[n], b[n], rtol=1e-12, atol=1e-9)


@PROPERTY
@given(models=client_models(), data=st.data())
def test_weighted_average_of_one_model_or_of_copies_is_that_model(models, data):
    alone = weighted_average(models[:1], [1.0])
    assert all(torch.equal(alone[n], models[0][n]) for n in alone)
    copies = data.draw(st.integers(1, 5))
    same = weighted_average([models[0]] * copies, data_weights(data.draw(st.lists(st.integers(1, 99), min_size=copies,
                                                                                  max_size=copies))))
    assert all(torch.allclose(same[n], models[0][n], rtol=1e-12, atol=1e-9) for n in same)


AVERAGING = sorted(name for name, cls in METHODS.items()  # FedAvg's server rule: the default sum, as it is
                   if cls.aggregation_sums is FedAvg.aggregation_sums
                   and cls.finish_aggregation is FedAvg.finish_aggregation)


@PROPERTY
@given(models=client_models(), method=st.sampled_from(AVERAGING))
def test_a_single_client_round_returns_its_own_model(models, method):
    rule = METHODS[method]()
    glob = {n: torch.zeros_like(t) for n, t in models[0].items()}
    out = rule.aggregate(glob, [{"params": models[0]}], data_weights([7]), rule.init_server_state(glob),
                         RoundContext(0, 1, [0]))
    assert out.keys() == models[0].keys() and all(torch.equal(out[n], models[0][n]) for n in out)


def test_clone_and_zeros_are_independent_views_of_one_buffer_and_keep_mixed_dtypes():
    params = {"a": torch.randn(2, 3), "b": torch.randn(4)}
    copy = clone(params)
    assert copy["a"].untyped_storage().data_ptr() == copy["b"].untyped_storage().data_ptr()
    assert all(torch.equal(copy[n], params[n]) for n in params)
    copy["a"].add_(1.0)  # a view is still its own tensor: its neighbour and the source are untouched
    assert torch.equal(copy["b"], params["b"]) and not torch.equal(copy["a"], params["a"])
    zeros = zeros_like(params, torch.float64)
    assert all(z.dtype == torch.float64 and z.shape == params[n].shape and not z.any() for n, z in zeros.items())
    mixed = {"f": torch.ones(2), "d": torch.ones(3, dtype=torch.float64)}
    assert {n: t.dtype for n, t in clone(mixed).items()} == {"f": torch.float32, "d": torch.float64}
