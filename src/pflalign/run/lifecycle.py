"""One run's folder, shared by both engines: the in-process one (`pflalign.run.engine`)
and the Flower ServerApp (`pflalign.flower.server_app`).

A run folder holds ``config.json`` (the resolved config), ``metrics.jsonl``
(one JSON line per event), ``checkpoint.pt`` (after every round),
``predictions.jsonl`` (in-process runs) and, last, ``results.json``: its
presence means "finished". `prepare_run_dir` checks what a folder holds
before a run starts; a `Recorder` writes everything there: the config, the
metrics lines, the checkpoints and ``results.json``. It drives nothing: each
engine owns its round loop and hands the Recorder what to write
(`pflalign.run.server.RoundRecord` for a round's lines). `LossWatch` warns when a
run diverges.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import checkpoint as ckpt
from ..config import RunConfig, load_saved_config, recipe, to_dict
from ..settings import ADAMW_LR
from ..errors import RunInterrupted, TrainingDiverged, UserError
from ..run_stats import (CLIENT_BLOWUP_RATIO, DIVERGED_LOSS_RATIO, client_starts, distribution,  # noqa: F401  (their former home)
                         early_level, judgeable_start, start_loss)

if TYPE_CHECKING:  # types only: the run's folder needs no client or server code (tests/test_layers.py)
    from .server import RoundRecord

log = logging.getLogger(__name__)


# ---- the run folder -------------------------------------------------------------
def prepare_run_dir(out: Path, resume: bool, overwrite: bool) -> bool:
    """Check what is in `out`; returns True when a checkpoint should be resumed."""
    finished = (out / ckpt.RESULTS).exists()
    started = ckpt.has_run_checkpoint(out)
    if overwrite:
        for name in (ckpt.RESULTS, ckpt.METRICS, ckpt.PREDICTIONS, ckpt.CONFIG, ckpt.SCORING):
            (out / name).unlink(missing_ok=True)
        ckpt.remove_run_checkpoints(out)
        return False
    if finished:
        raise UserError(f"{out} holds a finished run; pass --overwrite to replace it")
    if resume:
        if not started:
            raise UserError(f"{out} has no checkpoint to resume; run without --resume")
        return True
    if started:
        raise UserError(f"{out} holds an unfinished run; pass --resume to continue it or --overwrite to restart")
    return False


def saved_config(out: Path) -> RunConfig:
    """The config a run folder was started with (missing or damaged: one line, issue 20)."""
    return load_saved_config(out / ckpt.CONFIG)


def recipe_changes(trained: dict | None, cfg: RunConfig) -> dict[str, list]:
    """{key: [value the checkpoint's rounds were trained with, value in `cfg`]} for each key of
    the training recipe (`config.recipe`) that differs; {} for a checkpoint from before the
    recipe was saved in it (`trained` None: nothing to compare). A key one side lacks (a setting
    added since) is not compared."""
    if trained is None:
        return {}
    now = recipe(cfg)
    return {k: [trained[k], now[k]] for k in sorted(trained.keys() & now.keys()) if trained[k] != now[k]}


# ---- round bookkeeping shared by the engines ------------------------------------
def sample_clients(num_clients: int, fraction: float, seed: int, round_index: int) -> list[int]:
    """Participants of a round: all by default, else a seeded sample (a pure function of seed and round)."""
    if fraction >= 1.0:
        return list(range(num_clients))
    count = max(1, round(fraction * num_clients))
    rng = np.random.default_rng([seed, round_index])
    return sorted(rng.choice(num_clients, size=count, replace=False).tolist())


def eval_clients(num_clients: int, count: int | None, seed: int) -> list[int]:
    """The clients scored at the end (and by ``eval.every``): all by default, else a seeded sample of
    `count`, the same for every method and round of a seed (its own stream, apart from the rounds')."""
    if count is None or count >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, 0x5C0BE])  # a key of its own: not the stream of any round's sample
    return sorted(rng.choice(num_clients, size=count, replace=False).tolist())


def results_summary(cfg: RunConfig, rows: list[dict], truncated: int, data_info: dict | None = None,
                    num_clients: int | None = None) -> dict:
    """`results.json` from the per-client rows (averages are plain means over the scored clients;
    ``distribution``: the spread over clients, see `distribution`); `num_clients`: the federation's
    size when only a sample was scored (``eval.clients``); `data`: what a partitioned or
    your-own-data federation loaded (columns, rows dropped and why), if any."""

    def mean(key):
        values = [r[key] for r in rows if r[key] is not None]
        return float(np.mean(values)) if values else None

    return {
        "method": cfg.method, "dataset": cfg.data.name, "seed": cfg.seed, "model": cfg.model,
        "rounds": cfg.rounds, "local_steps": cfg.local_steps, "clients": rows,
        "avg_rouge_l_personalized": mean("rouge_l_personalized"),
        "avg_rouge_l_global": mean("rouge_l_global"),
        "avg_rouge_l_base": mean("rouge_l_base"),
        "truncated_train_examples": truncated,
        "distribution": {kind: distribution(rows, f"rouge_l_{kind}") for kind in ("personalized", "global", "base")},
    } | ({"data": data_info} if data_info is not None else {}) \
      | ({"clients_in_federation": num_clients} if num_clients is not None and num_clients != len(rows) else {})


def client_row(k: int, name: str, n_train: int, n_test: int, personalized: float, global_: float,
               base: float | None) -> dict:
    """One client's entry of `results.json`'s ``clients`` (``task``: the client's name)."""
    return {"id": k, "task": name, "n_train": n_train, "n_test": n_test, "rouge_l_personalized": personalized,
            "rouge_l_global": global_, "rouge_l_base": base}


class Recorder:
    """Everything a run writes into its folder `out`: the config, the metrics lines, the
    checkpoints, the results.

    Built before the engine's objects (it tells whether the run resumes, and from
    which checkpoint and config); `open` then writes the config (fresh run) or
    cuts the metrics back to the checkpoint (resumed run).
    """

    def __init__(self, out: Path | str, resume: bool, overwrite: bool, allow_recipe_change: bool = False):
        self.out = Path(out)
        self.resuming = prepare_run_dir(self.out, resume, overwrite)
        self.checkpoint = ckpt.load_run_checkpoint(self.out) if self.resuming else None  # the one resumed from
        self.metrics: ckpt.MetricsLog | None = None
        self.saved = (0, 0)  # (rounds done, metrics offset) of the newest checkpoint on disk
        self.allow_recipe_change = allow_recipe_change
        self.recipe: dict | None = None  # the run's training recipe, saved in every checkpoint
        self.recipe_changes: dict[str, list] = {}  # key → [before, after]: allowed changes at this resume

    def config(self, cfg: RunConfig) -> RunConfig:
        """The run's config: `cfg` for a fresh run, the saved one when resuming, refused when its
        training recipe is not the one the checkpoint's rounds were trained with (config.json
        edited under the run) unless `allow_recipe_change`."""
        if not self.resuming:
            return cfg
        cfg = saved_config(self.out)
        trained = self.checkpoint.get("recipe")
        if trained is None:
            log.warning("%s predates recipes in checkpoints: config.json is not compared with what its rounds "
                        "were trained with", self.out / ckpt.CHECKPOINT)
        self.recipe_changes = recipe_changes(trained, cfg)
        if self.recipe_changes and not self.allow_recipe_change:
            listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in self.recipe_changes.items())
            raise UserError(f"{self.out / ckpt.CONFIG} is not the recipe the checkpoint's "
                            f"{self.checkpoint['rounds_done']} rounds were trained with ({listed}); put it back, "
                            "or continue with --allow-recipe-change (Flower: 'allow-recipe-change=true') to "
                            "train the rounds left so (metrics.jsonl records the change)")
        return cfg

    @property
    def start_round(self) -> int:
        return self.checkpoint["rounds_done"] if self.resuming else 0

    def open(self, cfg: RunConfig) -> None:
        self.recipe = recipe(cfg)
        if self.resuming:
            self.saved = (self.checkpoint["rounds_done"], self.checkpoint["metrics_offset"])
            self.metrics = ckpt.MetricsLog(self.out / ckpt.METRICS, resume_offset=self.saved[1])
            log.info("resuming %s after round %d of %d", self.out, self.saved[0], cfg.rounds)
            if self.recipe_changes:  # allowed: the rounds before `round` were trained with the old values
                log.warning("the rounds from %d on are trained with another recipe: %s", self.saved[0] + 1,
                            ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in self.recipe_changes.items()))
                self.metrics.write(event="recipe_change", round=self.saved[0], changed=self.recipe_changes)
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            ckpt.write_json(self.out / ckpt.CONFIG, to_dict(cfg))
            # resume_offset=0: drop lines of a run that never checkpointed
            self.metrics = ckpt.MetricsLog(self.out / ckpt.METRICS, resume_offset=0)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    # ---- metrics lines ------------------------------------------------------------
    def round(self, r: int, record: RoundRecord, seconds: float) -> None:
        """Round r's lines: per participant (client order) its ``train_step`` lines and its
        ``client_round`` line, then the round's line (`seconds`: the round's wall time)."""
        for k, res in zip(record.clients, record.results):
            for t, loss in enumerate(res.losses):
                self.metrics.write(event="train_step", round=r, client=k, step=t, loss=loss)
            # seconds: the client's round from its state file in to its next file out (in-process engine)
            extra = {} if res.seconds is None else {"seconds": res.seconds}
            self.metrics.write(event="client_round", round=r, client=k, gsnr_mean=res.gsnr_mean,
                               gsnr_ratio=res.gsnr_ratio, update_norm=res.update_norm, model_norm=res.model_norm,
                               **res.method_metrics, **extra)
        self.metrics.write(
            event="round", round=r, seconds=seconds, clients=record.clients, mean_loss=record.mean_loss,
            # aggregation consistency: data-weighted size of the client updates, and of the
            # client models as printed in the paper's formula (see docs/usage.md)
            consistency_update_norm=sum(w * res.update_norm for w, res in zip(record.weights, record.results)),
            consistency_model_norm=sum(w * res.model_norm for w, res in zip(record.weights, record.results)),
            **record.extra,
        )

    def round_eval(self, r: int, rows: list[dict]) -> None:
        """The per-round scores (``eval.every``): one ``round_eval`` line per scored client, each
        with its ``client``, ``task``, ``n_test``, ``rouge_l_personalized``, ``rouge_l_global``."""
        for row in rows:
            self.metrics.write(event="round_eval", round=r, **row)

    # ---- checkpoints --------------------------------------------------------------
    def save(self, rounds_done: int, payload: dict) -> None:
        """Commit the metrics and write the checkpoint after `rounds_done` rounds (a Ctrl-C waits
        until the checkpoint and `saved` agree)."""
        with ckpt.sigint_deferred():
            offset = self.metrics.commit()
            ckpt.save_run_checkpoint(self.out, {"rounds_done": rounds_done, **payload, "recipe": self.recipe,
                                                "metrics_offset": offset})
            self.saved = (rounds_done, offset)

    def rollback(self) -> None:
        """Drop the metrics lines after the newest checkpoint (of a round that will not finish)."""
        self.metrics.rollback(self.saved[1])

    # ---- the end ----------------------------------------------------------------------
    def finish(self, results: dict, train_seconds: float, eval_seconds: float,
               predictions: list[dict] | None = None, **extra) -> dict:
        """The final line, ``predictions.jsonl`` (when given) and, last, ``results.json`` (with
        the session's timings and `extra`)."""
        results["seconds_train_this_session"] = train_seconds
        results["seconds_eval"] = eval_seconds
        results.update(extra)
        self.metrics.write(event="eval", **{k: v for k, v in results.items() if k.startswith("avg_")})
        self.metrics.commit()
        self.close()
        if predictions is not None:
            ckpt.write_jsonl(self.out / ckpt.PREDICTIONS, predictions)
        ckpt.write_json(self.out / ckpt.RESULTS, results)  # last: its presence means "finished"
        return results


