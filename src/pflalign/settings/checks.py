"""Each value of a config checked on its own (types aside: `overrides`): ranges, finite numbers,
seeds, the method's name; each failure is one line (`UserError`) before anything loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import math

from ..errors import UserError
from .run_config import METHOD_NAMES, OPTIMIZERS, SCHEDULES, RunConfig


def _suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_method_name(name: str) -> None:
    """Refuse a method that is not in `METHOD_NAMES`, with the closest name."""
    if name not in METHOD_NAMES:
        raise UserError(f"unknown method {name!r}{_suggest(name, METHOD_NAMES)}; run `pflalign methods` for the list")


def check(cfg: RunConfig) -> None:
    """Every check of a config's own values: the ranges below and `check_values`; what needs the
    methods or the data code (a method's arguments, partition options) is `pflalign.config.validate`'s."""
    check_method_name(cfg.method)
    checks = [
        (cfg.rounds > 0, f"rounds must be > 0, got {cfg.rounds}"),
        (cfg.local_steps > 0, f"local_steps must be > 0, got {cfg.local_steps}"),
        (cfg.batch_size > 0, f"batch_size must be > 0, got {cfg.batch_size}"),
        (cfg.lr > 0, f"lr must be > 0, got {cfg.lr}"),
        (cfg.max_seq_len > 1, f"max_seq_len must be > 1, got {cfg.max_seq_len}"),
        (0 < cfg.participation <= 1, f"participation must be in (0, 1], got {cfg.participation}"),
        (cfg.lora.r > 0, f"lora.r must be > 0, got {cfg.lora.r}"),
        (cfg.lora.alpha > 0, f"lora.alpha must be > 0, got {cfg.lora.alpha}"),
        (cfg.eval.max_new_tokens > 0, f"eval.max_new_tokens must be > 0, got {cfg.eval.max_new_tokens}"),
        (cfg.eval.batch_size == "auto" or (isinstance(cfg.eval.batch_size, int) and cfg.eval.batch_size > 0),
         f"eval.batch_size must be > 0 or auto, got {cfg.eval.batch_size!r}"),
        (cfg.eval.every >= 0, f"eval.every must be >= 0, got {cfg.eval.every}"),
        (cfg.data.template in ("chat", "plain"), f"data.template must be chat or plain, got {cfg.data.template!r}"),
        (cfg.dtype in ("float32", "bfloat16", "float16"), f"dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}"),
        (cfg.device in ("cpu", "cuda", "auto") or cfg.device.startswith("cuda:"), f"device must be cpu, cuda or auto, got {cfg.device!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    for name, value in (("data.max_train", cfg.data.max_train), ("data.max_test", cfg.data.max_test),
                        ("data.validation", cfg.data.validation),
                        ("eval.every_max_test", cfg.eval.every_max_test), ("eval.clients", cfg.eval.clients)):
        if value is not None and value <= 0:
            raise UserError(f"{name} must be > 0, got {value}")
    check_values(cfg)


def _non_finite(obj, prefix: str = "") -> list[str]:
    """Dotted keys of NaN or infinite numbers anywhere in a (nested) config."""
    if dataclasses.is_dataclass(obj):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return [k for key, v in obj.items() for k in _non_finite(v, f"{prefix}{key}.")]
    if isinstance(obj, float) and not math.isfinite(obj):
        return [prefix.rstrip(".")]
    return []


SEED_LIMIT = 2**32  # seeds feed numpy's and torch's generators, and seed * 1009 + client the data order


def check_values(cfg: RunConfig) -> None:
    """The value checks beyond `validate`'s first list (issue 20): each fails with one line
    before anything loads, instead of a traceback in the model or in round 1."""
    bad = _non_finite(cfg)
    if bad:
        raise UserError(f"config key {bad[0]} must be a finite number, got {_get(cfg, bad[0])}")
    checks = [
        (0 <= cfg.lora.dropout < 1, f"lora.dropout must be in [0, 1), got {cfg.lora.dropout}"),
        (bool(cfg.lora.target_modules) and all(isinstance(m, str) and m.strip() for m in cfg.lora.target_modules),
         f"lora.target_modules must name at least one module (or all-linear), got {cfg.lora.target_modules!r}"),
        (0 <= cfg.seed < SEED_LIMIT, f"seed must be in [0, 2**32), got {cfg.seed}"),
        (0 <= cfg.data.split_seed < SEED_LIMIT, f"data.split_seed must be in [0, 2**32), got {cfg.data.split_seed}"),
        (cfg.data.seed is None or 0 <= cfg.data.seed < SEED_LIMIT, f"data.seed must be in [0, 2**32), got {cfg.data.seed}"),
        (cfg.data.seed is None or cfg.data.partition != "natural",
         "data.seed seeds a partition's draws (iid, dirichlet, shard, linear, ...); data.partition=natural draws "
         "nothing: leave data.seed unset"),
        (cfg.data.clients is None or len(cfg.data.clients) > 0, "data.clients must list at least one client"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def check_optimizer_values(cfg: RunConfig) -> None:
    """optimizer.*'s values (whether the method takes AdamW steps is `config.validate`'s check)."""
    opt = cfg.optimizer
    checks = [
        (opt.name in OPTIMIZERS, f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {opt.name!r}"),
        (opt.schedule in SCHEDULES, f"optimizer.schedule must be one of {', '.join(SCHEDULES)}, got {opt.schedule!r}"),
        (0 <= opt.beta1 < 1, f"optimizer.beta1 must be in [0, 1), got {opt.beta1}"),
        (0 <= opt.beta2 < 1, f"optimizer.beta2 must be in [0, 1), got {opt.beta2}"),
        (opt.eps > 0, f"optimizer.eps must be > 0, got {opt.eps}"),
        (opt.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {opt.weight_decay}"),
        (0 <= opt.min_lr <= cfg.lr, f"optimizer.min_lr must be in [0, lr={cfg.lr:g}], got {opt.min_lr}"),
        (opt.grad_accumulation > 0, f"optimizer.grad_accumulation must be > 0, got {opt.grad_accumulation}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)

