"""A client's jobs: one round's training (`TrainJob`), one model's scoring (`ScoreJob`), and the
functions that run them on a `ClientSide` (a process's model, method, config and client files).

Both runners of `pflalign.run.workers` call `run_job`: in the engine's own process (`Inline`) or
in a worker process (`Processes`); a job is a pure function of what it is given, so where it runs
does not change its result. `run_train_jobs_lockstep` runs a round's jobs together (--batch clients).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import allocator
from .client import ClientRound, client_lr, local_round, score_client
from .client_store import ClientRecord, ClientStore
from .lockstep import PassSize, finish, lockstep, member
from ..data import Example
from ..errors import OutOfMemory, TrainingDiverged
from ..methods.base import Method, Params


# ---- the jobs -------------------------------------------------------------------
@dataclass
class TrainJob:
    """Client k's round `round`: its minibatches, and its record (which file holds its state)."""

    k: int
    round: int
    record: ClientRecord
    batches: list[dict]


@dataclass
class TrainDone:
    k: int
    result: ClientRound  # its personalized adapter is in the client's new file, not here
    record: ClientRecord  # that file
    seconds: float


@dataclass
class ScoreJob:
    """Client k's `test` examples with one of its models: "personalized" (after aggregation, as
    its method defines it; w^r before its first round), "global" or "base" (adapter off)."""

    k: int
    model: str
    record: ClientRecord
    test: list[Example]
    desc: str


@dataclass
class ScoreDone:
    k: int
    score: float
    predictions: list[str]
    seconds: float


@dataclass
class StartedRound:
    """A round between `Federation.start_round` and `finish_round`: its clients, the server's
    round, the clients' jobs, their step counts after it, their tokens (which job first), what
    the jobs share, and the round's progress bar."""

    chosen: list[int]
    plan: object  # server.RoundPlan
    jobs: list[TrainJob]
    steps_after: list[int]
    costs: list[float]
    shared: dict
    bar: object

    def on_step(self, i: int, t: int, loss: float) -> None:
        self.bar.update(1)


@dataclass
class ClientSide:
    """What a process needs to run jobs: its model, the method, the config, the clients' files,
    and w^0 (a client's first state starts from it)."""

    lm: object  # model.FederatedLM
    method: Method
    cfg: object  # config.RunConfig
    store: ClientStore
    initial_params: Params
    pass_size: PassSize = field(default_factory=PassSize)  # --batch clients: how many share a pass (kept)


def personalized_adapter(side: ClientSide, k: int, record: ClientRecord, global_params: Params) -> Params:
    """Client k's personalized adapter as evaluated (`Method.personalized_after_aggregation`), from
    the file `record` names; w^r when it has not trained yet."""
    if record.file is None:
        return global_params
    side.store.records[k] = record
    state, personalized = side.store.load(k, side.lm.device, side.initial_params)
    return side.method.personalized_after_aggregation(global_params, personalized, state)


def run_train_job(side: ClientSide, job: TrainJob, shared: dict,
                  on_step: Callable[[int, float], None] | None = None) -> TrainDone:
    """Client k's round: its state from its file (w^0's fresh state before its first round), T
    local steps, its new state and personalized adapter into its next file."""
    tic = time.perf_counter()
    side.store.records[job.k] = job.record
    loaded = side.store.load(job.k, side.lm.device, side.initial_params)
    state, _ = loaded if loaded is not None else (side.method.init_client_state(side.initial_params), None)
    try:
        result = local_round(side.lm, side.method, state, shared["global"], shared["received"], job.batches,
                             client_lr(side.cfg, job.round), job.round, on_step, side.cfg.optimizer)
    except TrainingDiverged as exc:
        raise TrainingDiverged(f"client {job.k} ({job.record.name}): {exc}") from None
    # its new state, under a name no checkpoint knows yet (a crash before the round's
    # checkpoint leaves the previous file in force)
    side.store.save(job.k, job.round + 1, state, result.personalized)
    result.personalized = None  # in its file now
    allocator.release_free_memory()  # the client's activations: not kept past it
    return TrainDone(job.k, result, side.store.records[job.k], time.perf_counter() - tic)


def run_train_jobs_lockstep(side: ClientSide, jobs: list[TrainJob], shared: dict,
                            on_step: Callable[[int, int, float], None] | None = None) -> list[TrainDone]:
    """The clients of `jobs` (one round's) trained in lockstep (`lockstep.lockstep`): each one's
    state from its file, its new state and personalized adapter into its next file, as
    `run_train_job` does for one. Each client's seconds: the lockstep's share, total / clients."""
    (done,) = run_rounds_lockstep([(side, jobs, shared)], on_step)
    if isinstance(done, TrainingDiverged):
        raise done
    return done