# AdamW at an lr this many times the field's LoRA lr (settings.ADAMW_LR) gets one line as the run starts
ADAMW_LR_WARN = 50


def warn_at_start(cfg: RunConfig, method) -> None:
    """One line each, as a fresh run starts, for settings that will not train as a user expects
    (issue 56): the method's own (`Method.start_warning`: pFLAlign with a β that caps its step),
    and AdamW at an SGD-sized lr (at 0.04 a 3-round run's loss went 1.2 → 20.8, ROUGE-L to 0)."""
    note = method.start_warning(cfg.lr, cfg.local_steps)
    if note:
        log.warning(note)
    if cfg.optimizer.name == "adamw" and cfg.lr >= ADAMW_LR_WARN * ADAMW_LR:
        log.warning("optimizer.name=adamw at lr %g: AdamW moves every weight by about lr per step, whatever its "
                    "gradient, and LoRA recipes run it at %g (its default when lr is unset); at lr 0.04 a run's "
                    "loss went 1.2 -> 20.8", cfg.lr, ADAMW_LR)


class LossWatch:
    """Warns, once a session, when a round's mean training loss passes DIVERGED_LOSS_RATIO × the
    loss the run started from (`start_loss`): a 50-round run can break late (FedDyn in round 44)
    or in its first round (FedSAM), and its log is where one looks. Warns too, once a session, when
    one client's mean step loss in a round passes CLIENT_BLOWUP_RATIO × its own early level
    (`run_stats.early_level`, the median step loss of its first round; `client_blowups`): the run's
    mean hides one client among many (Local at lr 0.16 on FLAN: a client at 159 × its start, the
    run's mean at 1.4 ×). A client is named by its name (`names`, by client id). Each engine's loop
    calls it after every round."""

    def __init__(self, rec: Recorder, names: list[str] | None = None):
        # resumed: the start read back from round 1's lines (lazily: a large file), the clients'
        # early levels from all of them (a client may first train in any round)
        self.start_loss = start_loss(ckpt.metrics_rows(rec.out / ckpt.METRICS)) if rec.resuming else None
        self.client_start = client_starts(ckpt.metrics_rows(rec.out / ckpt.METRICS)) if rec.resuming else {}
        self.names = names or []
        self.warned = False
        self.client_warned = False

    def round(self, r: int, record: RoundRecord) -> None:
        mean_loss = record.mean_loss
        if r == 0:
            firsts = [res.losses[0] for res in record.results if res.losses]
            self.start_loss = sum(firsts) / len(firsts) if firsts else mean_loss
        if self.start_loss is not None and not self.warned and mean_loss > DIVERGED_LOSS_RATIO * self.start_loss:
            self.warned = True
            log.warning("round %d: mean training loss %.3g is %.1f × the loss the run started from (%.3g): "
                        "the run is diverging (a smaller lr or server step may hold it; pflalign report marks "
                        "a run that ends so)", r + 1, mean_loss, mean_loss / self.start_loss, self.start_loss)
        for k, res in zip(record.clients, record.results):
            if not res.losses:
                continue
            start = self.client_start.setdefault(k, early_level(res.losses))
            loss = float(np.mean(res.losses))
            if not self.client_warned and judgeable_start(start) and not loss <= CLIENT_BLOWUP_RATIO * start:
                self.client_warned = True
                name = self.names[k] if k < len(self.names) else f"client {k}"
                log.warning("round %d: %s's mean step loss %.3g is %.1f × its early level (%.3g, the median step "
                            "loss of its first round): its training is blowing up, which the run's mean can hide "
                            "(pflalign report lists the clients that did)", r + 1, name, loss, loss / start, start)


