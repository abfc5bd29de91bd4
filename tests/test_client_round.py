"""The shared client round: GSNR and update norms against hand computations."""

import math

import pytest
import torch

from pflalign.run.client import GradientStats, distance, local_round
from pflalign.methods import METHODS
from pflalign.methods.base import RoundContext


def test_gsnr_by_hand():
    stats = GradientStats()
    for g in ([1.0, 2.0, 0.0], [3.0, 2.0, 0.0], [2.0, 5.0, 0.0]):
        # split over two tensors: the summaries run over all coordinates together
        stats.add({"a": torch.tensor(g[:2]), "b": torch.tensor(g[2:])})
    # mean = (2, 3, 0); unbiased var = (1, 3, 0); the zero-variance coordinate is left out
    gsnr_mean, gsnr_ratio = stats.summary()
    assert gsnr_mean == pytest.approx((4 / 1 + 9 / 3) / 2)
    assert gsnr_ratio == pytest.approx((4 + 9 + 0) / (1 + 3 + 0))


def test_gsnr_equals_two_pass_mean_and_variance():
    """Welford's running update against torch.var_mean over the stacked steps, with
    a frozen (always zero) tensor whose coordinates must be left out."""
    gen = torch.Generator().manual_seed(0)
    steps = [{"a": torch.randn(40, 16, generator=gen) + 0.3, "b": torch.randn(16, 7, generator=gen),
              "frozen": torch.zeros(5)} for _ in range(5)]
    stats = GradientStats()
    for g in steps:
        stats.add(g)
    flat = torch.stack([torch.cat([t.reshape(-1) for t in g.values()]) for g in steps]).double()
    var, mean = torch.var_mean(flat, dim=0)
    kept = var > 0
    assert int(kept.sum()) == 40 * 16 + 16 * 7
    gsnr_mean, gsnr_ratio = stats.summary()
    assert gsnr_mean == pytest.approx(float((mean[kept] ** 2 / var[kept]).mean()), rel=1e-12)
    assert gsnr_ratio == pytest.approx(float((mean**2).sum() / var.sum()), rel=1e-12)


def test_gsnr_needs_two_steps():
    stats = GradientStats()
    stats.add({"a": torch.tensor([1.0])})
    assert stats.summary() == (None, None)


class QuadraticLM:
    """Stands in for FederatedLM: one tensor w, loss ½‖w − c_batch‖², gradient w − c_batch."""

    def __init__(self):
        self.lora = {"w": torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))}

    def set_lora(self, params):
        with torch.no_grad():
            self.lora["w"].copy_(params["w"])

    def loss_and_grads(self, batch):
        g = self.lora["w"].detach() - batch["target"]
        return float(0.5 * (g * g).sum()), {"w": g.clone()}


