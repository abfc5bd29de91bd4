"""The run configuration's values: plain dataclasses with the paper's defaults, presets, and
``--set key=value`` overrides with dotted keys (``lora.r=8``, ``data.name=flan``,
``method_args.beta=0.95``), each value checked on its own (types, ranges, finite numbers).

A config file is TOML or JSON with the same nesting; ``--config`` also takes a
preset name. The resolved config is written to the run directory as JSON.

The bottom of the import layers (issue 40): this module imports only `pflalign.errors`.
Checking a config against the methods, the data options and the optional extras, and building
the run's method, is `pflalign.config`'s job, one layer up.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError


@dataclass
class LoraSettings:
    """LoRA hyperparameters. Paper: r=16, alpha=32; it does not name the target
    modules, so we adapt every linear projection of attention and MLP
    (PEFT's ``all-linear``: q/k/v/o + gate/up/down on Llama, q/k/v/out + fc1/fc2 on OPT)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class DataColumns:
    """data.name=files: which column of your data is what (pflalign.data.files)."""

    instruction: str = "instruction"
    response: str = "response"
    context: str | None = None  # optional: appended to the instruction as "\n\nContext:\n..."


@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic | dolly | flan | files
    dir: str | None = None  # dolly: .jsonl file, folder or hub id; flan: FedDPA folder; files: file, folder or hub id
    clients: list[str] | None = None  # categories, one client each; None: the paper's 4
    split_seed: int = 42  # Dolly's train/test split; fixed across run seeds
    seed: int | None = None  # the partitioners' draws (shuffle, Dirichlet, shards); None: split_seed, as before
    max_train: int | None = None  # keep the first N training examples per client
    max_test: int | None = None  # evaluate on the first N test examples per client
    validation: int | None = None  # hold out N training examples per client and evaluate on them (tuning)
    # Partitions and your own data (pflalign.data.partition / files / federate); the defaults are
    # today's federations: one client per category, Dolly's seeded 10% and FLAN's test.jsonl test sets.
    columns: DataColumns = field(default_factory=DataColumns)
    partition: str = "natural"  # natural | iid | dirichlet | shard | linear | exponential | square
    partition_by: str | None = None  # the column naming a client (natural) or a label (dirichlet, shard)
    num_clients: int | None = None  # every partition but natural
    alpha: float | None = None  # dirichlet: concentration, > 0; smaller is more label skew
    min_partition_size: int | None = None  # fewest rows per client (dirichlet redraws; default 10 there, else 1)
    shards_per_client: int | None = None  # shard: default 2
    test_set: str = "auto"  # auto | per_client | global (pflalign.data.federate)
    test_fraction: float = 0.1  # per_client / global hold-out: ceil(fraction x rows), seeded by split_seed
    drop_empty: bool = False  # files: drop (and count) rows with an empty instruction, response or label
    client_names: str = "numbered"  # numbered: client_000, ...; labelled: client_000-<its most common label>
    template: str = "chat"  # chat: the tokenizer's chat template (plain when it has none); plain: always plain (base models)


@dataclass
class EvalConfig:
    max_new_tokens: int = 128
    batch_size: int = 64  # on CPU, decoding 64 rows costs ~2x one row per token (measured)
    base_model: bool = True  # also score the untrained base model
    every: int = 0  # also score every N rounds (ROUGE-L curves); 0: only at the end
    every_max_test: int | None = 20  # test examples per client for those per-round scores; None: all
    clients: int | None = None  # score a seeded sample of this many clients (many clients); None: all


@dataclass
class LogConfig:
    tensorboard: bool = False  # also log per-round scalars to <out>/tensorboard (extra: pflalign[tensorboard])


# The methods' names in `pflalign.methods.REGISTRY`'s order (a test keeps the two equal): a typo in
# `method` is refused here, before the methods (and torch, transformers: seconds) are imported.
METHOD_NAMES = ("pflalign", "pflalign-no-precond", "pflalign-no-correction", "pflalign-const-gamma",
                "pflalign-hard-gamma", "pflalign-no-personal-init", "fedavg", "fedprox", "fedsam", "scaffold",
                "feddyn", "fedadam", "fedyogi", "fedadagrad", "fedgloss", "local", "ffa-lora", "fedsa-lora", "fedsvd")
OPTIMIZERS = ("sgd", "adamw")  # optimizer.name (pflalign.optim)
SCHEDULES = ("constant", "cosine")  # optimizer.schedule


@dataclass
class OptimizerConfig:
    """The clients' local optimizer, the learning rate across rounds and gradient accumulation
    (pflalign.optim says what each means). Written to config.json only when it differs from
    these defaults (`to_dict`), so a default run's config.json is the one it was before."""

    name: str = "sgd"  # sgd (the paper's) | adamw (OpenFedLLM's, FlowerTune's); moments reset every round
    beta1: float = 0.9  # adamw
    beta2: float = 0.999  # adamw
    eps: float = 1e-8  # adamw
    weight_decay: float = 0.0  # adamw, decoupled (the HF Trainer's default 0)
    schedule: str = "constant"  # constant | cosine (torch's CosineAnnealingLR over rounds, towards min_lr)
    min_lr: float = 0.0  # cosine: the lr it decays towards, reached one round after the last (pflalign.optim)
    grad_accumulation: int = 1  # microbatches of batch_size per local step


@dataclass
class RunConfig:
    method: str = "pflalign"
    method_args: dict = field(default_factory=dict)
    model: str = "smollm2-135m"
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rounds: int = 50
    local_steps: int = 5
    batch_size: int = 4
    lr: float | None = None  # None: `default_lr` (by method, optimizer and `defaults`; issue 56)
    max_seq_len: int = 1024
    seed: int = 0
    participation: float = 1.0  # fraction of clients per round, sampled with the seed
    device: str = "cpu"  # cpu | cuda | auto
    dtype: str = "float32"  # float32 | bfloat16 (GPU)
    # which defaults fill a key the config leaves unset (`resolve_defaults`): "paper" or "library".
    # Not written to config.json: what it filled is (lr, pFLAlign's beta), so a run reads back the same;
    # not compared either: two configs with the same values are the same run whichever filled them.
    defaults: str = field(default="paper", compare=False)


PRESETS: dict[str, dict] = {
    # The embedded default: SmolLM2-135M on the synthetic 4-task federation, a few minutes on 2 cores.
    "demo": {
        "method": "pflalign",
        "model": "smollm2-135m",
        "data": {"name": "synthetic", "max_train": 64, "max_test": 16},
        "rounds": 4,
        "local_steps": 5,
        "max_seq_len": 256,
        "eval": {"max_new_tokens": 24},
    },
    # The paper's settings (Kim & Lee 2026): 4 clients, 50 rounds x 5 steps, batch 4, lr 4e-2, r=16,
    # with the paper defaults (pFLAlign's beta 0.9, as every run before issue 56).
    "flan-paper": {"data": {"name": "flan"}, "eval": {"max_new_tokens": 128}, "defaults": "paper"},
    "dolly-paper": {"data": {"name": "dolly"}, "eval": {"max_new_tokens": 128}, "defaults": "paper"},
}

# ---- defaults that train (issue 56) ----------------------------------------------------------
# What a key the config leaves unset becomes. "paper": every method at the paper's lr 0.04 with SGD
# (Kim & Lee 2026, all methods) and pFLAlign's β 0.9 (the paper states no β; this project's value
# before issue 56, and what a config.json without β ran at). "library", what `pflalign run`,
# `pflalign sweep` and `api.config` start from unless a preset or file says "paper": the same, except
# that pFLAlign (and its variants that keep P) gets β 0.5 and lr 0.16, so that its step is comparable
# to FedAvg's at 0.04. pFLAlign's P is capped by β (docs/methods.md): at β 0.9 a step is under 0.09 ×
# SGD's at the same lr, and 3 rounds at 0.04 did not leave the base model (14.27 against the base's
# 14.06 and FedAvg's 16.36); β 0.5 at lr 0.16 stepped 0.348 × 0.16 = 0.056 there and was the one
# setting above FedAvg (17.59; docs/results/pflalign-analysis, "Practical advice").
DEFAULTS = ("paper", "library")
SGD_LR = 4e-2  # the paper's, for every method
PFLALIGN_LR = 0.16  # "library": pFLAlign's, with PFLALIGN_BETA
PFLALIGN_BETA = 0.5  # "library": pFLAlign's β (its Args default, 0.9, is what a config without β means)
# AdamW's: 2e-4, the LoRA learning rate of the field's recipes (QLoRA's for models up to 13B; TRL's
# PEFT guide, "~10x the full fine-tuning rate"; FlowerTune's LLM templates run 5e-5 down to 1e-6).
# SGD's 0.04 is ~200 × that: AdamW's step is about lr per coordinate whatever the gradient's size.
ADAMW_LR = 2e-4
PFLALIGN_METHODS = METHOD_NAMES[:6]  # pflalign and its five variants


def preconditioned(cfg: RunConfig) -> bool:
    """Whether the run is a pFLAlign method whose step P scales (all but P ≡ 1)."""
    default = cfg.method != "pflalign-no-precond"
    return cfg.method in PFLALIGN_METHODS and cfg.method_args.get("precondition", default) is not False


def default_lr(cfg: RunConfig) -> float:
    """The lr of a config that sets none: AdamW's `ADAMW_LR`; under "library" defaults a
    preconditioned pFLAlign's `PFLALIGN_LR`; else the paper's `SGD_LR`."""
    if cfg.optimizer.name == "adamw":
        return ADAMW_LR
    if cfg.defaults == "library" and preconditioned(cfg):
        return PFLALIGN_LR
    return SGD_LR


def resolve_defaults(cfg: RunConfig) -> None:
    """Fill the keys the config left unset, in place: lr (`default_lr`) and, under "library"
    defaults, a pFLAlign method's β (`PFLALIGN_BETA`, written into method_args so that config.json
    records it)."""
    if cfg.defaults not in DEFAULTS:
        raise UserError(f"defaults must be one of {', '.join(DEFAULTS)}, got {cfg.defaults!r}")
    check_method_name(cfg.method)
    if cfg.defaults == "library" and cfg.method in PFLALIGN_METHODS and "beta" not in cfg.method_args:
        cfg.method_args["beta"] = PFLALIGN_BETA
    if cfg.lr is None:
        cfg.lr = default_lr(cfg)


def _suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_method_name(name: str) -> None:
    """Refuse a method that is not in `METHOD_NAMES`, with the closest name."""
    if name not in METHOD_NAMES:
        raise UserError(f"unknown method {name!r}{_suggest(name, METHOD_NAMES)}; run `pflalign methods` for the list")


def _coerce(value, tp, key: str):
    """Check/convert one value against a dataclass field type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for a in inner:
            try:
                return _coerce(value, a, key)
            except UserError:
                continue
        raise UserError(f"config key {key}: {value!r} is not a valid {tp}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"config key {key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"config key {key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise UserError(f"config key {key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise UserError(f"config key {key}: expected a string, got {value!r}")
    if origin is list or tp is list:
        if isinstance(value, str):  # --set data.clients=a,b
            value = [v for v in value.split(",") if v]
        if isinstance(value, list):
            return [_coerce(v, args[0], key) if args else v for v in value]
        raise UserError(f"config key {key}: expected a list, got {value!r}")
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise UserError(f"config key {key}: expected a table, got {value!r}")
    return value


def _apply(obj, updates: dict, prefix: str = "") -> None:
    """Merge a nested dict into a (nested) dataclass, checking every key and type."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in updates.items():
        full = f"{prefix}{key}"
        if key not in names:
            valid = ", ".join(f.name for f in dataclasses.fields(obj))
            raise UserError(f"unknown config key {full!r}{_suggest(key, names)}; valid keys: {valid}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UserError(f"config key {full}: expected a table of {', '.join(f.name for f in dataclasses.fields(current))}")
            _apply(current, value, prefix=f"{full}.")
        elif key == "method_args" and isinstance(value, dict):
            current.update(value)
        else:
            setattr(obj, key, _coerce(value, hints[key], full))


def parse_value(text: str):
    """`--set` values: JSON when it parses (numbers, true/false, null, lists), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_set(items: list[str]) -> dict:
    """['lora.r=8', 'method=fedavg'] → {'lora': {'r': 8}, 'method': 'fedavg'}."""
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects key=value, got {item!r}")
        node = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = parse_value(text.strip())
    return out


def load_config_source(source: str | None) -> dict:
    """A preset name or a TOML/JSON file → nested dict of overrides."""
    if source is None:
        return {}
    if source in PRESETS and not Path(source).exists():
        return json.loads(json.dumps(PRESETS[source]))  # deep copy
    path = Path(source)
    if not path.is_file():
        raise UserError(f"config {source!r} is neither a file nor a preset{_suggest(source, PRESETS)}; presets: {', '.join(PRESETS)}")
    try:
        text = path.read_text()
        loaded = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot parse config: {exc}") from exc
    except OSError as exc:
        raise UserError(f"{path}: cannot read config: {exc.strerror or exc}") from exc
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: a config must be a table of keys, got a JSON {type(loaded).__name__}")
    return loaded


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
        (cfg.eval.batch_size > 0, f"eval.batch_size must be > 0, got {cfg.eval.batch_size}"),
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


def to_dict(cfg: RunConfig) -> dict:
    """The config as written to config.json. The `optimizer` section and `data.client_names`
    (issue 42) only when they differ from their defaults: a default run's config.json (and so
    the pinned results' hash of it) stays what it was before they existed; reading it back
    gives the defaults."""
    out = dataclasses.asdict(cfg)
    del out["defaults"]  # what they filled in is written (lr, method_args)
    if cfg.optimizer == OptimizerConfig():
        del out["optimizer"]
    if cfg.data.client_names == "numbered":
        del out["data"]["client_names"]
    return out


def merge(into: dict, updates: dict) -> dict:
    """Nested dict merge (later wins: a table merges key by key, any other value replaces),
    leaving both inputs unchanged: the layers of a sweep's run config, a rescore's ``--set``."""
    out = json.loads(json.dumps(into))
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = json.loads(json.dumps(value))
    return out


def flat(d: dict, empty_tables: bool = True, prefix: str = "") -> dict:
    """{"a": {"b": 1}, "c": {}} → {"a.b": 1, "c": {}}: one dotted key per value, to compare two
    configs key by key. `empty_tables` False drops an empty table (it has no keys to differ in:
    a rescore's ``method_args: {}`` → ``{personalized: ...}`` is one changed key, not two)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and (v or not empty_tables):
            out.update(flat(v, empty_tables, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
