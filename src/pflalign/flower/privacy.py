"""Differential privacy and secure aggregation on Flower, with Flower's own parts.

Both are run-config options (`OPTIONS`, docs/distributed.md) for methods whose
server rule needs only the data-weighted sum of the uploads
(`Method.needs_each_upload` is None) and whose server sends w^r alone:

* **DP** (``dp-clipping-norm`` > 0): central DP with client-side fixed
  clipping, as Flower's ``DifferentialPrivacyClientSideFixedClipping``: the
  server puts ``clipping_norm`` into each training message's config, the
  client's Flower mod ``fixedclipping_mod`` clips the upload's change
  w_{k,T} − w^r to that norm, and the server adds Gaussian noise (Flower's
  `add_gaussian_noise_inplace`) to the weighted mean of the uploads. The
  noise goes onto that mean, before the method's server rule, and not onto
  the rule's output as Flower's wrapper would: for FedAdam/FedYogi/FedAdagrad
  the output is not a mean whose sensitivity the noise was sized for, while
  the rule applied to a private mean is post-processing. Its standard
  deviation is ``dp-noise-multiplier`` × C × max_k p_k (the sensitivity of
  Σ_k p_k u_k with p_k the data weights); with equal weights that is
  Flower's σ C / m. The noise level of each round goes to ``metrics.jsonl``
  and ``results.json``, with the client-level (ε, δ) of the whole run
  (`epsilon`: ``dp-delta``, Google's ``dp-accounting`` RDP accountant over
  the rounds that added noise, each a Gaussian mechanism of noise multiplier
  σ). No amplification by sampling is claimed when ``participation`` < 1, so
  ε is then an upper bound.
* **SecAgg+** (``secagg = true``): Flower's ``SecAggPlusWorkflow`` on the
  server and ``secaggplus_mod`` on the clients. The server gets only the
  masked, quantized uploads and their sum (the workflow weights each by the
  client's ``num_examples``, its |D_k|), never one client's upload; the
  method's server rule runs on that mean. The quantization
  (``secagg-clipping-range``, ``secagg-quantization-range``,
  ``secagg-max-weight``) makes the mean exact to within
  `quantization_error`. The per-client checks of `validate` cannot look at a
  masked upload: only the clients' metrics and the mean are checked.

Flower's SecAgg+ workflow and its mods of 1.41 still speak the legacy
``FitIns``/``FitRes`` records (``fitins.parameters``, ``fitres.metrics``, …),
so under SecAgg+ a training message and its reply take that layout
(`secagg_round` here, `client_app.train`); the adapter travels as an ordered
list of arrays whose names go along in the config (``names``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, add_gaussian_noise_inplace

from ..errors import UserError
from ..methods import REGISTRY
from ..methods.base import Message, Method, Params
from . import validate, wire

# The privacy keys of the run config and their defaults (wire.RUN_DEFAULTS holds them with the
# others, so that the wire format needs nothing from this module).
OPTIONS = {k: v for k, v in wire.RUN_DEFAULTS.items() if k.startswith(("dp-", "secagg"))}
LEGACY_FITINS = "fitins.config"  # the ConfigRecord of a SecAgg+ training message (Flower's legacy layout)


@dataclass(frozen=True)
class Privacy:
    noise_multiplier: float = 0.0
    clipping_norm: float = 0.0
    secagg: bool = False
    num_shares: float = 1.0
    reconstruction_threshold: float = 0.67
    clipping_range: float = 8.0
    quantization_range: int = 4194304
    max_weight: float = 1000.0
    delta: float = 1e-5

    @property
    def dp(self) -> bool:
        return self.clipping_norm > 0

    def options(self) -> str:
        """The options switched on, as the run config spells them."""
        return " and ".join(filter(None, [self.dp and "dp-clipping-norm", self.secagg and "secagg=true"]))

    def report(self, noise_std: list[float | None] | None = None) -> dict:
        """`results.json`'s ``flower.privacy``; `noise_std`: the noise of each round (None: no noise
        added, e.g. a round not run), from which the run's (ε, δ) follows."""
        out = {}
        if self.dp:
            noised = sum(std is not None for std in noise_std or [])
            eps = epsilon(self.noise_multiplier, noised, self.delta)
            out["dp"] = {"mechanism": "Gaussian, client-side fixed clipping (Flower fixedclipping_mod)",
                         "noise_multiplier": self.noise_multiplier, "clipping_norm": self.clipping_norm,
                         "noise_std": noise_std, "rounds_with_noise": noised, "delta": self.delta,
                         "epsilon": eps if eps is not None and math.isfinite(eps) else None,
                         "accountant": ("dp-accounting RDP, no amplification by sampling (an upper bound)"
                                        if eps is not None else "none: install dp-accounting for ε"
                                        ) + ("; no noise, so no finite ε" if eps == math.inf else "")}
        if self.secagg:
            out["secagg"] = {k: v for k, v in asdict(self).items()
                             if k in ("num_shares", "reconstruction_threshold", "clipping_range",
                                      "quantization_range", "max_weight")}
        return out


