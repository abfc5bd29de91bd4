"""The server's checks on a client's reply before it is aggregated: clients are not trusted.

A training reply is accepted only if its update (the method's message: one
ArrayRecord per group, ``message/<group>``, each one flat array that
`wire.from_record` cuts into tensors by its layout, refusing one that does
not fit it: the strategy rejects such a reply as "cannot decode") has
exactly the groups, tensor names, shapes and dtypes that the method's
client rule produces
(`expected_message`), every value is finite, it is not all zeros and changes the
model, its norm is within ``max-update-ratio`` times the global model's norm
(default 10) and within ``max-update-norm`` when that bound is set, it carries
no ArrayRecord the method did not ask for, and its metrics are well formed
(non-negative losses, norms and GSNR; n_train no larger than the client's first),
and its declared size n_train is at most ``max-size-ratio`` times the round's
median declared size (`oversized`; the same for an evaluation reply's n_train
and n_test). Otherwise `MethodStrategy` rejects it, logs why with the client's SuperNode
id, and aggregates the round over the other clients (docs/distributed.md).

The update norm is measured as ‖message − w^r‖ over the groups of
``Method.weight_groups`` (the ones that carry adapter weights, e.g.
``params``) and as the norm of the tensors themselves for the other groups
(SCAFFOLD's ``delta_c``), all tensors together.
"""

from __future__ import annotations

import math

import torch

from ..methods.base import Message, Method, Params
from .wire import METHOD_METRIC, wire_dtype  # the dtype a tensor arrives in (bfloat16 travels as float32)

# group → tensor name → (shape, dtype on the wire)
Expected = dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]


class InvalidUpdate(Exception):
    """A client's reply that the server does not aggregate; the message says why."""


def expected_message(method: Method, global_params: Params) -> Expected:
    """The structure of `method`'s client message: what a fresh client sends after a round
    from `global_params` (its client rule run without local steps; values are ignored)."""
    state = method.init_client_state(global_params)
    received = method.broadcast(global_params, method.init_server_state(global_params))
    with torch.no_grad():
        scratch = method.new_scratch()
        params = method.client_start(global_params, state, received, scratch)
        message = method.client_end(global_params, params, state, scratch)
    return {group: {n: (tuple(t.shape), wire_dtype(t.dtype)) for n, t in tensors.items()}
            for group, tensors in message.items()}


