"""Runs in lockstep (`pflalign sweep --batch runs`): several runs on one shared base model, their
rounds trained together.

Why: the runs of a sweep (seeds, methods, learning rates) all train the same frozen base, each
client with its own adapter; on a GPU one pass of the base for every client of every run keeps
the device busy where one client's pass leaves most of it idle (issue 55). So round r of every
run goes through `jobs.run_rounds_lockstep`: local step t of all their clients in shared passes
(`lockstep.shared_pass`, as many as fit the device's memory), each client's step then taken by its
own run's method. Everything else is each run's own, exactly as `engine.run` has it: its
`Federation` (method, server, clients' files, seeded w^0), its run folder (`Recorder`: config,
metrics lines, checkpoints (`engine.checkpoint_interval`), `--resume`), its adapters and results.json (which
records ``batch: "runs"``). Runs at different rounds (one resumed, one new) train side by side,
each its own next round. The runs that finish in the same step of the lockstep (runs of equal
rounds: all of them at once) are scored together: every personalized and global model of all of
them (each run's global adapter, its scored clients' personalized ones) in one decoding loop
(`batched_scoring.score_runs_together`; runs of other eval settings, `eval_key`, in a loop of
their own; a loop holds at most `batched_scoring.LOOP_BYTES` of adapters, beyond it several
loops), then each run writes its own adapters and results.json, as alone; the others train on.
A round's scoring (``eval.every``) goes the same way: the runs whose round calls for it are scored
in one loop (their first ``eval.every_max_test`` prompts), then each writes its round_eval lines
and its checkpoint.

A run whose training reaches a non-finite value stops alone, as in a sweep one after another:
its round's lines are dropped, its last checkpoint kept, and the others go on
(`lockstep(isolate=True)`). Running out of memory or an interrupt stops them all, each at its
last checkpoint. The runs' results equal those of the one-at-a-time sweep up to float rounding
(the rows of a shared pass are summed in another order; tests/test_together.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import run_dir
from .batched_scoring import eval_key, score_runs_together
from .engine import Federation, finish_run, open_run
from .jobs import run_rounds_lockstep
from .lifecycle import diverged, interrupted
from .lockstep import PassSize
from ..config import RunConfig
from ..errors import OutOfMemory, RunInterrupted, TrainingDiverged
from ..methods.base import Params
from ..model import FederatedLM, build_model, resolve_device

log = logging.getLogger(__name__)


def base_key(cfg: RunConfig) -> tuple:
    """What runs must share to train in lockstep: the base model, its dtype and device, and the
    adapter's shape (LoRA settings). Seeds, methods, learning rates and data may differ."""
    return (cfg.model, cfg.dtype, resolve_device(cfg.device), repr(dataclasses.asdict(cfg.lora)))


class SharedModel:
    """The one model of runs in lockstep, built for the first run's config, and each run's w^0:
    the seeded LoRA initialisation its own model would have (`seeded_adapter`)."""

    def __init__(self):
        self.lm: FederatedLM | None = None
        self.key: tuple | None = None
        self.initial: dict[int, Params] = {}

    def __call__(self, cfg: RunConfig) -> tuple[FederatedLM, Params]:
        if self.lm is None:
            self.lm, self.key = build_model(cfg, in_memory=True), base_key(cfg)
            self.initial[cfg.seed] = self.lm.get_lora()
        if base_key(cfg) != self.key:
            raise ValueError(f"runs in lockstep share one base: {base_key(cfg)} is not {self.key}")
        if cfg.seed not in self.initial:
            self.initial[cfg.seed] = seeded_adapter(cfg, self.lm.device)
        return self.lm, self.initial[cfg.seed]


def seeded_adapter(cfg: RunConfig, device) -> Params:
    """The w^0 that `build_model(cfg)` gives (the LoRA initialisation seeded by ``cfg.seed``, made
    on the CPU as every model's is), from a model built for it and dropped at once."""
    lm = build_model(cfg, device="cpu")
    return {n: p.to(device) for n, p in lm.get_lora().items()}


@dataclasses.dataclass
class _Run:
    """One run of the lockstep: its folder, its federation, its next round, its loss watch."""

    rec: object  # lifecycle.Recorder
    fed: Federation
    next_round: int
    watch: object = None  # lifecycle.LossWatch
    seconds: float = 0.0  # its rounds' share of the lockstep's time

    @property
    def done(self) -> bool:
        return self.next_round >= self.fed.cfg.rounds


def run_together(runs: list[tuple[RunConfig, Path, bool]], progress: bool = True,
                 checkpoint_every: float | None = None) -> list[dict | TrainingDiverged]:
    """Train the runs (config, run folder, resume) in lockstep on one shared model; each run's
    folder is guarded (`run_dir.guard`: a fresh run replaces what is there, as the sweep does).
    Returns, per run in order, its results, or the `TrainingDiverged` that stopped it alone."""
    with contextlib.ExitStack() as stack:
        for _, out, resume in runs:
            stack.enter_context(run_dir.guard(Path(out), resume, not resume))
        shared, size, opened = SharedModel(), PassSize(), []
        try:
            for cfg, out, resume in runs:
                rec, fed, start = open_run(None if resume else cfg, out, resume, not resume, False, False, 1, "runs",
                                           shared, checkpoint_every)
                fed.side.pass_size = size  # one device, one size for every run's passes
                opened.append(_Run(rec, fed, start))
            return _train(opened, progress)
        finally:
            for r in opened:
                r.fed.close()
                r.rec.close()