def run_rounds_lockstep(rounds: list[tuple[ClientSide, list[TrainJob], dict]],
                        on_step: Callable[[int, int, float], None] | None = None,
                        isolate: bool = False) -> list[list[TrainDone] | TrainingDiverged]:
    """A round of each of several runs (`--batch runs`; one run: `--batch clients`) trained in
    lockstep: `rounds[g]` is run g's side (its method, config and clients' files, on the one
    shared model), its round's jobs and what the round shares (w^r, the broadcast). Returns, per
    run, its jobs' `TrainDone`s, or with `isolate` the `TrainingDiverged` that stopped it (the
    other runs' clients went on without it); without `isolate` a divergence is raised."""
    tic = time.perf_counter()
    lm = rounds[0][0].lm
    members = []
    for g, (side, jobs, shared) in enumerate(rounds):
        for job in jobs:
            side.store.records[job.k] = job.record
            loaded = side.store.load(job.k, lm.device, side.initial_params)
            state = loaded[0] if loaded is not None else side.method.init_client_state(side.initial_params)
            members.append(member(side.method, state, shared["global"], shared["received"], job.batches,
                                  client_lr(side.cfg, job.round), job.round, f"{job.k} ({job.record.name})",
                                  side.cfg.optimizer, lm.lora, g))
    side = rounds[0][0]
    try:
        failed = lockstep(lm, members, on_step, side.pass_size, isolate)
    except (torch.OutOfMemoryError, MemoryError):
        raise OutOfMemory(f"out of memory training {len(members)} clients in lockstep (--batch) with "
                          f"batch_size={side.cfg.batch_size}, max_seq_len={side.cfg.max_seq_len}, model "
                          f"{side.cfg.model}: run without --batch, or lower batch_size or max_seq_len") from None
    seconds = (time.perf_counter() - tic) / len(members)
    out: list[list[TrainDone] | TrainingDiverged] = []
    i = 0
    for g, (side, jobs, _) in enumerate(rounds):
        mine, i = members[i:i + len(jobs)], i + len(jobs)
        if g in failed:
            out.append(failed[g])
            continue
        try:
            results = [finish(m) for m in mine]
        except TrainingDiverged as exc:
            if not isolate:
                raise
            out.append(exc)
            continue
        done = []
        for job, m, result in zip(jobs, mine, results):
            side.store.save(job.k, job.round + 1, m.round.state, result.personalized)
            result.personalized = None  # in its file now
            done.append(TrainDone(job.k, result, side.store.records[job.k], seconds))
        out.append(done)
    allocator.release_free_memory()
    return out


def run_score_job(side: ClientSide, job: ScoreJob, shared: dict, progress: bool = False) -> ScoreDone:
    tic = time.perf_counter()
    adapter = (None if job.model == "base" else shared["global"] if job.model == "global"
               else personalized_adapter(side, job.k, job.record, shared["global"]))
    score, predictions = score_client(side.lm, job.test, adapter, side.cfg, job.desc, progress)
    return ScoreDone(job.k, score, predictions, time.perf_counter() - tic)


def run_job(side: ClientSide, job, shared: dict, progress: bool = False, on_step=None):
    """`job` (a `TrainJob` or a `ScoreJob`) on `side`; running out of memory is an `OutOfMemory` naming what to lower."""
    try:
        if isinstance(job, TrainJob):
            return run_train_job(side, job, shared, on_step)
        return run_score_job(side, job, shared, progress)
    except (torch.OutOfMemoryError, MemoryError):  # a GPU's, or this process's (also in a worker)
        raise OutOfMemory(out_of_memory(side.cfg, job)) from None


def out_of_memory(cfg, job) -> str:
    """What ran out of memory, with the settings that size it and what to lower."""
    if isinstance(job, TrainJob):
        return training_out_of_memory(cfg, job.k, job.record.name)
    return scoring_out_of_memory(cfg, job.k, job.model, job.record.name)


def training_out_of_memory(cfg, k: int, name: str) -> str:
    """`out_of_memory` for client k's training (also the Flower ClientApp's)."""
    return (f"out of memory training client {k} ({name}) with batch_size={cfg.batch_size}, "
            f"max_seq_len={cfg.max_seq_len}, model {cfg.model}: lower batch_size or max_seq_len, or use a "
            "smaller model")


def scoring_out_of_memory(cfg, k: int, model: str, name: str) -> str:
    """`out_of_memory` for scoring client k's (`name`'s) `model` ("personalized", "global", "base")."""
    return (f"out of memory scoring client {k} ({name})'s {model} model with eval.batch_size={cfg.eval.batch_size}, "
            f"max_seq_len={cfg.max_seq_len}, eval.max_new_tokens={cfg.eval.max_new_tokens}, model {cfg.model}: "
            "lower eval.batch_size (or max_seq_len), or use a smaller model")