def test_local_round_measures_gsnr_and_update_size():
    lm = QuadraticLM()
    glob = {"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    targets = [torch.tensor([3.0, -1.0], dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)]
    lr = 0.5
    method = METHODS["fedavg"]()
    res = local_round(lm, method, {}, glob, {}, [{"target": t} for t in targets], lr, 0)
    # by hand: g0 = w0 − t0 = (−2, 0); w1 = (2, −1); g1 = w1 − t1 = (2, −2); w2 = (1, 0)
    assert res.personalized["w"].tolist() == pytest.approx([1.0, 0.0])
    assert res.losses == pytest.approx([2.0, 4.0])
    # mean g = (0, −1); var = (8, 2): GSNR = (0, 0.5)
    assert res.gsnr_mean == pytest.approx(0.25)
    assert res.gsnr_ratio == pytest.approx(1 / 10)
    assert res.update_norm == pytest.approx(1.0)  # ‖(1, 0) − (1, −1)‖
    assert res.model_norm == pytest.approx(1.0)
    assert distance({"w": torch.tensor([3.0, 4.0])}) == pytest.approx(5.0)


def test_sam_gradient_statistics_use_the_first_gradient_only():
    lm = QuadraticLM()
    glob = {"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    batches = [{"target": torch.tensor([3.0, -1.0], dtype=torch.float64)},
               {"target": torch.tensor([0.0, 1.0], dtype=torch.float64)}]
    plain = local_round(QuadraticLM(), METHODS["fedavg"](), {}, glob, {}, batches, 0.5, 0)
    sam = local_round(lm, METHODS["fedsam"](METHODS["fedsam"].Args(rho=0.0)), {}, glob, {}, batches, 0.5, 0)
    assert sam.gsnr_mean == plain.gsnr_mean and sam.gsnr_ratio == plain.gsnr_ratio
    sam2 = local_round(QuadraticLM(), METHODS["fedsam"](), {}, glob, {}, batches, 0.5, 0)
    assert math.isfinite(sam2.gsnr_ratio)



class PairLM:
    """One LoRA pair: A's and B's gradients come from a script, loss 0."""

    A, B = "layer.lora_A.default.weight", "layer.lora_B.default.weight"

    def __init__(self, script):
        self.lora = {n: torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)) for n in (self.A, self.B)}
        self.script = iter(script)

    def set_lora(self, params):
        with torch.no_grad():
            for n, p in self.lora.items():
                p.copy_(params[n])

    def loss_and_grads(self, batch):
        a, b = next(self.script)
        return 0.0, {self.A: torch.tensor(a, dtype=torch.float64), self.B: torch.tensor(b, dtype=torch.float64)}


@pytest.mark.parametrize("name", ["ffa-lora", "fedsvd"])
def test_gsnr_leaves_out_tensors_the_method_keeps_frozen(name):
    # B's gradients (1, 2), (3, 2): mean (2, 2), var (2, 0) → GSNR_1 = 2, coordinate 2 left out;
    # gsnr_ratio = ‖(2, 2)‖² / 2 = 4. A's noisy gradients would change both if they entered.
    script = [([5.0, -1.0], [1.0, 2.0]), ([-3.0, 4.0], [3.0, 2.0])]
    glob = {PairLM.A: torch.ones(2, dtype=torch.float64), PairLM.B: torch.zeros(2, dtype=torch.float64)}
    method = METHODS[name]()
    assert not method.trains(PairLM.A) and method.trains(PairLM.B)
    res = local_round(PairLM(script), method, {}, glob, {}, [{}, {}], 0.1, 0)
    assert res.gsnr_mean == pytest.approx(2.0) and res.gsnr_ratio == pytest.approx(4.0)
    both = local_round(PairLM(script), METHODS["fedavg"](), {}, glob, {}, [{}, {}], 0.1, 0)
    assert both.gsnr_ratio != pytest.approx(4.0)  # FedAvg trains A: its gradients count


class ScriptedLM(QuadraticLM):
    """Returns the (loss, gradient) pairs it is given, one per call."""

    def __init__(self, script):
        super().__init__()
        self.script = iter(script)

    def loss_and_grads(self, batch):
        loss, grad = next(self.script)
        return loss, {"w": torch.tensor(grad, dtype=torch.float64)}