def _train(runs: list[_Run], progress: bool) -> list[dict | TrainingDiverged]:
    outcome: list[dict | TrainingDiverged | None] = [None] * len(runs)
    for r in runs:
        r.watch = r.fed.attach(r.rec)
    bar = tqdm(total=sum(r.fed.cfg.rounds - r.next_round for r in runs), desc=f"rounds of {len(runs)} runs",
               disable=not progress, unit="round")
    active = list(range(len(runs)))  # the runs not yet finished or stopped
    try:
        # the runs whose rounds were all done before (stopped in their final evaluation)
        _finish(runs, [i for i in active if runs[i].done], active, outcome)
        while active:
            started, ended = [], []
            for i in active:
                started.append(runs[i].fed.start_round(runs[i].next_round))
            tic = time.perf_counter()
            trained = run_rounds_lockstep([(runs[i].fed.side, s.jobs, s.shared) for i, s in zip(active, started)],
                                          isolate=True)
            seconds = time.perf_counter() - tic
            records = {}  # the runs whose round went through: its record
            for i, s, done in zip(list(active), started, trained):
                try:
                    if isinstance(done, TrainingDiverged):
                        s.bar.close()
                        raise done
                    records[i] = runs[i].fed.finish_round(s, done)
                except TrainingDiverged as exc:
                    _stop(runs, i, exc, active, outcome)
            evaluated = _round_evals(runs, list(records))
            for i, record in records.items():
                r = runs[i]
                try:
                    r.fed.keep_round(r.rec, r.watch, r.next_round, record, seconds, evaluated.get(i),
                                     last=r.next_round + 1 >= r.fed.cfg.rounds)
                except TrainingDiverged as exc:
                    _stop(runs, i, exc, active, outcome)
                    continue
                r.next_round, r.seconds = r.next_round + 1, r.seconds + seconds
                bar.update(1)
                if not progress:
                    log.info("%s: round %d/%d: mean loss %.4f (%.1f s, %d runs)", r.rec.out, r.next_round,
                             r.fed.cfg.rounds, record.mean_loss, seconds, len(started))
                if r.done:
                    ended.append(i)
            _finish(runs, ended, active, outcome)
    except KeyboardInterrupt:
        # each active run stops in its next round (the one being trained, or the next between its
        # rounds); one whose rounds are all done, in its final evaluation (`interrupted`)
        said = [str(interrupted(runs[i].rec, runs[i].fed.cfg, runs[i].next_round)) for i in active]
        raise RunInterrupted("; ".join(said) or "interrupted") from None
    except OutOfMemory as exc:
        for i in active:
            runs[i].rec.rollback()  # each run's folder as after its last checkpoint
        raise OutOfMemory(f"{exc}; every run's last checkpoint is kept: continue with fewer runs per group, or "
                          "without --batch runs") from None
    finally:
        bar.close()
    return outcome


def _stop(runs: list[_Run], i: int, exc: TrainingDiverged, active: list[int], outcome: list) -> None:
    """Run i reached a non-finite value: it stops alone (its folder as after its last checkpoint,
    `lifecycle.diverged`); the others go on."""
    outcome[i] = diverged(runs[i].rec, exc)
    runs[i].fed.store.discard()  # its records held in memory: the others' now
    log.warning("%s: stopped: %s", runs[i].rec.out, outcome[i])
    active.remove(i)


def _scored_together(runs: list[_Run], members: list[int], jobs_of):
    """The `ScoreDone`s of each of `members`' jobs (`jobs_of(i)`), all their models in one decoding
    loop per group of runs of equal eval settings (`batched_scoring.eval_key`): (run, its done
    jobs), group after group, each group scored when reached."""
    groups: dict[tuple, list[int]] = {}
    for i in members:
        groups.setdefault(eval_key(runs[i].fed.cfg), []).append(i)
    for group in groups.values():
        feds = [runs[i].fed for i in group]
        yield from zip(group, score_runs_together([(fed.side, jobs_of(i), {"global": fed.global_params})
                                                   for i, fed in zip(group, feds)], feds[0].progress))


def _round_evals(runs: list[_Run], trained: list[int]) -> dict[int, list[dict]]:
    """The per-round scoring (``eval.every``) of the runs `trained` whose round calls for it, all
    their personalized and global models scored together (`_scored_together`), as `_finish` does
    for the final scoring: {run: its round_eval rows}."""
    due = [i for i in trained if runs[i].fed.round_eval_due(runs[i].next_round)]
    with torch.random.fork_rng(devices=[]):  # as `Federation.round_eval`: the training's RNG untouched
        scored = dict(_scored_together(runs, due, lambda i: runs[i].fed.round_eval_jobs(runs[i].next_round)))
    return {i: runs[i].fed.round_eval(runs[i].next_round, done_jobs) for i, done_jobs in scored.items()}


def _finish(runs: list[_Run], ended: list[int], active: list[int], outcome: list) -> None:
    """The runs `ended` (their rounds done in the same step of the lockstep) scored together
    (`_scored_together`); then each run's adapters and results.json written (`finish_run`), and
    the run no longer active."""
    for i, done_jobs in _scored_together(runs, ended, lambda i: runs[i].fed.score_jobs(runs[i].fed.final_models)[0]):
        outcome[i] = finish_run(runs[i].rec, runs[i].fed, runs[i].seconds, done_jobs)
        active.remove(i)
