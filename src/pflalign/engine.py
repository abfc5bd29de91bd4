"""The in-process federated engine: synchronous rounds over clients on one machine.

Read top to bottom: set up (data, model, method, state), then for each round
every sampled client starts from what its method says, takes T local steps,
and sends a message; the server aggregates. At the end every client is
scored with its personalized model, the global model and the untrained base
model. The engine knows nothing method-specific (that lives behind
`pflalign.methods.base.Method`), nothing of a client's round (`pflalign.client`,
which the Flower ClientApp calls too) and nothing of the run folder
(`pflalign.lifecycle`, which the Flower ServerApp uses too).
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import allocator, export, run_dir, tensorboard
from .client import Client, make_client, score_client, train_client
from .client_store import ClientStore
from .config import RunConfig, make_method
from .data_cache import client_data
from .errors import RunInterrupted, TrainingDiverged, UserError
from .evaluate import add_exact_match
from .lifecycle import Recorder, RoundRecord, client_row, eval_clients, results_summary, sample_clients
from .methods.base import Method, Params, RoundContext, clone, data_weights
from .model import build_model
from .partition import client_shares_described

log = logging.getLogger(__name__)


class Federation:
    """Everything a run needs, built once: model, method, clients, global adapter.

    Per-client tensors (the method's state, the personalized adapter) are not kept here: they
    live in ``<out>/clients/`` (`pflalign.client_store`), are loaded when a client is sampled
    or scored and dropped after, so memory does not grow with the number of clients. A client
    is created (its state from w^0) at its first round and tokenized when first used.
    """

    def __init__(self, cfg: RunConfig, progress: bool = True, out: Path | str | None = None):
        self.cfg = cfg
        self.progress = progress
        shares, self.data_info = client_shares_described(cfg)
        self.lm = build_model(cfg)
        self.lm.check_max_seq_len(cfg.max_seq_len)
        self.method: Method = make_method(cfg)
        self.global_params = self.lm.get_lora()
        self.initial_params = clone(self.global_params)  # w^0: a client's state starts from it (FedSA-LoRA's B^0)
        self.server_state = self.method.init_server_state(self.global_params)
        # today's federations: token ids from the host's cache (data_cache.py) on first use, tokenized on a miss
        cached = self.data_info is None
        self.clients = [make_client(k, share, self.lm.tokenizer, cfg, None,
                                    (lambda k=k, share=share: client_data(cfg, self.lm.tokenizer, k, share=share)[1])
                                    if cached else None)
                        for k, share in enumerate(shares)]
        self.store = ClientStore(out, [c.name for c in self.clients])  # its folder: the run's (`train` sets it)

    @property
    def truncated(self) -> int:
        """Training examples cut at max_seq_len, over the clients tokenized so far (every client that trained)."""
        return sum(r.truncated for r in self.store.records)

    # ---- one client's tensors, in and out ------------------------------------------
    def load_client(self, k: int) -> Client:
        """Client k with its state and personalized adapter on the heap (a fresh state from w^0
        before its first round)."""
        client = self.clients[k]
        loaded = self.store.load(k, self.global_params[next(iter(self.global_params))].device)
        if loaded is None:
            client.state, client.personalized = self.method.init_client_state(self.initial_params), None
        else:
            client.state, client.personalized = loaded
        client.steps_taken = self.store.records[k].steps_taken
        return client

    def unload_client(self, client: Client) -> None:
        client.state = client.personalized = None

    def _tokenize(self, client: Client) -> None:
        if client.tokenized:
            return
        cut = sum(e.truncated for e in client.train)
        self.store.records[client.id].truncated = cut
        if cut:  # the total is one warning after training (`run`): one line, however many clients
            log.debug("client %d (%s): %d of %d training examples exceeded max_seq_len=%d and were truncated",
                      client.id, client.name, cut, client.n_train, self.cfg.max_seq_len)

    # ---- the rounds -------------------------------------------------------------
    def train(self, rec: Recorder, start: int, end: int, after=lambda r, mean_loss, seconds: None) -> int:
        """Rounds start..end-1 into `rec`'s run folder (metrics, checkpoints); returns `end`."""
        self.store.attach(rec.out)

        def save(rounds_done, payload):
            rec.save(rounds_done, payload)
            self.store.prune()  # after the checkpoint: the files it no longer needs

        return rec.train(self.cfg, start, end, lambda r: self.train_round(r, rec),
                         lambda r: self.round_eval(r, rec), self.checkpoint, after, save=save)

    def train_round(self, r: int, rec: Recorder) -> RoundRecord:
        cfg = self.cfg
        chosen = sample_clients(len(self.clients), cfg.participation, cfg.seed, r)
        bar = tqdm(total=len(chosen) * cfg.local_steps, desc=f"round {r + 1} local steps", leave=False,
                   disable=not self.progress, unit="step")
        received = self.method.broadcast(self.global_params, self.server_state)
        # p_k is known before anyone trains: each message joins the running sums when its client
        # finishes and is dropped, so the round never holds more than one (memory flat in |S|)
        weights = data_weights([self.clients[k].n_train for k in chosen])
        aggregation = self.method.start_aggregation(self.global_params, weights, self.server_state,
                                                    RoundContext(r, len(self.clients), chosen))
        results = []
        for i, k in enumerate(chosen):
            client = self.load_client(k)
            self._tokenize(client)
            bar.set_postfix(client=client.name)

            def on_step(t, loss, k=k):
                rec.train_step(r, k, t, loss)
                bar.update(1)

            try:
                result = train_client(self.lm, self.method, client, self.global_params, received, cfg, r, on_step)
            except TrainingDiverged as exc:
                raise TrainingDiverged(f"client {k} ({client.name}): {exc}") from None
            # its new state, under a name no checkpoint knows yet (a crash before the round's
            # checkpoint leaves the previous file in force)
            self.store.save(k, r + 1, client.state, client.personalized)
            self.store.records[k].steps_taken = client.steps_taken
            self.unload_client(client)
            result.personalized = None  # in its file now
            aggregation.add(i, result.message)
            result.message = {}  # in the sums now; the round keeps the metrics only
            rec.client_round(r, k, result)
            results.append(result)
            allocator.release_free_memory()  # the round's activations: not kept past the client
        bar.close()
        self.global_params = aggregation.finish()
        return RoundRecord(chosen, results, weights)

    # ---- checkpoint ---------------------------------------------------------
    def checkpoint(self) -> dict:
        """Server state, global adapter, RNG, and the clients' records (their tensors are in
        clients/, written as they trained; the records name those files)."""
        return {
            "global": self.global_params,
            "server_state": self.server_state,
            "client_records": self.store.table(),
            "torch_rng": torch.get_rng_state(),
        }

    def restore(self, payload: dict) -> int:
        self.global_params = payload["global"]
        self.server_state = payload["server_state"]
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

    def _score(self, adapter_of, label: str, limit: int | None = None) -> tuple[list[float], list[list[str]]]:
        """ROUGE-L of every scored client (`eval_ids`) on its own test split (its first `limit`
        examples when given), with the adapter `adapter_of(k)` (None: the base model, adapters
        switched off); one client's tensors on the heap at a time."""
        scores, outputs = [], []
        for k in self.eval_ids:
            c = self.clients[k]
            score, preds = score_client(self.lm, c.data.test[:limit], adapter_of(k), self.cfg,
                                        f"eval {label} {c.name}", self.progress)
            scores.append(score)
            outputs.append(preds)
        return scores, outputs

    def personalized_of(self, k: int) -> Params:
        """Client k's personalized adapter as evaluated (after aggregation, as its method defines
        it), from its file; the global one before its first round."""
        if self.store.records[k].file is None:
            return self.global_params
        client = self.load_client(k)
        try:
            return self.method.personalized_after_aggregation(self.global_params, client.personalized, client.state)
        finally:
            self.unload_client(client)

    def round_eval(self, round_index: int, rec: Recorder) -> None:
        """Score the clients on their first `eval.every_max_test` test examples
        after a round (for ROUGE-L curves). Runs under a forked RNG so that
        switching it on never changes the training."""
        limit = self.cfg.eval.every_max_test
        with torch.random.fork_rng(devices=[]):
            personal, _ = self._score(self.personalized_of, f"round {round_index + 1} personalized", limit)
            global_, _ = self._score(lambda k: self.global_params, f"round {round_index + 1} global", limit)
        for k, p, g in zip(self.eval_ids, personal, global_):
            c = self.clients[k]
            rec.round_eval(round_index, c.id, c.name, len(c.data.test[:limit]), p, g)

    def evaluate(self) -> tuple[dict, list[dict]]:
        cfg = self.cfg
        ids = self.eval_ids
        seconds = {}  # where the evaluation's time goes (results.json); base about 0 when cached

        def timed(adapter_of, label: str):
            tic = time.perf_counter()
            scored = self._score(adapter_of, label)
            seconds[label] = time.perf_counter() - tic
            return scored

        personal_scores, personal_out = timed(self.personalized_of, "personalized")
        global_scores, global_out = timed(lambda k: self.global_params, "global")
        none = [None] * len(ids)
        base_scores, base_out = timed(lambda k: None, "base") if cfg.eval.base_model else (none, none)
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
        summary["seconds_eval_by_model"] = seconds
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


@run_dir.guarded  # --out checked and locked, --overwrite restores the old run on failure
def run(cfg: RunConfig, out: Path | str, resume: bool = False, overwrite: bool = False,
        stop_after: int | None = None, progress: bool = True) -> dict | None:
    """Run (or resume) one federated job into `out`; returns results, or None when stopped early."""
    rec = Recorder(out, resume, overwrite)
    cfg = rec.config(cfg)
    fed = Federation(cfg, progress=progress, out=rec.out)
    start = fed.restore(rec.checkpoint) if rec.resuming else 0
    rec.open(cfg)
    rec.metrics = tensorboard.wrap(rec.metrics, cfg, rec.out, {c.id: c.name for c in fed.clients})  # log.tensorboard
    end = cfg.rounds if stop_after is None else min(cfg.rounds, start + stop_after)
    rounds_bar = tqdm(range(start, end), initial=start, total=cfg.rounds, desc="rounds",
                      disable=not progress, unit="round")

    def after(r, mean_loss, seconds):
        rounds_bar.update(1)
        rounds_bar.set_postfix(loss=f"{mean_loss:.3f}")
        if not progress:
            log.info("round %d/%d: mean loss %.4f (%.1f s)", r + 1, cfg.rounds, mean_loss, seconds)

    tic = time.perf_counter()
    try:
        done = fed.train(rec, start, end, after)
        rounds_bar.close()
        if fed.truncated:  # over every client that trained (tokenized when first sampled)
            log.warning("%d training examples exceeded max_seq_len=%d and were truncated", fed.truncated,
                        cfg.max_seq_len)
        if done < cfg.rounds:
            rec.close()
            return None
        train_seconds, tic = time.perf_counter() - tic, time.perf_counter()
        results, predictions = fed.evaluate()
        add_exact_match(results, predictions)  # beside ROUGE-L, from the same outputs
        # the models as evaluated, as PEFT adapter folders (export.py), before results.json marks the run finished
        export.write_run_adapters(rec.out, cfg, fed.adapters_as_evaluated())
        # memory_allocator: "mimalloc" under the pflalign command (allocator.py)
        return rec.finish(results, train_seconds, time.perf_counter() - tic, predictions,
                          memory_allocator=allocator.active())
    except KeyboardInterrupt:
        raise _interrupted(rec, cfg) from None
    except TrainingDiverged as exc:
        rec.rollback()  # the diverged round leaves no lines
        kept = f"; the checkpoint after round {rec.saved[0]} is kept" if rec.saved[0] else ""
        raise TrainingDiverged(f"{exc}{kept}") from None
    finally:
        rec.close()


def _interrupted(rec: Recorder, cfg: RunConfig) -> RunInterrupted:
    """Ctrl-C: drop the unfinished round's metrics lines, so the directory is exactly as
    after the last checkpoint, and say how to continue."""
    rounds = rec.saved[0]
    rec.rollback()
    where = (f"during round {rec.in_round + 1} of {cfg.rounds}" if rec.in_round is not None
             else "during the final evaluation")
    if rounds == 0:
        return RunInterrupted(f"interrupted {where}, before any round finished; nothing to resume: "
                              "run the same command again")
    return RunInterrupted(f"interrupted {where}; the last finished round ({rounds}) is saved; resume with: "
                          f"pflalign run --out {shlex.quote(str(rec.out))} --resume")

