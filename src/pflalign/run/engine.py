"""The in-process federated engine: synchronous rounds over clients on one machine.

Read top to bottom: set up (data, model, method, server), then the rounds
(`Federation.train`, the loop): every sampled client starts from what its
method says, takes T local steps and sends a message, which joins the
server's sums; the server aggregates. At the end every client is scored with
its personalized model, the global model and the untrained base model. The
engine knows nothing method-specific (that lives behind
`pflalign.methods.base.Method`), nothing of a client's round (`pflalign.run.client`,
which the Flower ClientApp calls too), nothing of the server's rule
(`pflalign.run.server.Server`, which the Flower strategy uses too) and nothing of
the run folder (`pflalign.run.lifecycle.Recorder`, which the Flower ServerApp
uses too).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import allocator, export, run_dir
from .batched_scoring import score_jobs_together
from .. import checkpoint as ckpt, tensorboard
from .client import Client, draw_batches, make_client
from .client_store import ClientStore
from ..config import RunConfig, make_method, to_dict
from .data_cache import client_data
from ..errors import OutOfMemory, TrainingDiverged, UserError
from ..evaluate import add_exact_match
from .lifecycle import (LossWatch, Recorder, client_row, diverged, eval_clients, interrupted, results_summary,
                        sample_clients, warn_at_start)
from ..methods.base import Method, Params, clone
from ..model import FederatedLM, build_model, resolve_device
from ..model.base_cache import package_source_digest
from ..data.clients import client_shares_described
from .server import RoundRecord, Server
from .lockstep import check_batch, resolve_batch
from .jobs import ClientSide, ScoreDone, ScoreJob, StartedRound, TrainJob, personalized_adapter, run_train_jobs_lockstep
from .workers import Inline, Processes, bound_workers, check_workers
from ..settings.defaults import CHECKPOINT_EVERY, CLIENT_MEMORY_BYTES

log = logging.getLogger(__name__)


class Federation:
    """Everything a run needs, built once: model, method, clients, global adapter.

    Per-client tensors (the method's state, the personalized adapter) are not kept here: they
    live in ``<out>/clients/`` (`pflalign.run.client_store`), are loaded when a client is sampled
    or scored and dropped after, so memory does not grow with the number of clients. A client
    is created (its state from w^0) at its first round and tokenized when first used.

    `workers` > 1: the clients of a round train, and the clients are scored, in that many
    processes of one thread each (`pflalign.run.workers`), with a one-thread run's results.
    """

    def __init__(self, cfg: RunConfig, progress: bool = True, out: Path | str | None = None, workers: int = 1,
                 batch: str = "auto", shared: tuple[FederatedLM, Params] | None = None,
                 checkpoint_every: float | None = None):
        """`shared`: (a model this run shares with others, this run's w^0) for runs trained in
        lockstep (`--batch runs`, run/together.py), instead of a model of its own.
        `checkpoint_every`: seconds between checkpoints (`checkpoint_interval`)."""
        device = resolve_device(cfg.device)
        check_workers(workers, device)
        asked = batch
        batch = resolve_batch(batch, workers, cfg, device)
        check_batch(batch, workers, cfg)
        self.cfg = cfg
        self.batch = batch
        # the clients' models scored in one decoding loop when --batch asks for it; `auto` trains in
        # lockstep on CUDA (measured faster there) but scores one merged model at a time until the
        # per-row loop is measured there too (benchmarks/gpu.py's scoring section)
        self.score_together = batch != "none" and asked != "auto"
        self.progress = progress
        self._runner: Inline | Processes | None = None
        shares, self.data_info = client_shares_described(cfg)
        self.workers = bound_workers(workers, len(sample_clients(len(shares), cfg.participation, cfg.seed, 0)),
                                     len(eval_clients(len(shares), cfg.eval.clients, cfg.seed)))
        # training here: the weights in this process's memory (page cache is the first thing reclaimed
        # under pressure: benchmarks/memory_pressure.py); with workers they train there, mapping one file
        if shared is None:
            self.lm = build_model(cfg, in_memory=self.workers == 1)
        else:
            self.lm = shared[0]
            self.lm.set_lora(shared[1])
        self.lm.check_max_seq_len(cfg.max_seq_len)
        self.method: Method = make_method(cfg)
        self.server = Server(self.method, self.lm.get_lora(), len(shares))  # w^0: the seeded LoRA initialisation
        self.initial_params = clone(self.global_params)  # w^0: a client's state starts from it (FedSA-LoRA's B^0)
        self.in_round: int | None = None  # the round being trained (an interrupt's message)
        # today's federations: token ids from the host's cache (run/data_cache.py) on first use, tokenized on a miss
        cached = self.data_info is None
        self.clients = [make_client(k, share, self.lm.tokenizer, cfg, None,
                                    (lambda k=k, share=share: client_data(cfg, self.lm.tokenizer, k, share=share)[1])
                                    if cached else None)
                        for k, share in enumerate(shares)]
        self.checkpoint_every = checkpoint_interval(checkpoint_every, device)
        self.saved_at = time.monotonic()  # the last checkpoint (or the start of this session)
        # between checkpoints the clients' records stay in memory (in this process only: workers read files)
        memory = CLIENT_MEMORY_BYTES if self.checkpoint_every > 0 and self.workers == 1 else 0
        self.store = ClientStore(out, [c.name for c in self.clients], memory)  # its folder: the run's (`train` sets it)
        # what runs a client's jobs in this process (workers = 1, and the export's personalized adapters)
        self.side = ClientSide(self.lm, self.method, cfg, self.store, self.initial_params)

    @property
    def global_params(self) -> Params:
        """w^r, the server's: what the clients start from and the global model scored."""
        return self.server.global_params

    @property
    def runner(self) -> Inline | Processes:
        """The jobs' runner, made at first use: this process, or the worker processes (started once)."""
        if self._runner is None:
            if self.workers == 1:
                self._runner = Inline(self.side, self.progress)
            else:
                if self.store.folder is None:
                    raise ValueError("workers > 1 need the run folder (the clients' files are the workers' state)")
                self._runner = Processes(self.workers, to_dict(self.cfg), self.store.folder.parent,
                                         [c.name for c in self.clients], self.initial_params)
        return self._runner

    def close(self) -> None:
        """Stop the worker processes, if any; forget the clients' records not yet written (the last
        checkpoint names what the run keeps)."""
        self.store.discard()
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    @property
    def truncated(self) -> int:
        """Training examples cut at max_seq_len, over the clients tokenized so far (every client that trained)."""
        return sum(r.truncated for r in self.store.records)

    def _tokenize(self, client: Client) -> None:
        if client.tokenized:
            return
        cut = sum(e.truncated for e in client.train)
        self.store.records[client.id].truncated = cut
        if cut:  # the total is one warning after training (`run`): one line, however many clients
            log.debug("client %d (%s): %d of %d training examples exceeded max_seq_len=%d and were truncated",
                      client.id, client.name, cut, client.n_train, self.cfg.max_seq_len)

    # ---- the rounds -------------------------------------------------------------
    def train(self, rec: Recorder, start: int, end: int, after=lambda r, record, seconds: None) -> int:
        """Rounds start..end-1, each written into `rec`'s run folder, then `after(r, record,
        seconds)` (progress, logs). Returns `end`."""
        watch = self.attach(rec)
        for r in range(start, end):
            self.in_round = r
            tic = time.perf_counter()
            record = self.train_round(r)  # the sampled clients train, the server aggregates
            seconds = time.perf_counter() - tic
            self.keep_round(rec, watch, r, record, seconds, last=r + 1 == end)
            after(r, record, seconds)
        self.in_round = None
        return end

    def attach(self, rec: Recorder) -> LossWatch:
        """The clients' files into `rec`'s run folder; the watch on the run's loss."""
        self.store.attach(rec.out)
        return LossWatch(rec, [c.name for c in self.clients])

    def keep_round(self, rec: Recorder, watch: LossWatch, r: int, record: RoundRecord, seconds: float,
                   evaluated: list[dict] | None = None, last: bool = True) -> None:
        """Round r written: its lines, its scores when ``eval.every`` says so (`evaluated`: already
        scored, with other runs': run/together.py), and its checkpoint when one is due: after the
        session's `last` round, and after any round once `checkpoint_every` seconds have passed
        since the last one (every round by default on the CPU)."""
        rec.round(r, record, seconds)  # the clients' lines, then the round's
        watch.round(r, record)  # warns once if the loss runs away
        if self.round_eval_due(r):
            rec.round_eval(r, self.round_eval(r) if evaluated is None else evaluated)
        if not self.checkpoint_due(r, last):
            return
        try:
            self.store.flush()  # the clients' records held in memory, into the files the checkpoint names
        except ckpt.DiskFull as exc:
            raise ckpt.DiskFull(f"{exc}; " + (f"the checkpoint after round {rec.saved[0]} is intact; free some space, "
                                              "then continue with --resume (same --out)" if rec.saved[0] else
                                              "no round is saved yet; free some space and start again")) from None
        rec.save(r + 1, self.checkpoint())
        self.store.prune()  # after the checkpoint: the client files it no longer names
        self.saved_at = time.monotonic()

    def checkpoint_due(self, r: int, last: bool) -> bool:
        """Whether round r's checkpoint is written: after the session's last round, and once
        `checkpoint_every` seconds have passed since the last checkpoint."""
        return last or time.monotonic() - self.saved_at >= self.checkpoint_every

    def train_round(self, r: int) -> RoundRecord:
        """Round r: the sampled clients train from w^r (side by side with workers > 1, in lockstep
        with --batch clients) and each message joins the server's sums as it comes back; returns
        the round's record (w^{r+1})."""
        started = self.start_round(r)
        if self.batch == "clients":  # every client's step t in one pass (run/lockstep.py)
            done_jobs = run_train_jobs_lockstep(self.side, started.jobs, started.shared, on_step=started.on_step)
        else:
            done_jobs = self.runner.map(started.jobs, started.shared, started.costs, on_step=started.on_step)
        return self.finish_round(started, done_jobs)

    def start_round(self, r: int) -> StartedRound:
        """Round r up to its training: the sampled clients, the server's round (p_k known before
        anyone trains), each client's job, and what the jobs share (w^r, the broadcast)."""
        cfg = self.cfg
        chosen = sample_clients(len(self.clients), cfg.participation, cfg.seed, r)
        bar = tqdm(total=len(chosen) * cfg.local_steps, desc=f"round {r + 1} local steps", leave=False,
                   disable=not self.progress, unit="step")
        received = self.server.broadcast()
        # each message joins the running sums in client order and is dropped, so the round holds
        # at most one per worker (memory flat in |S|)
        plan = self.server.start_round(r, chosen, [self.clients[k].n_train for k in chosen])
        jobs = [self._train_job(r, k) for k in chosen]
        costs = [float(sum(int(b["attention_mask"].sum()) for step in job.batches  # tokens
                           for b in ([step] if isinstance(step, dict) else step))) for job in jobs]
        return StartedRound(chosen, plan, jobs, [self.clients[k].steps_taken for k in chosen], costs,
                            {"global": self.global_params, "received": received}, bar)

    def finish_round(self, started: StartedRound, done_jobs) -> RoundRecord:
        """The round's end: each client's record kept, its message into the server's sums in
        client order, the server's aggregation (w^{r+1})."""
        results = []
        for i, (k, done) in enumerate(zip(started.chosen, done_jobs)):
            done.record.steps_taken = started.steps_after[i]
            self.store.records[k] = done.record
            if self.runner.workers > 1:
                started.bar.update(len(done.result.losses))
            started.plan.add(i, done.result.message)
            done.result.message = {}  # in the sums now; the round keeps the metrics only
            done.result.seconds = done.seconds
            results.append(done.result)
        started.bar.close()
        return self.server.finish_round(started.plan, results)

    def _train_job(self, r: int, k: int) -> TrainJob:
        """Client k's round as a job: its next T minibatches (drawn here, a pure function of seed,
        client and step: `draw_batches`) and its record."""
        client = self.clients[k]
        self._tokenize(client)
        client.steps_taken = self.store.records[k].steps_taken
        batches = draw_batches(client, self.cfg, self.lm.tokenizer.pad_token_id)
        return TrainJob(k, r, self.store.records[k], batches)

    # ---- checkpoint ---------------------------------------------------------
    def checkpoint(self) -> dict:
        """Server state, global adapter, RNG, and the clients' records (their tensors are in
        clients/, written as they trained; the records name those files)."""
        return {**self.server.state_dict(), "client_records": self.store.table(), "torch_rng": torch.get_rng_state()}

    def restore(self, payload: dict) -> int:
        self.server.load_state_dict(payload)
        if "clients" in payload:  # before issue 21 the checkpoint held every client's tensors
            self._restore_whole_federation(payload)
        else:
            self.store.restore(payload["client_records"])
        torch.set_rng_state(payload["torch_rng"])
        return payload["rounds_done"]

    def _restore_whole_federation(self, payload: dict) -> None:
        """An older checkpoint (every client's tensors in it): each client's part goes to its file,
        as if it had been written in the checkpoint's last round; the next save then names them."""
        if len(payload["clients"]) != len(self.clients):
            raise UserError("checkpoint has a different number of clients than the config")
        for k, saved in enumerate(payload["clients"]):
            self.store.save(k, payload["rounds_done"], saved["state"], saved["personalized"])
            self.store.records[k].steps_taken = saved["steps_taken"]
            self._tokenize(self.clients[k])  # its truncation count, which that format did not keep
        payload["clients"] = None  # not held for the rest of the run

    # ---- evaluation ---------------------------------------------------------
    @property
    def eval_ids(self) -> list[int]:
        """The clients scored: all, or the seeded sample of ``eval.clients`` (the same in every
        method's run of a seed, so their numbers compare client by client)."""
        return eval_clients(len(self.clients), self.cfg.eval.clients, self.cfg.seed)

    @property
    def final_models(self) -> list[str]:
        """The models of the final scoring; the base model's generations are cached across runs
        (model/base_cache.py): about 0 s then."""
        return ["personalized", "global", "base"] if self.cfg.eval.base_model else ["personalized", "global"]

    def score_jobs(self, models: list[str], label: str = "", limit: int | None = None) -> tuple[list, list[float]]:
        """The `ScoreJob` of every scored client (`eval_ids`) on its own test split (its first
        `limit` examples when given) for each of `models` ("personalized", "global", "base"), and
        each job's cost (which to start first)."""
        jobs, costs = [], []
        for model in models:
            for k in self.eval_ids:
                c = self.clients[k]
                test = c.data.test[:limit]
                jobs.append(ScoreJob(k, model, self.store.records[k], test, f"eval {label}{model} {c.name}"))
                # which to start first: the long answers are the slow ones (a guess from the references)
                costs.append(float(sum(len(ex.prompt) + 4 * len(ex.response) for ex in test)))
        return jobs, costs

    def _score(self, models: list[str], label: str = "", limit: int | None = None,
               done_jobs: list | None = None, kept: ckpt.ScoringLog | None = None) -> dict:
        """ROUGE-L and outputs of the `score_jobs` of `models`: {model: (scores, outputs, seconds)},
        seconds summed over its clients' jobs. `done_jobs`: those jobs' `ScoreDone`s when already
        scored (with other runs': run/together.py). `kept`: the jobs finished before (taken from
        it), and where each job scored now is kept as it finishes (the final scoring's)."""
        jobs, costs = self.score_jobs(models, label, limit)
        scored = {model: ([], [], 0.0) for model in models}
        # one process shows a bar per client as it generates (score_client); workers show none, so here
        # a bar over their jobs
        bar = tqdm(total=len(jobs), desc=f"eval {label}".strip(), leave=False, unit="job",
                   disable=not self.progress or self.runner.workers == 1)
        shared = {"global": self.global_params}
        if done_jobs is None:
            done_jobs = self._run_score_jobs(jobs, costs, shared, kept)
        for job, done in zip(jobs, done_jobs, strict=True):  # (done_jobs handed in: from jobs built alike)
            assert done.k == job.k, f"client {done.k}'s scores handed in for client {job.k}'s job"
            bar.update(1)
            scores, outputs, seconds = scored[job.model]
            scores.append(done.score)
            outputs.append(done.predictions)
            scored[job.model] = (scores, outputs, seconds + done.seconds)
        bar.close()
        return scored

    def _run_score_jobs(self, jobs: list[ScoreJob], costs: list[float], shared: dict,
                        kept: ckpt.ScoringLog | None) -> Iterator[ScoreDone]:
        """Each job's `ScoreDone`, in order: a job `kept` holds as it was, the others scored (with
        --batch, in one decoding loop, a row per prompt with its own adapter; else by the runner)
        and each added to `kept` as it comes back (with workers, maybe before those ahead of it)."""
        held = [None if kept is None else kept.get(job.k, job.model) for job in jobs]
        todo = [i for i, h in enumerate(held) if h is None]
        if kept is not None and len(todo) < len(jobs):
            log.info("the final scoring resumes: %d of its %d jobs were finished before the stop (%s)",
                     len(jobs) - len(todo), len(jobs), kept.path.name)
        to_score = [jobs[i] for i in todo]

        def keep(i: int, done: ScoreDone) -> None:
            if kept is not None:
                kept.add(to_score[i].k, to_score[i].model, done.score, done.predictions, done.seconds)

        if not to_score:
            fresh = iter([])
        elif self.score_together:  # one loop: every job comes back at its end
            together = score_jobs_together(self.side, to_score, shared, self.progress)
            for i, done in enumerate(together):
                keep(i, done)
            fresh = iter(together)
        else:
            fresh = self.runner.map(to_score, shared, [costs[i] for i in todo], on_result=keep)
        for job, h in zip(jobs, held):
            yield ScoreDone(job.k, h["score"], h["predictions"], h["seconds"]) if h is not None else next(fresh)

    def personalized_of(self, k: int) -> Params:
        """Client k's personalized adapter as evaluated (after aggregation, as its method defines
        it), from its file; the global one before its first round."""
        return personalized_adapter(self.side, k, self.store.records[k], self.global_params)

    def round_eval_due(self, round_index: int) -> bool:
        """Whether ``eval.every`` scores the clients after this round."""
        return bool(self.cfg.eval.every) and (round_index + 1) % self.cfg.eval.every == 0

    def round_eval_jobs(self, round_index: int) -> list:
        """The `score_jobs` of a round's scoring: personalized and global, the first
        `eval.every_max_test` test examples of each scored client."""
        return self.score_jobs(["personalized", "global"], f"round {round_index + 1} ", self.cfg.eval.every_max_test)[0]

    def round_eval(self, round_index: int, done_jobs: list | None = None) -> list[dict]:
        """Score the clients on their first `eval.every_max_test` test examples
        after a round (for ROUGE-L curves): a row per client (`Recorder.round_eval`).
        Runs under a forked RNG so that switching it on never changes the training.
        `done_jobs`: the `ScoreDone` of each of `round_eval_jobs`, scored with other runs'."""
        limit = self.cfg.eval.every_max_test
        with torch.random.fork_rng(devices=[]):
            scored = self._score(["personalized", "global"], f"round {round_index + 1} ", limit, done_jobs)
        return [{"client": self.clients[k].id, "task": self.clients[k].name,
                 "n_test": len(self.clients[k].data.test[:limit]), "rouge_l_personalized": p, "rouge_l_global": g}
                for k, p, g in zip(self.eval_ids, scored["personalized"][0], scored["global"][0])]

    def evaluate(self, known: dict | None = None, done_jobs: list | None = None,
                 kept: ckpt.ScoringLog | None = None) -> tuple[dict, list[dict]]:
        """The final scores and predictions of every scored client; `known`: {model: (scores, outputs)}
        already scored under this very config (a rescore's global model), taken as they are;
        `done_jobs`: the `ScoreDone` of each of `score_jobs(final_models)`, scored with other runs';
        `kept`: the jobs finished before a stop, and where each new one is kept (`finish_run`)."""
        cfg = self.cfg
        ids = self.eval_ids
        known = known or {}
        scored = self._score([m for m in self.final_models if m not in known], done_jobs=done_jobs, kept=kept)
        scored.update({m: (scores, outputs, 0.0) for m, (scores, outputs) in known.items()})
        none = [None] * len(ids)
        personal_scores, personal_out, _ = scored["personalized"]
        global_scores, global_out, _ = scored["global"]
        base_scores, base_out, _ = scored.get("base", (none, none, 0.0))
        rows, predictions = [], []
        for i, k in enumerate(ids):
            c = self.clients[k]
            rows.append(client_row(c.id, c.name, c.n_train, len(c.data.test), personal_scores[i],
                                   global_scores[i], base_scores[i]))
            for j, ex in enumerate(c.data.test):
                predictions.append({
                    "client": c.id, "task": c.name, "prompt": ex.prompt, "reference": ex.response,
                    "personalized": personal_out[i][j], "global": global_out[i][j],
                    "base": base_out[i][j] if base_out[i] is not None else None,
                })
        summary = results_summary(cfg, rows, self.truncated, self.data_info, len(self.clients))
        # where the evaluation's time goes: each model's jobs' seconds (with workers > 1 they overlap)
        summary["seconds_eval_by_model"] = {model: seconds for model, (_, _, seconds) in scored.items()}
        return summary, predictions

    def adapters_as_evaluated(self) -> "_Adapters":
        """{"global": w, name: personalized} of the scored clients, each loaded only when written."""
        return _Adapters(self)


class _Adapters(Mapping):
    """The run's adapters for `export.write_run_adapters`, read one at a time from the clients'
    files (a dict of all of them would hold every client's adapter at once)."""

    def __init__(self, fed: Federation):
        self.fed = fed
        self.ids = {fed.clients[k].name: k for k in fed.eval_ids}

    def __iter__(self):
        return iter([export.GLOBAL, *self.ids])

    def __len__(self) -> int:
        return 1 + len(self.ids)

    def __getitem__(self, name: str) -> Params:
        return self.fed.global_params if name == export.GLOBAL else self.fed.personalized_of(self.ids[name])


def checkpoint_interval(seconds: float | None, device: str) -> float:
    """Seconds between checkpoints: `seconds` as given (0: after every round), else the device's
    default (`settings.defaults.CHECKPOINT_EVERY`: every round on the CPU, where a round takes
    minutes; every 60 s on CUDA, where a SmolLM2 round trains in 1.1-1.7 s and 4 pFLAlign clients'
    records through their files took 2.3 s on the CPU)."""
    if seconds is None:
        return CHECKPOINT_EVERY.get(torch.device(device).type, 0.0)
    if not seconds >= 0:
        raise UserError(f"--checkpoint-every must be >= 0 seconds, got {seconds:g}")
    return float(seconds)


@run_dir.guarded  # --out checked and locked, --overwrite restores the old run on failure
def run(cfg: RunConfig, out: Path | str, resume: bool = False, overwrite: bool = False,
        stop_after: int | None = None, progress: bool = True, workers: int = 1,
        allow_recipe_change: bool = False, batch: str = "auto", checkpoint_every: float | None = None) -> dict | None:
    """Run (or resume) one federated job into `out`; returns results, or None when stopped early.
    `checkpoint_every`: seconds between checkpoints (`checkpoint_interval`; the last round of the
    session is always saved).
    `workers` > 1: clients train and are scored in that many one-thread processes (`pflalign.run.workers`).
    `batch` "clients": a round's clients train in lockstep, step t of all in one pass (`pflalign.run.lockstep`),
    and their personalized and global models are scored in one decoding loop (`pflalign.run.batched_scoring`).
    `allow_recipe_change`: resume though config.json's training recipe is not the checkpoint's
    (`Recorder.config`)."""
    if batch == "runs":
        raise UserError("--batch runs trains several runs together: use pflalign sweep --batch runs")
    rec, fed, start = open_run(cfg, out, resume, overwrite, allow_recipe_change, progress, workers, batch,
                               checkpoint_every=checkpoint_every)
    cfg = fed.cfg
    end = cfg.rounds if stop_after is None else min(cfg.rounds, start + stop_after)
    rounds_bar = tqdm(range(start, end), initial=start, total=cfg.rounds, desc="rounds",
                      disable=not progress, unit="round")

    def after(r, record, seconds):
        rounds_bar.update(1)
        rounds_bar.set_postfix(loss=f"{record.mean_loss:.3f}")
        if not progress:
            log.info("round %d/%d: mean loss %.4f (%.1f s)", r + 1, cfg.rounds, record.mean_loss, seconds)

    tic = time.perf_counter()
    try:
        done = fed.train(rec, start, end, after)
        rounds_bar.close()
        if done < cfg.rounds:
            rec.close()
            return None
        return finish_run(rec, fed, time.perf_counter() - tic)
    except KeyboardInterrupt:
        raise interrupted(rec, cfg, fed.in_round) from None
    except TrainingDiverged as exc:
        raise diverged(rec, exc) from None
    except OutOfMemory as exc:
        rec.rollback()  # as for a diverged round: the directory is as after the last checkpoint
        kept = (f"; the checkpoint after round {rec.saved[0]} is kept: free memory and continue with --resume, or "
                "start again with lower values and --overwrite" if rec.saved[0]
                else "; no round is saved yet: start again with lower values")
        raise OutOfMemory(f"{exc}{kept}") from None
    finally:
        fed.close()
        rec.close()


def open_run(cfg: RunConfig | None, out: Path | str, resume: bool, overwrite: bool, allow_recipe_change: bool,
             progress: bool, workers: int, batch: str,
             shared: Callable[[RunConfig], tuple[FederatedLM, Params]] | None = None,
             checkpoint_every: float | None = None) -> tuple[Recorder, Federation, int]:
    """A run set up to train (inside `run_dir.guard`): its run folder (`Recorder`: config.json,
    metrics, the checkpoint it resumes from), its `Federation` (`shared(cfg)`: the model it shares
    with other runs and its w^0, `Federation`), the round it starts at."""
    rec = Recorder(out, resume, overwrite, allow_recipe_change)
    cfg = rec.config(cfg)
    fed = Federation(cfg, progress=progress, out=rec.out, workers=workers, batch=batch,
                     shared=None if shared is None else shared(cfg), checkpoint_every=checkpoint_every)
    start = fed.restore(rec.checkpoint) if rec.resuming else 0
    if not rec.resuming:
        warn_at_start(cfg, fed.method)
    rec.open(cfg)
    rec.metrics = tensorboard.wrap(rec.metrics, cfg, rec.out, {c.id: c.name for c in fed.clients})  # log.tensorboard
    return rec, fed, start


def finish_run(rec: Recorder, fed: Federation, train_seconds: float, done_jobs: list | None = None) -> dict:
    """A run whose rounds are done: every client scored (`done_jobs`: already, with other runs',
    `Federation.evaluate`; their seconds counted as this run's), the adapters written, results.json
    last (what marks the run finished)."""
    cfg = fed.cfg
    if fed.truncated:  # over every client that trained (tokenized when first sampled)
        log.warning("%d training examples exceeded max_seq_len=%d and were truncated", fed.truncated,
                    cfg.max_seq_len)
    tic = time.perf_counter() - sum(done.seconds for done in done_jobs or [])
    # each job kept as it finishes: a run stopped while it scores scores only the rest on resume
    kept = None if done_jobs is not None else scoring_log(rec.out, cfg)
    results, predictions = fed.evaluate(done_jobs=done_jobs, kept=kept)
    add_exact_match(results, predictions)  # beside ROUGE-L, from the same outputs
    # the models as evaluated, as PEFT adapter folders (run/export.py), before results.json marks the run finished
    try:
        export.write_run_adapters(rec.out, cfg, fed.adapters_as_evaluated(), results)
    except ckpt.DiskFull as exc:  # the checkpoint is whole: a resume scores the clients again and writes them
        raise ckpt.DiskFull(f"{exc}; the checkpoint after round {rec.saved[0]} is intact; free some space, "
                            "then continue with --resume (same --out)") from None
    # memory_allocator: "mimalloc" under the pflalign command (run/allocator.py); the processes and
    # threads that computed it (the thread count decides the floating-point sums' last bits)
    how = {"batch": fed.batch} if fed.batch != "none" else {}  # how it was computed: results equal to rounding
    finished = rec.finish(results, train_seconds, time.perf_counter() - tic, predictions,
                          memory_allocator=allocator.active(), workers=fed.workers,
                          threads_per_worker=fed.runner.threads(), **how)
    if kept is not None:
        kept.remove()  # in results.json now
    return finished


def scoring_log(out: Path, cfg: RunConfig) -> ckpt.ScoringLog | None:
    """The final scoring's kept jobs (checkpoint/scoring.py) under the key of what they are scored
    from: the newest checkpoint (its checksum: the global adapter, the clients' records and states),
    the whole config (eval settings, data, model) and, as for the base model's cache, the code that
    generates and its torch and transformers. None without a checkpoint manifest (a run folder of
    an older pflalign): then nothing is kept."""
    import transformers

    newest = ckpt.newest_checkpoint_entry(out)
    if newest is None:
        return None
    key = hashlib.sha256(json.dumps({
        "checkpoint": newest["sha256"], "rounds_done": newest["rounds_done"], "config": to_dict(cfg),
        "source": package_source_digest(), "torch": torch.__version__,
        "transformers": transformers.__version__}, sort_keys=True).encode()).hexdigest()
    return ckpt.ScoringLog.open(out, key)

