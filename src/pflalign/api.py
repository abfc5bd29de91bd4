"""The Python API: build a config, run it, load a finished run. See docs/api.md.

Only the names in ``__all__`` are the API; everything else in pflalign may change.

    from pflalign import api

    cfg = api.config("demo", {"method": "fedavg", "lora.r": 8})
    api.run(cfg, "runs/demo")
    done = api.load_run("runs/demo")
    done.results["avg_rouge_l_personalized"], done.adapters["global"]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["config", "run", "load_run", "Run"]


def config(preset: str | None = None, overrides: dict | None = None):
    """A run config (`pflalign.config.RunConfig`): the defaults, then `preset` (a preset name such
    as ``"demo"`` or a TOML/JSON file, as ``pflalign run --config``), then `overrides`, the keys
    of ``--set``: dotted (``{"lora.r": 8}``) or nested (``{"lora": {"r": 8}}``), Python values.
    Unknown keys and bad values raise `pflalign.errors.UserError`."""
    from .config import build_config

    nested: dict = {}
    for key, value in (overrides or {}).items():
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf].update(value)
        else:
            node[leaf] = value
    return build_config(preset, nested, defaults="library")


def run(cfg, out: str | Path, resume: bool = False, overwrite: bool = False, progress: bool = True,
        workers: int = 1, allow_recipe_change: bool = False, batch: str = "auto",
        checkpoint_every: float | None = None) -> dict:
    """Run `cfg` into the folder `out` (as ``pflalign run``; `resume` continues an unfinished run
    there with its saved config) and return its results (results.json's dict). `workers` > 1: a
    round's clients train in that many one-thread processes (``--workers``); `batch` "clients":
    a round's clients train in lockstep, one pass for all (``--batch clients``); "auto" (the
    default): "clients" on CUDA, "none" (one at a time) elsewhere. `progress`: progress
    bars on stderr, as ``pflalign run`` shows them (minutes of silence look like a hang); False
    silences them, transformers' own bars too for the call (``--no-progress``).
    `allow_recipe_change`: resume though the saved config's training settings are not those its
    checkpoint was trained with (``--allow-recipe-change``). `checkpoint_every`: seconds between
    checkpoints (``--checkpoint-every``; default every round on the CPU, every 60 s on CUDA)."""
    from transformers.utils import logging as hf_logging

    from .run.engine import run as run_engine

    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        return run_engine(cfg, Path(out), resume=resume, overwrite=overwrite, progress=progress, workers=workers,
                          allow_recipe_change=allow_recipe_change, batch=batch, checkpoint_every=checkpoint_every)
    finally:
        if bars and not progress:
            hf_logging.enable_progress_bar()


@dataclass
class Run:
    """A finished run, as `load_run` reads it."""

    path: Path
    config: object  # pflalign.config.RunConfig
    results: dict  # results.json: per client ROUGE-L and exact match, their averages, timings
    rounds: list[dict]  # per round (metrics.jsonl "round" lines): mean_loss, consistency_*, seconds
    metrics: list[dict]  # every line of metrics.jsonl (train_step, client_round with GSNR, round_eval, ...)
    adapters: dict[str, Path] = field(default_factory=dict)  # "global" and client name → PEFT adapter folder

    @property
    def clients(self) -> list[str]:
        return [c["task"] for c in self.results["clients"]]

    def predictions(self) -> list[dict]:
        """predictions.jsonl (or a committed run's predictions.jsonl.gz): one dict per test example
        (prompt, reference, personalized, global, base)."""
        from . import checkpoint as ckpt

        text = ckpt.read_stored_text(self.path / ckpt.PREDICTIONS)
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def model(self, client: str | None = None):
        """(transformers model, tokenizer): the base model with `client`'s personalized adapter
        (None: the global one) merged in."""
        from .commands import load_generator

        model, tokenizer, _ = load_generator(self.path, client)
        return model, tokenizer

    def generate(self, prompt: str, client: str | None = None, max_new_tokens: int = 128) -> str:
        """The greedy answer of `client`'s model (None: global) to `prompt`, in the training format."""
        from .commands import generate_stream

        model, tokenizer = self.model(client)
        return generate_stream(model, tokenizer, self.config, prompt, max_new_tokens)


def load_run(path: str | Path) -> Run:
    """A finished run folder (results.json written) as a `Run`."""
    from . import checkpoint as ckpt
    from .commands import run_adapter_folders
    from .config import build_config
    from .errors import UserError

    path = Path(path)
    if not (path / ckpt.RESULTS).exists():
        raise UserError(f"{path} holds no finished run (no {ckpt.RESULTS})")
    cfg = build_config(None, json.loads((path / ckpt.CONFIG).read_text()))
    metrics = list(ckpt.metrics_rows(path / ckpt.METRICS))
    rounds = [m for m in metrics if m.get("event") == "round"]
    return Run(path, cfg, json.loads((path / ckpt.RESULTS).read_text()), rounds, metrics,
               run_adapter_folders(path))