def from_run_config(rc: dict) -> Privacy:
    """The privacy options of a run config; a bad value is a `UserError` naming its key."""
    def number(key: str, low: float, integer: bool = False, strict: bool = False):
        value = rc.get(key, OPTIONS[key])
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and (value > low if strict else value >= low) and (not integer or float(value).is_integer())
        if not ok:
            raise UserError(f"run config {key} must be {'an integer' if integer else 'a number'} "
                            f"{'>' if strict else '>='} {low:g}, got {value!r}")
        return int(value) if integer else float(value)

    secagg = rc.get("secagg", False)
    if not isinstance(secagg, bool):
        raise UserError(f"run config secagg must be true or false, got {secagg!r}")
    privacy = Privacy(number("dp-noise-multiplier", 0), number("dp-clipping-norm", 0), secagg,
                      number("secagg-num-shares", 0, strict=True),
                      number("secagg-reconstruction-threshold", 0, strict=True),
                      number("secagg-clipping-range", 0, strict=True),
                      number("secagg-quantization-range", 1, integer=True, strict=True),
                      number("secagg-max-weight", 0, strict=True), number("dp-delta", 0, strict=True))
    if privacy.delta >= 1:
        raise UserError(f"run config dp-delta must be < 1, got {privacy.delta!r}")
    if privacy.noise_multiplier > 0 and not privacy.dp:
        raise UserError("run config dp-noise-multiplier needs dp-clipping-norm > 0 (the noise is sized by it)")
    if privacy.secagg and privacy.reconstruction_threshold > 1 and privacy.num_shares <= 1:
        raise UserError("run config secagg-reconstruction-threshold as a count needs secagg-num-shares as a count")
    return privacy


def check_resume(saved: dict | None, privacy: Privacy) -> None:
    """A resumed run keeps the privacy options it started with: other noise or clipping would
    mix two mechanisms in one model and make the reported (ε, δ) wrong. `saved`: the checkpoint's
    ``asdict(Privacy)`` (None for a checkpoint from before it was saved: not checked)."""
    if saved is None or Privacy(**saved) == privacy:
        return
    changed = ", ".join(f"{key} {saved[key]!r} -> {value!r}" for key, value in asdict(privacy).items()
                        if saved[key] != value)
    raise UserError(f"this run started with other privacy options ({changed}); resume it with the "
                    "run config's dp-*/secagg* keys as they were")


# ---- which methods --------------------------------------------------------------------------
def why_not(method: Method, w0: Params, dp: bool) -> str | None:
    """Why `method` cannot run with secure aggregation (and, with `dp`, DP clipping), or None."""
    reason = method.needs_each_upload()
    if reason:
        return reason
    sent = method.broadcast(w0, method.init_server_state(w0))
    if sent:
        return (f"its server sends {', '.join(sorted(sent))} besides w^r, which Flower's SecAgg+ workflow "
                "and fixedclipping_mod do not carry")
    expected = validate.expected_message(method, w0)
    if dp and (list(expected) != ["params"] or list(expected["params"]) != list(w0)):
        return (f"it uploads {', '.join(expected) or 'nothing'} rather than the whole adapter; Flower's "
                "fixedclipping_mod clips an upload holding exactly the tensors of w^r")
    return None


def check(privacy: Privacy, method: Method, w0: Params) -> None:
    """Refuse, in one line, a privacy option the method cannot use."""
    if not (privacy.dp or privacy.secagg):
        return
    reason = why_not(method, w0, privacy.dp)
    if reason:
        raise UserError(f"{privacy.options()} cannot be used with method={method.name}: {reason} "
                        f"(these can: {', '.join(compatible(privacy.dp))}; see docs/distributed.md)")


def compatible(dp: bool) -> list[str]:
    """The registered methods (default arguments) that can use SecAgg+ (and, with `dp`, DP)."""
    w0 = {"layer.lora_A.default.weight": torch.ones(2, 3), "layer.lora_B.default.weight": torch.ones(3, 2)}
    return [cls.name for cls in REGISTRY if why_not(cls(), w0, dp) is None]