def _names(names, limit: int = 3) -> str:
    names = sorted(names)
    return ", ".join(repr(n) for n in names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _key_difference(want, got, noun: str = "") -> str:
    """'missing …; unexpected …' for two key sets that differ."""
    missing, extra = want - got, got - want
    return "; ".join(filter(None, [missing and f"missing {noun}{_names(missing)}",
                                   extra and f"unexpected {noun}{_names(extra)}"]))


def validate_update(update: Message, expected: Expected, max_norm: float = 0.0,
                    reference: dict[str, Params] | None = None, max_ratio: float = 0.0,
                    step_scale: float = 1.0) -> str | None:
    """Why `update` (group → tensors, as received) must be rejected, or None when it is fine.

    `max_norm` > 0 bounds ‖update − reference‖ over all tensors together, where
    `reference` maps a group to the tensors it is measured against (w^r for
    groups of adapter weights); a group without one is measured against zero.
    `max_ratio` > 0 bounds it relative to the model: the change of the weight
    groups by `max_ratio` × ‖w^r‖, every other group (a control variate, in
    weight per unit of lr × local_steps) by `max_ratio` × ‖w^r‖ / `step_scale`.
    An update whose tensors are all zero, or that leaves the weights exactly as
    they were, is refused too (a client that did not train, or one resetting the model).
    """
    reason = _check_structure(update, expected)
    if reason:
        return reason
    reference = reference or {}
    if any(t.numel() for ts in update.values() for t in ts.values()):
        if all(not bool(t.any()) for ts in update.values() for t in ts.values()):
            return "the update is all zeros"
        if reference and all(torch.equal(t, reference[g][n].to(t.dtype)) for g in reference if g in update
                             for n, t in update[g].items()):
            return "the update leaves the model unchanged (no local training)"
    if max_norm > 0:
        norm = _distance(update, reference)
        if not norm <= max_norm:
            return f"update norm {norm:.4g} exceeds max-update-norm={max_norm:g}"
    if max_ratio > 0 and reference:
        scale = _norm(next(iter(reference.values())))
        for weights in (True, False):
            part = {g: ts for g, ts in update.items() if (g in reference) == weights}
            if not part:
                continue
            norm = _distance(part, reference)
            bound = max_ratio * scale / (1.0 if weights else step_scale)
            if not norm <= bound:
                what = "update norm" if weights else f"norm of {', '.join(sorted(part))}"
                return (f"{what} {norm:.4g} exceeds max-update-ratio={max_ratio:g} x the global model's norm "
                        f"{scale:.4g}" + ("" if weights else f" / (lr x local_steps = {step_scale:g})"))
    return None


def _norm(tensors: Params) -> float:
    return math.sqrt(sum(float((t.double() * t.double()).sum()) for t in tensors.values()))


def _distance(update: Message, reference: dict[str, Params]) -> float:
    total = 0.0
    for group, tensors in update.items():
        for name, t in tensors.items():
            d = t.double() - reference[group][name].double() if group in reference else t.double()
            total += float((d * d).sum())
    return math.sqrt(total)


def validate_records(names, expected: Expected, prefix: str) -> str | None:
    """Why a reply's ArrayRecords must be refused: any the method did not ask for."""
    extra = set(names) - {prefix + g for g in expected}
    return f"unexpected ArrayRecord {_names(extra)}" if extra else None


def _check_structure(update: Message, expected: Expected) -> str | None:
    if update.keys() != expected.keys():
        return _key_difference(expected.keys(), update.keys(), "group ")
    for group, want in expected.items():
        got = update[group]
        if got.keys() != want.keys():
            return f"group {group!r}: " + _key_difference(want.keys(), got.keys())
        for name, (shape, dtype) in want.items():
            t = got[name]
            if not isinstance(t, torch.Tensor):
                return f"{group}/{name} is not a tensor"
            if tuple(t.shape) != shape:
                return f"{group}/{name} has shape {tuple(t.shape)}, expected {shape}"
            if t.dtype != dtype:
                return f"{group}/{name} has dtype {t.dtype}, expected {dtype}"
            if not torch.isfinite(t).all():
                return f"{group}/{name} holds NaN or Inf"
    return None


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_eval_metrics(scores) -> str | None:
    """Why an evaluation reply must be left out (what the server reads of it), or None."""
    if not isinstance(scores.get("task"), str):
        return "no task name"
    for key in ("n_train", "n_test", "truncated"):
        value = scores.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"metric {key!r} must be a non-negative integer, got {value!r}"
    if scores["n_test"] == 0:
        return "metric 'n_test' is 0: a score over no test examples"
    for key in ["rouge_l_personalized", "rouge_l_global"] + (["rouge_l_base"] if "rouge_l_base" in scores else []):
        value = scores.get(key)
        if not (_finite_number(value) and 0 <= value <= 100):
            return f"metric {key!r} must be a ROUGE-L score in [0, 100], got {value!r}"
    return None


def lower_median(values) -> int | float:
    """The lower median: the middle value, the smaller of the two middle ones for an even count.
    It is a declared value of an honest client as long as at most half of them inflate theirs
    (two clients: the smaller one, so one liar cannot lift the bound it is checked against)."""
    values = sorted(values)
    return values[(len(values) - 1) // 2]


def oversized(sizes: dict, max_ratio: float, what: str = "n_train") -> dict:
    """The clients of `sizes` (client → its declared size) whose size exceeds `max_ratio` times
    the lower median of all of them → why; {} when `max_ratio` <= 0 (off).

    Why: FedAvg-style weights are |D_k| / sum_j |D_j| over what clients declare, so one reply
    with n_train = 10^12 would take the whole average. The median is not moved by a minority of
    such replies; the bound leaves an honest federation's spread of sizes (up to `max_ratio`
    x the median) alone. A liar can still claim up to that bound: with N clients a weight of at
    most max_ratio / (max_ratio + N - 1) (docs/distributed.md)."""
    if max_ratio <= 0 or not sizes:
        return {}
    median = lower_median(sizes.values())
    return {k: f"metric {what!r} is {n}, more than max-size-ratio={max_ratio:g} x the round's median "
               f"declared {what} ({median})" for k, n in sizes.items() if n > max_ratio * median}


def validate_train_metrics(metrics, local_steps: int, n_train_declared: int | None = None) -> str | None:
    """Why a training reply's metrics must be rejected (what the server reads of them), or None.
    `n_train_declared`: the n_train this client reported first in the run; it may not grow
    (its aggregation weight)."""
    n_train = metrics.get("n_train")
    if not isinstance(n_train, int) or isinstance(n_train, bool) or n_train < 1:
        return f"metric 'n_train' must be a positive integer, got {n_train!r}"
    if n_train_declared is not None and n_train > n_train_declared:
        return f"metric 'n_train' is {n_train}, more than the {n_train_declared} the client declared at the start"
    losses = metrics.get("losses")
    if not isinstance(losses, list) or len(losses) != local_steps or not all(map(_finite_number, losses)):
        return f"metric 'losses' must hold {local_steps} finite numbers (one per local step)"
    if any(loss < 0 for loss in losses):
        return "metric 'losses' holds a negative loss (a cross-entropy is >= 0)"
    for key in ("update_norm", "model_norm"):
        if not _finite_number(metrics.get(key)) or metrics[key] < 0:
            return f"metric {key!r} must be a finite number >= 0, got {metrics.get(key)!r}"
    for key in ("gsnr_mean", "gsnr_ratio"):
        if key in metrics and (not _finite_number(metrics[key]) or metrics[key] < 0):
            return f"metric {key!r} must be a finite number >= 0, got {metrics[key]!r}"
    for key, value in metrics.items():  # the method's own measurements (Method.round_metrics)
        if key.startswith(METHOD_METRIC) and not _finite_number(value):
            return f"metric {key!r} must be a finite number, got {value!r}"
    return None