class NaNUpdate(METHODS["fedavg"]):
    """FedAvg whose message holds a NaN that neither the loss, the gradients nor the weights show."""

    def client_end(self, global_params, params, state, scratch):
        return {"params": {n: torch.full_like(w, float("nan")) for n, w in params.items()}}


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("second_step,method,what", [
    ((NAN, [0.0, 0.0]), "fedavg", "the loss"),
    ((1.0, [INF, 0.0]), "fedavg", "the gradient of w"),
    ((1.0, [1e308, 0.0]), "fedavg", "the weights w"),  # a finite gradient, a step too large: w − 10·1e308 = −inf
    ((1.0, [0.0, 0.0]), "nan-update", "the update params/w"),
])
def test_non_finite_values_stop_the_round_naming_what_and_when(second_step, method, what):
    from pflalign.errors import TrainingDiverged

    glob = {"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    lm = ScriptedLM([(1.0, [0.1, 0.1]), second_step])
    rule = NaNUpdate() if method == "nan-update" else METHODS[method]()
    with pytest.raises(TrainingDiverged, match=rf"non-finite value in {what} at round 3, local step 2 \(lr=10\): "
                                               r"try a lower learning rate$"):
        local_round(lm, rule, {}, glob, {}, [{}, {}], 10.0, 2)


@pytest.mark.parametrize("method", ["pflalign", "scaffold", "fedgloss"])
def test_a_round_that_stops_midway_leaves_no_scratch_in_the_state(method):
    """The round's scratch (pFLAlign's m, SCAFFOLD's c and Σ η, FedGloSS's w̃) is not part of the
    client state, so a round that raises between `client_start` and `client_end` leaves the state
    with its persistent groups only (when the scratch lived in the state, client_end removed it,
    and a diverged round left it there)."""
    from pflalign.errors import TrainingDiverged

    glob = {"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    rule = METHODS[method]()
    state = rule.init_client_state(glob)
    groups = set(state)
    received = rule.broadcast(glob, rule.init_server_state(glob))
    with pytest.raises(TrainingDiverged):
        local_round(ScriptedLM([(1.0, [0.1, 0.1]), (NAN, [0.0, 0.0])]), rule, state, glob, received, [{}, {}], 0.1, 0)
    assert set(state) == groups


class LoraPairLM:
    """Stands in for FederatedLM with one LoRA pair: loss ½‖B A − M‖², M the batch's target."""

    A, B = "layer.lora_A.default.weight", "layer.lora_B.default.weight"

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.lora = {self.A: torch.nn.Parameter(torch.randn(2, 4, generator=g, dtype=torch.float64)),
                     self.B: torch.nn.Parameter(torch.randn(5, 2, generator=g, dtype=torch.float64) * 0.1)}

    def set_lora(self, params):
        with torch.no_grad():
            for n, p in self.lora.items():
                p.copy_(params[n])

    def loss_and_grads(self, batch):
        a, b = self.lora[self.A].detach(), self.lora[self.B].detach()
        residual = b @ a - batch["target"]
        return float(0.5 * (residual**2).sum()), {self.A: b.T @ residual, self.B: residual @ a.T}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_aggregation_never_writes_into_messages_that_personalized_adapters_share(name):
    """local_round lets a client's personalized adapter share the tensors of the adapter it
    sends when both hold the same values; that is safe only if no aggregation writes into
    its messages. Two rounds, two clients, every method."""
    method, lm = METHODS[name](), LoraPairLM()
    g = torch.Generator().manual_seed(1)
    batches = [[{"target": torch.randn(5, 4, generator=g, dtype=torch.float64)} for _ in range(3)] for _ in range(2)]
    glob = {n: p.detach().clone() for n, p in lm.lora.items()}
    server, states = method.init_server_state(glob), [method.init_client_state(glob) for _ in range(2)]
    shared = 0
    for r in range(2):
        received = method.broadcast(glob, server)
        results = [local_round(lm, method, states[k], glob, received, batches[k], 0.1, r) for k in range(2)]
        before = [{g_: {n: t.clone() for n, t in group.items()} for g_, group in res.message.items()} for res in results]
        glob = method.aggregate(glob, [res.message for res in results], [0.5, 0.5], server, RoundContext(r, 2, [0, 1]))
        for res, saved in zip(results, before):
            for group, tensors in saved.items():
                for n, t in tensors.items():
                    assert torch.equal(res.message[group][n], t), f"{name} aggregation changed {group}/{n}"
            shared += res.personalized is res.message.get("params")
    if name in ("fedavg", "pflalign"):  # personalized = w_{k,T} = the adapter sent
        assert shared == 4