# ---- DP: the noise and its (ε, δ) ------------------------------------------------------------
def epsilon(noise_multiplier: float, rounds: int, delta: float) -> float | None:
    """Client-level ε of `rounds` Gaussian mechanisms of noise multiplier σ (noise std over the
    sensitivity), composed, at `delta` (Rényi DP accountant of Google's dp-accounting, the one
    Flower and Opacus use). inf without noise; 0 rounds: 0; None if dp-accounting is missing."""
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    try:
        from dp_accounting import dp_event
        from dp_accounting.rdp import rdp_privacy_accountant
    except ImportError:
        return None
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_event.GaussianDpEvent(noise_multiplier), rounds)
    return float(accountant.get_epsilon(delta))


class WeightedMean:
    """The running Σ_k weights[k] · m_k over a round's uploads, group by group, in float64 (what
    the SecAgg+ sum gives too), fed one upload at a time in client order; `result` casts it back
    to the uploads' dtypes. Each term is rounded to float64, then added."""

    def __init__(self, weights: list[float]):
        self.weights = weights
        self.total: Message | None = None
        self.dtypes: dict[str, dict[str, torch.dtype]] = {}

    def add(self, i: int, message: Message) -> None:
        if self.total is None:
            self.total = {g: {n: torch.zeros_like(t, dtype=torch.float64) for n, t in ts.items()}
                          for g, ts in message.items()}
            self.dtypes = {g: {n: t.dtype for n, t in ts.items()} for g, ts in message.items()}
        for g, ts in self.total.items():
            for n, t in ts.items():
                t.add_(self.weights[i] * message[g][n].double())

    def result(self) -> Message:
        return {g: {n: t.to(self.dtypes[g][n]) for n, t in ts.items()} for g, ts in self.total.items()}


def weighted_mean(messages: list[Message], weights: list[float]) -> Message:
    """Σ_k weights[k] · messages[k] of a list (`WeightedMean` over it)."""
    mean = WeightedMean(weights)
    for i, message in enumerate(messages):
        mean.add(i, message)
    return mean.result()


def add_noise(privacy: Privacy, mean: Message, weights: list[float]) -> float:
    """Add the Gaussian noise of DP to `mean` (in place; Flower's `add_gaussian_noise_inplace`);
    its standard deviation σ C max_k p_k."""
    std = privacy.noise_multiplier * privacy.clipping_norm * max(weights)
    for tensors in mean.values():
        for n, t in tensors.items():
            arrays = [t.detach().cpu().double().numpy()]
            add_gaussian_noise_inplace(arrays, std)
            tensors[n] = torch.from_numpy(np.asarray(arrays[0])).to(t.dtype)
    return std


# ---- SecAgg+: the legacy records Flower's workflow and mods use -------------------------------
def to_parameters(tensors: Iterable[torch.Tensor]) -> Parameters:
    return ndarrays_to_parameters([t.detach().cpu().float().numpy() for t in tensors])


def flatten(message: Message) -> list[torch.Tensor]:
    """A message's tensors in order (its groups, then their names, as the method builds them)."""
    return [t for tensors in message.values() for t in tensors.values()]


def unflatten(arrays: list[np.ndarray], expected: validate.Expected) -> Message:
    """The inverse of `flatten`, on the method's `expected` structure (its wire dtypes);
    shapes are checked."""
    sizes = [shape for tensors in expected.values() for shape, _ in tensors.values()]
    if len(arrays) != len(sizes) or any(tuple(a.shape) != s for a, s in zip(arrays, sizes)):
        raise UserError(f"the secure aggregate has {len(arrays)} arrays of shapes "
                        f"{[tuple(a.shape) for a in arrays][:3]}..., not the method's {len(sizes)}")
    it = iter(arrays)
    return {g: {n: torch.from_numpy(np.asarray(next(it), dtype=np.float64)).to(dtype) for n, (_, dtype) in tensors.items()}
            for g, tensors in expected.items()}


def fitres_reply(message: Message, n_train: int, metrics: dict) -> RecordDict:
    """A client's reply under SecAgg+: Flower's legacy FitRes records (the upload, |D_k| as
    ``num_examples``, the metrics; a list as JSON: legacy metrics are scalars)."""
    scalars = {k: json.dumps(v) if isinstance(v, list) else v for k, v in metrics.items()}
    return compat.fitres_to_recorddict(FitRes(Status(Code.OK, ""), to_parameters(flatten(message)), n_train,
                                              scalars), keep_input=True)


