"""FedAvg: weighted averaging, and the drift on heterogeneous quadratics that motivates the other methods."""

import pytest
import torch

from pflalign.methods import FedAvg
from pflalign.methods.base import RoundContext, weighted_average

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
