"""Defaults that train (issue 56): what a key the config leaves unset becomes (`resolve_defaults`).
"""

from __future__ import annotations

from ..errors import UserError
from .checks import check_method_name
from .run_config import METHOD_NAMES, RunConfig

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


# Seconds between a run's checkpoints by device type (`engine.checkpoint_interval`; --checkpoint-every):
# every round on the CPU (a round takes minutes), every 60 s on CUDA (a SmolLM2 round trains in 1.1-1.7 s
# there, and writing, hashing and reading back a pFLAlign client's record took 0.59 s per client on the
# CPU: benchmarks/client_files.py). A crash loses at most the rounds since; results are the same either way.
CHECKPOINT_EVERY = {"cpu": 0.0, "cuda": 60.0}
# Between checkpoints the clients' records stay in memory (where they trained) up to this many bytes a
# process (runs in lockstep share it); beyond it they go to their files at once (run/client_store.py):
# 26 pFLAlign SmolLM2 clients, 11 at LLaMA-3.2-1B
CLIENT_MEMORY_BYTES = 2 * 2**30

EVAL_ROWS_CPU = 64  # eval.batch_size on device=cpu, and what auto decodes with off CUDA (evaluate.AUTO_ROWS)


def resolve_defaults(cfg: RunConfig) -> None:
    """Fill the keys the config left unset, in place: lr (`default_lr`), eval.batch_size (64 on
    device=cpu, else auto: `evaluate.decode_plan`) and, under "library" defaults, a pFLAlign
    method's β (`PFLALIGN_BETA`, written into method_args so that config.json records it)."""
    if cfg.defaults not in DEFAULTS:
        raise UserError(f"defaults must be one of {', '.join(DEFAULTS)}, got {cfg.defaults!r}")
    check_method_name(cfg.method)
    if cfg.defaults == "library" and cfg.method in PFLALIGN_METHODS and "beta" not in cfg.method_args:
        cfg.method_args["beta"] = PFLALIGN_BETA
    if cfg.lr is None:
        cfg.lr = default_lr(cfg)
    if cfg.eval.batch_size is None:  # a number on the CPU, so that a CPU run's config.json is what it was
        cfg.eval.batch_size = EVAL_ROWS_CPU if cfg.device == "cpu" else "auto"