def fitins_parts(content: RecordDict) -> tuple[ConfigRecord, Params]:
    """A SecAgg+ training message's config and w^r (names from the config's ``names``)."""
    fitins = compat.recorddict_to_fitins(content, keep_input=True)
    conf = ConfigRecord(dict(fitins.config))
    names = json.loads(str(conf["names"]))
    arrays = parameters_to_ndarrays(fitins.parameters)
    if len(names) != len(arrays):
        raise UserError(f"the training message has {len(arrays)} arrays for {len(names)} names")
    return conf, {n: torch.from_numpy(np.array(a)) for n, a in zip(names, arrays)}


def quantization_error(privacy: Privacy, n_train: list[int], max_abs: float) -> float:
    """A bound on |SecAgg+ mean − exact weighted mean| per value, for uploads whose values are
    at most `max_abs` in size (and within the clipping range once weighted).

    Client k sends x_k q_k / T quantized to the grid of step 2 c / T (c the clipping range, T
    the quantization range, q_k = round(T |D_k| / max-weight) its quantized weight), off by
    less than a step; the server divides the sum by D' = Σ_k q_k / T. So the mean is the
    q-weighted mean, off by less than N (2 c / T) / D'; and q_k / (T D') differs from the
    exact weight by at most 1 / (2 T D') + r_k N / (2 T D D') (r_k = |D_k| / max-weight, D =
    Σ_k r_k), N max_abs / (T D') over all k."""
    steps = privacy.quantization_range
    ratios = [n / privacy.max_weight for n in n_train]
    quantized = sum(round(r * steps) for r in ratios) / steps  # D'
    return len(n_train) * (2 * privacy.clipping_range + max_abs) / (steps * quantized)


class _Proxy(ClientProxy):
    """A SuperNode as the legacy workflow names it: only its node id is used."""

    def get_properties(self, ins, timeout, group_id): raise NotImplementedError
    def get_parameters(self, ins, timeout, group_id): raise NotImplementedError
    def fit(self, ins, timeout, group_id): raise NotImplementedError
    def evaluate(self, ins, timeout, group_id): raise NotImplementedError
    def reconnect(self, ins, timeout, group_id): raise NotImplementedError


def _proxy(node: int) -> _Proxy:
    proxy = _Proxy(str(node))
    proxy.node_id = node
    return proxy


class _Round(LegacyStrategy):
    """The legacy strategy SecAggPlusWorkflow drives for one round: it hands out the FitIns
    prepared by `secagg_round` and keeps what the workflow aggregated (the weighted mean of the
    uploads) and the clients' FitRes (their metrics; their parameters are that mean)."""

    def __init__(self, fitins: dict[int, FitIns]):
        self.fitins = fitins
        self.mean: list[np.ndarray] | None = None
        self.results: list[tuple[int, FitRes]] = []
        self.failures: list = []

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_proxy(node), ins) for node, ins in self.fitins.items()]

    def aggregate_fit(self, server_round, results, failures):
        self.failures = list(failures)
        self.results = [(proxy.node_id, res) for proxy, res in results]
        if results:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
        return (results[0][1].parameters if results else None), {}

    def initialize_parameters(self, client_manager): return None
    def configure_evaluate(self, server_round, parameters, client_manager): return []
    def aggregate_evaluate(self, server_round, results, failures): return None, {}
    def evaluate(self, server_round, parameters): return None


def secagg_round(privacy: Privacy, grid, server_round: int, fitins: dict[int, FitIns], timeout: float):
    """One round of Flower's SecAgg+ (`SecAggPlusWorkflow`) over the SuperNodes of `fitins`:
    (the weighted mean of their uploads or None when the protocol halted, [(node id, FitRes)]
    of the clients in it, the failures)."""
    strategy = _Round(fitins)
    state = RecordDict({"config": ConfigRecord({"current_round": server_round}),
                        "parameters": compat.parameters_to_arrayrecord(next(iter(fitins.values())).parameters,
                                                                       keep_input=True)})
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}),
                            strategy=strategy)
    SecAggPlusWorkflow(privacy.num_shares, privacy.reconstruction_threshold, max_weight=privacy.max_weight,
                       clipping_range=privacy.clipping_range, quantization_range=privacy.quantization_range,
                       timeout=timeout)(grid, context)
    return strategy.mean, strategy.results, strategy.failures


def fit_config(config: ConfigRecord, names: list[str], privacy: Privacy) -> dict:
    """A SecAgg+ training message's config: ours (scalars only, as legacy configs are), the
    adapter's names, and the clipping norm when DP is on."""
    out = {**dict(config), "names": json.dumps(names)}
    if privacy.dp:
        out[KEY_CLIPPING_NORM] = privacy.clipping_norm
    return out
