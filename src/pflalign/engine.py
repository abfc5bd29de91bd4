"""The in-process federated engine: synchronous rounds over clients on one machine.

Read top to bottom: set up (data, model, method, state), then for each round
every sampled client starts from what its method says, takes T local steps,
and sends a message; the server aggregates; a checkpoint is written. At the
end every client is scored with its personalized model, the global model and
the untrained base model. The engine knows nothing method-specific: all of
that lives behind `pflalign.methods.base.Method`.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from . import allocator, checkpoint as ckpt
from .base_cache import base_generations
from .config import RunConfig, build_config, method_args, to_dict
from .client import local_round
from .data import ClientData
from .data.federate import FederationOptions
from .data.load import load_federation_described
from .errors import RunInterrupted, TrainingDiverged, UserError
from .evaluate import generate, rouge_l
from .methods import method_class
from .methods.base import Method, Params, RoundContext, State, data_weights
from .model import FederatedLM
from .prompts import Encoded, batch_indices, collate_train, encode_prompt, encode_train

log = logging.getLogger(__name__)


@dataclass
class Client:
    """A client as the engine sees it: its data and its persistent state."""

    id: int
    data: ClientData
    train: list[Encoded]
    state: State  # the method's per-client state (kept across rounds)
    personalized: Params | None = None  # its personalized adapter after its last round
    steps_taken: int = 0  # minibatches consumed: the data sampler's whole state

    @property
    def n_train(self) -> int:
        return len(self.data.train)


# ---- client-side steps shared with the Flower ClientApp (pflalign.flower) ------
def make_client(k: int, data: ClientData, tokenizer, cfg: RunConfig, state: State) -> Client:
    """Client k with its training examples tokenized (checked against batch_size)."""
    if len(data.train) < cfg.batch_size:
        raise UserError(
            f"client {k} ({data.task}) has {len(data.train)} training examples, fewer than batch_size={cfg.batch_size}"
        )
    return Client(k, data, [encode_train(tokenizer, ex, cfg.max_seq_len, cfg.data.template) for ex in data.train], state)


def draw_batches(client: Client, cfg: RunConfig, pad_id: int) -> list[dict]:
    """The client's T minibatches of its next round (advances `steps_taken`): a pure
    function of (seed, client, step), wherever the client runs."""
    batches = []
    for _ in range(cfg.local_steps):
        idx = batch_indices(client.n_train, cfg.batch_size, client.steps_taken, cfg.seed * 1009 + client.id)
        batches.append(collate_train([client.train[i] for i in idx], pad_id))
        client.steps_taken += 1
    return batches


def score_client(lm: FederatedLM, test: list, adapter: Params | None, cfg: RunConfig, desc: str,
                 progress: bool) -> tuple[float, list[str]]:
    """ROUGE-L and generations on `test` with `adapter` (None: the base model, adapter switched off)."""
    prompts = [encode_prompt(lm.tokenizer, ex, cfg.max_seq_len, cfg.data.template)[0] for ex in test]
    if adapter is not None:
        lm.set_lora(adapter)

    def run_generation():
        with lm.model.disable_adapter() if adapter is None else lm.merged():
            return generate(lm.model, lm.tokenizer, prompts, cfg.eval.max_new_tokens, cfg.eval.batch_size,
                            desc=desc, progress=progress)

    if adapter is None:  # the base model's outputs are the same in every run of this split: cached
        preds = base_generations(lm, prompts, cfg.eval.max_new_tokens, cfg.eval.batch_size, run_generation)
    else:
        preds = run_generation()
    return rouge_l(preds, [ex.response for ex in test]), preds


def summarize(cfg: RunConfig, rows: list[dict], truncated: int, data_info: dict | None = None) -> dict:
    """`results.json` from the per-client rows (averages are plain means over clients); `data`:
    what a partitioned or your-own-data federation loaded (columns, rows dropped and why), if any."""

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
    } | ({"data": data_info} if data_info is not None else {})


def sample_clients(num_clients: int, fraction: float, seed: int, round_index: int) -> list[int]:
    """Participants of a round: all by default, else a seeded sample (a pure function of seed and round)."""
    if fraction >= 1.0:
        return list(range(num_clients))
    count = max(1, round(fraction * num_clients))
    rng = np.random.default_rng([seed, round_index])
    return sorted(rng.choice(num_clients, size=count, replace=False).tolist())


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but no CUDA device is available")
    return name


def prepare_run_dir(out: Path, resume: bool, overwrite: bool) -> bool:
    """Check what is in `out`; returns True when a checkpoint should be resumed."""
    finished = (out / ckpt.RESULTS).exists()
    started = ckpt.has_run_checkpoint(out)
    if overwrite:
        for name in (ckpt.RESULTS, ckpt.METRICS, ckpt.PREDICTIONS, ckpt.CONFIG):
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


class Federation:
    """Everything a run needs, built once: model, method, clients, global adapter."""

    def __init__(self, cfg: RunConfig, progress: bool = True):
        self.cfg = cfg
        self.progress = progress
        datasets, self.data_info = load_federation_described(
            cfg.data.name, cfg.data.dir, cfg.data.clients, cfg.data.split_seed,
            cfg.data.max_train, cfg.data.max_test, cfg.data.validation, FederationOptions.from_config(cfg.data),
        )
        dtype = getattr(torch, cfg.dtype)
        self.lm = FederatedLM.build(cfg.model, cfg.lora, cfg.seed, dtype=dtype, device=resolve_device(cfg.device))
        self.method: Method = method_class(cfg.method)(method_args(cfg))
        self.global_params = self.lm.get_lora()
        self.server_state = self.method.init_server_state(self.global_params)
        self.clients = []
        self.truncated = 0
        self.saved = (0, 0)  # (rounds done, metrics offset) of the newest checkpoint on disk
        self.in_round: int | None = None  # the round being trained, for an interrupt's message
        for k, data in enumerate(datasets):
            client = make_client(k, data, self.lm.tokenizer, cfg, self.method.init_client_state(self.global_params))
            self.truncated += sum(e.truncated for e in client.train)
            self.clients.append(client)
        if self.truncated:
            log.warning("%d training examples exceeded max_seq_len=%d and were truncated", self.truncated, cfg.max_seq_len)

    # ---- one client's round -------------------------------------------------
    def train_client(self, client: Client, round_index: int, received: dict, metrics: ckpt.MetricsLog, bar):
        cfg, lm = self.cfg, self.lm
        batches = draw_batches(client, cfg, lm.tokenizer.pad_token_id)

        def on_step(t, loss):
            metrics.write(event="train_step", round=round_index, client=client.id, step=t, loss=loss)
            bar.update(1)

        try:
            result = local_round(lm, self.method, client.state, self.global_params, received, batches,
                                 cfg.lr, round_index, on_step)
        except TrainingDiverged as exc:
            raise TrainingDiverged(f"client {client.id} ({client.data.task}): {exc}") from None
        client.personalized = result.personalized
        metrics.write(event="client_round", round=round_index, client=client.id,
                      gsnr_mean=result.gsnr_mean, gsnr_ratio=result.gsnr_ratio,
                      update_norm=result.update_norm, model_norm=result.model_norm)
        return result

    # ---- the rounds ---------------------------------------------------------
    def train(self, out: Path, start_round: int, metrics: ckpt.MetricsLog, stop_after: int | None) -> int:
        cfg = self.cfg
        end = cfg.rounds if stop_after is None else min(cfg.rounds, start_round + stop_after)
        rounds_bar = tqdm(range(start_round, end), initial=start_round, total=cfg.rounds, desc="rounds",
                          disable=not self.progress, unit="round")
        for r in rounds_bar:
            self.in_round = r
            tic = time.perf_counter()
            chosen = sample_clients(len(self.clients), cfg.participation, cfg.seed, r)
            bar = tqdm(total=len(chosen) * cfg.local_steps, desc=f"round {r + 1} local steps", leave=False,
                       disable=not self.progress, unit="step")
            received = self.method.broadcast(self.global_params, self.server_state)
            results = []
            for k in chosen:
                bar.set_postfix(client=self.clients[k].data.task)
                results.append(self.train_client(self.clients[k], r, received, metrics, bar))
                allocator.release_free_memory()  # the round's activations: not kept past the client
            bar.close()
            weights = data_weights([self.clients[k].n_train for k in chosen])
            ctx = RoundContext(r, len(self.clients), chosen)
            self.global_params = self.method.aggregate(
                self.global_params, [res.message for res in results], weights, self.server_state, ctx)
            seconds = time.perf_counter() - tic
            mean_loss = float(np.mean([l for res in results for l in res.losses]))
            metrics.write(
                event="round", round=r, seconds=seconds, clients=chosen, mean_loss=mean_loss,
                # aggregation consistency: data-weighted size of the client updates, and of the
                # client models as printed in the paper's formula (see docs/usage.md)
                consistency_update_norm=sum(w * res.update_norm for w, res in zip(weights, results)),
                consistency_model_norm=sum(w * res.model_norm for w, res in zip(weights, results)),
            )
            if cfg.eval.every and (r + 1) % cfg.eval.every == 0:
                self.round_eval(r, metrics)
            with ckpt.sigint_deferred():  # a Ctrl-C waits until the checkpoint and `saved` agree
                offset = metrics.commit()
                self.save(out, r + 1, offset)
                self.saved = (r + 1, offset)
            rounds_bar.set_postfix(loss=f"{mean_loss:.3f}")
            if not self.progress:
                log.info("round %d/%d: mean loss %.4f (%.1f s)", r + 1, cfg.rounds, mean_loss, seconds)
        rounds_bar.close()
        self.in_round = None
        return end

    # ---- checkpoint ---------------------------------------------------------
    def save(self, out: Path, rounds_done: int, metrics_offset: int) -> None:
        ckpt.save_run_checkpoint(out, {
            "rounds_done": rounds_done,
            "global": self.global_params,
            "server_state": self.server_state,
            "clients": [
                {"state": c.state, "personalized": c.personalized, "steps_taken": c.steps_taken}
                for c in self.clients
            ],
            "torch_rng": torch.get_rng_state(),
            "metrics_offset": metrics_offset,
        })

    def restore(self, payload: dict) -> int:
        self.global_params = payload["global"]
        self.server_state = payload["server_state"]
        if len(payload["clients"]) != len(self.clients):
            raise UserError("checkpoint has a different number of clients than the config")
        for client, saved in zip(self.clients, payload["clients"]):
            client.state = saved["state"]
            client.personalized = saved["personalized"]
            client.steps_taken = saved["steps_taken"]
        torch.set_rng_state(payload["torch_rng"])
        self.saved = (payload["rounds_done"], payload["metrics_offset"])
        return payload["rounds_done"]

    # ---- evaluation ---------------------------------------------------------
    def _score(self, adapter_of, label: str, limit: int | None = None) -> tuple[list[float], list[list[str]]]:
        """ROUGE-L of every client on its own test split (its first `limit`
        examples when given), with the adapter `adapter_of(client)` (None: the
        base model, adapters switched off)."""
        scores, outputs = [], []
        for c in self.clients:
            score, preds = score_client(self.lm, c.data.test[:limit], adapter_of(c), self.cfg,
                                        f"eval {label} {c.data.task}", self.progress)
            scores.append(score)
            outputs.append(preds)
        return scores, outputs

    def _personalized(self, c: Client) -> Params:
        """A client's personalized adapter as evaluated (after aggregation, as its method defines it);
        the global one before its first round."""
        if c.personalized is None:
            return self.global_params
        return self.method.personalized_after_aggregation(self.global_params, c.personalized, c.state)

    def round_eval(self, round_index: int, metrics: ckpt.MetricsLog) -> None:
        """Score every client on its first `eval.every_max_test` test examples
        after a round (for ROUGE-L curves). Runs under a forked RNG so that
        switching it on never changes the training."""
        limit = self.cfg.eval.every_max_test
        with torch.random.fork_rng(devices=[]):
            personal, _ = self._score(self._personalized, f"round {round_index + 1} personalized", limit)
            global_, _ = self._score(lambda c: self.global_params, f"round {round_index + 1} global", limit)
        for c, p, g in zip(self.clients, personal, global_):
            metrics.write(event="round_eval", round=round_index, client=c.id, task=c.data.task,
                          n_test=len(c.data.test[:limit]), rouge_l_personalized=p, rouge_l_global=g)

    def evaluate(self) -> tuple[dict, list[dict]]:
        cfg = self.cfg
        personal_scores, personal_out = self._score(self._personalized, "personalized")
        global_scores, global_out = self._score(lambda c: self.global_params, "global")
        none = [None] * len(self.clients)
        base_scores, base_out = self._score(lambda c: None, "base") if cfg.eval.base_model else (none, none)
        rows, predictions = [], []
        for i, c in enumerate(self.clients):
            rows.append({
                "id": c.id, "task": c.data.task, "n_train": c.n_train, "n_test": len(c.data.test),
                "rouge_l_personalized": personal_scores[i], "rouge_l_global": global_scores[i],
                "rouge_l_base": base_scores[i],
            })
            for j, ex in enumerate(c.data.test):
                predictions.append({
                    "client": c.id, "task": c.data.task, "prompt": ex.prompt, "reference": ex.response,
                    "personalized": personal_out[i][j], "global": global_out[i][j],
                    "base": base_out[i][j] if base_out[i] is not None else None,
                })
        return summarize(cfg, rows, self.truncated, self.data_info), predictions


def run(cfg: RunConfig, out: Path | str, resume: bool = False, overwrite: bool = False,
        stop_after: int | None = None, progress: bool = True) -> dict | None:
    """Run (or resume) one federated job into `out`; returns results, or None when stopped early."""
    out = Path(out)
    resuming = prepare_run_dir(out, resume, overwrite)
    if resuming:
        saved = ckpt.load_run_checkpoint(out)
        cfg = _saved_config(out)
    fed = Federation(cfg, progress=progress)
    start = 0
    if resuming:
        start = fed.restore(saved)
        log.info("resuming %s after round %d of %d", out, start, cfg.rounds)
        metrics = ckpt.MetricsLog(out / ckpt.METRICS, resume_offset=saved["metrics_offset"])
    else:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(out / ckpt.CONFIG, to_dict(cfg))
        metrics = ckpt.MetricsLog(out / ckpt.METRICS, resume_offset=0)  # drop lines of a run that never checkpointed
    tic = time.perf_counter()
    try:
        done = fed.train(out, start, metrics, stop_after)
        if done < cfg.rounds:
            return None
        train_seconds = time.perf_counter() - tic
        tic = time.perf_counter()
        results, predictions = fed.evaluate()
        results["seconds_train_this_session"] = train_seconds
        results["seconds_eval"] = time.perf_counter() - tic
        results["memory_allocator"] = allocator.active()  # "mimalloc" under the pflalign command (allocator.py)
        metrics.write(event="eval", **{k: v for k, v in results.items() if k.startswith("avg_")})
        metrics.commit()
    except KeyboardInterrupt:
        raise _interrupted(out, fed, metrics) from None
    except TrainingDiverged as exc:
        metrics.rollback(fed.saved[1])  # the diverged round leaves no lines
        kept = f"; the checkpoint after round {fed.saved[0]} is kept" if fed.saved[0] else ""
        raise TrainingDiverged(f"{exc}{kept}") from None
    finally:
        metrics.close()
    ckpt.write_jsonl(out / ckpt.PREDICTIONS, predictions)
    ckpt.write_json(out / ckpt.RESULTS, results)  # last: its presence means "finished"
    return results


def _interrupted(out: Path, fed: Federation, metrics: ckpt.MetricsLog) -> RunInterrupted:
    """Ctrl-C: drop the unfinished round's metrics lines, so the directory is exactly as
    after the last checkpoint, and say how to continue."""
    rounds, offset = fed.saved
    metrics.rollback(offset)
    where = (f"during round {fed.in_round + 1} of {fed.cfg.rounds}" if fed.in_round is not None
             else "during the final evaluation")
    if rounds == 0:
        return RunInterrupted(f"interrupted {where}, before any round finished; nothing to resume: "
                              "run the same command again")
    return RunInterrupted(f"interrupted {where}; the last finished round ({rounds}) is saved; resume with: "
                          f"pflalign run --out {shlex.quote(str(out))} --resume")


def _saved_config(out: Path) -> RunConfig:
    saved = json.loads((out / ckpt.CONFIG).read_text())
    return build_config(None, saved)
