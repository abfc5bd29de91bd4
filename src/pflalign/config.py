"""A run's configuration, checked as a whole: `build_config` (defaults <- preset or file <-
overrides) checks each value (`pflalign.settings`), then the method's name and hyperparameters,
the data's partition options and the optional extras (TensorBoard); `make_method` builds the
run's method. The values themselves (the dataclasses, presets, ``--set`` parsing) live in
`pflalign.settings` at the bottom of the import layers; this module sits above the methods and
the data code it checks against, and re-exports those names so ``pflalign.config.RunConfig``
keeps working. Its imports of the methods, the data code and TensorBoard stay inside the functions
that use them: importing this module stays cheap (no torch) until a config is checked.
"""

from __future__ import annotations

import math
import typing
from pathlib import Path

from .errors import UserError
from .settings import (OPTIMIZERS, PRESETS, SCHEDULES, SEED_LIMIT, DataColumns, DataConfig,  # noqa: F401
                       EvalConfig, LogConfig, LoraSettings, OptimizerConfig, RunConfig, check,
                       check_optimizer_values, check_values, load_config_source, parse_set, parse_value,
                       resolve_defaults, to_dict)
from .settings.checks import _suggest
from .settings.overrides import _apply, _coerce


def load_saved_config(path: Path) -> RunConfig:
    """A run folder's config.json (at resume), checked: a missing or damaged one is a `UserError`."""
    if not path.is_file():
        raise UserError(f"{path} is missing: the run's config cannot be recovered, so it cannot be resumed; "
                        "start again with --overwrite")
    try:
        return build_config(str(path))
    except UserError as exc:
        raise UserError(f"{path} is damaged ({exc}); the run cannot be resumed; start again with --overwrite") from None


def build_config(source: str | None = None, overrides: dict | None = None, defaults: str = "paper") -> RunConfig:
    """Defaults ← preset/file ← overrides, the keys left unset filled (`settings.resolve_defaults`),
    then validated. `defaults`: which defaults fill them unless the preset, file or overrides name
    theirs: "library" for a new run (`pflalign run`, `sweep`, `api.config`); "paper" (the values of
    every config.json before issue 56) where a saved config is read back."""
    cfg = RunConfig(defaults=defaults)
    _apply(cfg, load_config_source(source))
    _apply(cfg, overrides or {})
    resolve_defaults(cfg)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Every check before any work: the values (`settings.check`), the optional extra being there,
    the partition options, and the method with its arguments."""
    check(cfg)
    if cfg.log.tensorboard:
        from .tensorboard import check as check_tensorboard

        check_tensorboard(cfg)  # the optional extra is there
    from .data.federate import FederationOptions, check_options

    check_options(cfg.data.name, FederationOptions.from_config(cfg.data))
    method_args(cfg)  # unknown method or hyperparameter fails here, before any work
    check_optimizer(cfg)


def check_optimizer(cfg: RunConfig) -> None:
    """optimizer.*'s values, and whether the method takes AdamW local steps (`Method.refuses_adamw`)."""
    check_optimizer_values(cfg)
    from .methods import method_class

    why = method_class(cfg.method).refuses_adamw
    if cfg.optimizer.name == "adamw" and why:
        raise UserError(f"optimizer.name=adamw is not defined for method {cfg.method}: {why}; "
                        "use optimizer.name=sgd (docs/methods.md)")


def method_args(cfg: RunConfig):
    """The method's Args dataclass built from cfg.method_args (checked)."""
    from .methods import method_class

    cls = method_class(cfg.method)
    known = cls.arg_names()
    hints = typing.get_type_hints(cls.Args)
    values = {}
    for key, value in cfg.method_args.items():
        if key not in known:
            listed = ", ".join(known) or "none"
            raise UserError(f"unknown argument {key!r} for method {cfg.method}{_suggest(key, known)}; it takes: {listed}")
        values[key] = _coerce(value, hints[key], f"method_args.{key}")
        if isinstance(values[key], float) and not math.isfinite(values[key]):
            raise UserError(f"method_args.{key} must be a finite number, got {values[key]}")
    try:
        return cls.Args(**values)
    except ValueError as exc:
        raise UserError(f"method {cfg.method}: {exc}") from exc


# What a run's training does not depend on: where the data is read from, where and how fast it
# runs, what is scored and logged. Everything else in a config is its training recipe (`recipe`).
NOT_RECIPE = ("data.dir", "data.max_test", "device", "eval.", "log.",
              "defaults")  # which defaults filled a value: the values themselves are the recipe


def recipe(cfg: RunConfig) -> dict:
    """The training recipe of `cfg`, one dotted key per value: the method and its arguments
    (defaults filled in; those that only pick what is evaluated left out), the model, dtype,
    LoRA, optimizer and schedule, lr, batch, steps, rounds, seed, participation, max_seq_len, and
    the data with its partition; every key but `NOT_RECIPE`'s. A checkpoint stores it, so that
    ``--resume`` can tell when config.json was changed under a run (`lifecycle.Recorder.config`)."""
    import dataclasses

    from .methods import method_class
    from .settings import flat

    whole = dataclasses.asdict(cfg)
    evaluation = method_class(cfg.method).evaluation_args
    whole["method_args"] = {k: v for k, v in dataclasses.asdict(method_args(cfg)).items() if k not in evaluation}
    return {k: v for k, v in flat(whole, empty_tables=False).items()
            if not any(k == n or (n.endswith(".") and k.startswith(n)) for n in NOT_RECIPE)}


def make_method(cfg: RunConfig):
    """The run's method, with its checked arguments: the one constructor every engine uses."""
    from .methods import method_class

    return method_class(cfg.method)(method_args(cfg))