def interrupted(rec: Recorder, cfg: RunConfig, in_round: int | None) -> RunInterrupted:
    """Ctrl-C (`in_round`: the round being trained or about to be; None, or `cfg.rounds`, after
    the rounds; a round already saved: the next is named): drop the unfinished
    round's metrics lines, so the directory is exactly as after the last checkpoint, and say how
    to continue."""
    rounds = rec.saved[0]
    rec.rollback()
    if in_round is not None:  # its checkpoint already written: stopped before the next round began
        in_round = max(in_round, rounds)
    where = (f"during round {in_round + 1} of {cfg.rounds}" if in_round is not None and in_round < cfg.rounds
             else "during the final evaluation")
    if rounds == 0:
        return RunInterrupted(f"interrupted {where}, before any round was saved; nothing to resume: "
                              "run the same command again")
    finished = min(in_round, cfg.rounds) if in_round is not None else cfg.rounds
    saved = (f"the last finished round ({rounds}) is saved" if finished <= rounds else
             f"round {rounds} is the last saved (rounds {rounds + 1}-{finished} finished since its checkpoint, "
             "--checkpoint-every, and are trained again)")
    jobs = ckpt.kept_jobs(rec.out) if finished >= cfg.rounds else 0
    if jobs:  # the final scoring's finished jobs (checkpoint/scoring.py)
        saved += f", as are the final scoring's {jobs} finished job{'s' * (jobs != 1)} (the rest are scored on resume)"
    return RunInterrupted(f"interrupted {where}; {saved}; resume with: "
                          f"pflalign run --out {shlex.quote(str(rec.out))} --resume")


def diverged(rec: Recorder, exc: TrainingDiverged) -> TrainingDiverged:
    """A run stopped on a non-finite value: the diverged round's lines dropped, and the error saying
    which checkpoint is kept."""
    rec.rollback()  # the diverged round leaves no lines
    kept = f"; the checkpoint after round {rec.saved[0]} is kept" if rec.saved[0] else ""
    return TrainingDiverged(f"{exc}{kept}")
