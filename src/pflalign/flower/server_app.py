"""The Flower ServerApp: the rounds of one run, written as ``pflalign run`` writes them.

Reads its run config (`wire.RUN_DEFAULTS`), builds w^0 (the seeded LoRA
initialisation, as the in-process engine does) and a `MethodStrategy`, waits
for one SuperNode per client, then runs the rounds: `configure_train`, the
replies, `aggregate_train`, metrics, a checkpoint. At the end every client
scores its personalized, the global and the base model on its own test split.

The run directory (``out``, on the ServerApp's host) holds what ``pflalign
run`` writes (``config.json``, ``metrics.jsonl``, ``checkpoint.pt``,
``results.json``), so ``pflalign report`` reads Flower runs too. Differences:
the checkpoint has no client states (they stay on the clients' hosts) and
``predictions.jsonl`` is not written here: every client writes its own next
to its state file (see `client_app`). ``results.json`` has an extra
``flower`` entry: the experiment id and the clients that could not be
evaluated (those are left out of ``clients`` and of the averages).

A round in which fewer than ``min-clients`` clients reply stops the run with
an error naming them; the checkpoint of the last finished round stays, and
``--run-config 'resume=true'`` (same ``out``) continues from it once the
clients' SuperNodes are back (with the same ``state-dir``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from .. import checkpoint as ckpt, export
from ..config import build_config, method_args, to_dict
from ..engine import prepare_run_dir, summarize
from ..errors import UserError
from ..methods import method_class
from ..model import FederatedLM
from . import wire
from .strategy import MethodStrategy, RoundFailed

log = logging.getLogger("flwr.pflalign")
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        run(grid, {**wire.RUN_DEFAULTS, **context.run_config})
    except UserError as exc:
        log.error("pflalign: error: %s", exc)
        raise


def run(grid: Grid, rc: dict) -> dict:
    out = Path(str(rc["out"])).expanduser().absolute()
    try:
        resuming = prepare_run_dir(out, bool(rc["resume"]), bool(rc["overwrite"]))
    except UserError as exc:  # its advice names pflalign run's flags
        raise UserError(f"{exc} (here: --run-config 'resume=true' or 'overwrite=true')") from None
    cfg = build_config(None, json.loads((out / ckpt.CONFIG).read_text())) if resuming else wire.resolve_config(rc)
    lm = FederatedLM.build(cfg.model, cfg.lora, cfg.seed, dtype=getattr(torch, cfg.dtype))
    strategy = MethodStrategy(method_class(cfg.method)(method_args(cfg)), cfg, lm.get_lora(),
                              experiment=uuid.uuid4().hex[:12], min_clients=int(rc["min-clients"]),
                              max_update_norm=float(rc["max-update-norm"]))
    del lm  # the server only needed w^0
    start = 0
    if resuming:
        saved = ckpt.load_run_checkpoint(out)
        strategy.global_params, strategy.server_state = saved["global"], saved["server_state"]
        strategy.experiment, strategy.rounds_done = saved["flower"]["experiment"], saved["flower"]["rounds_done"]
        start = saved["rounds_done"]
        metrics = ckpt.MetricsLog(out / ckpt.METRICS, resume_offset=saved["metrics_offset"])
        log.info("resuming %s after round %d of %d", out, start, cfg.rounds)
    else:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(out / ckpt.CONFIG, to_dict(cfg))
        metrics = ckpt.MetricsLog(out / ckpt.METRICS, resume_offset=0)
        save(out, strategy, 0, metrics.commit())  # resumable even if the first round fails
    strategy.summary()
    log.info("run directory %s, experiment %s", out, strategy.experiment)
    try:
        strategy.connect(grid, wait_for=strategy.num_clients, timeout=float(rc["connect-timeout"]))
        tic, done = time.perf_counter(), start
        for r in range(start, cfg.rounds):
            train_round(grid, strategy, r, float(rc["round-timeout"]), metrics)
            if cfg.eval.every and (r + 1) % cfg.eval.every == 0:
                round_eval(grid, strategy, r, float(rc["round-timeout"]), metrics)
            save(out, strategy, r + 1, metrics.commit())
            done = r + 1
        train_seconds, tic = time.perf_counter() - tic, time.perf_counter()
        results = evaluate(grid, strategy, float(rc["round-timeout"]))
        results["seconds_train_this_session"], results["seconds_eval"] = train_seconds, time.perf_counter() - tic
        metrics.write(event="eval", **{k: v for k, v in results.items() if k.startswith("avg_")})
        metrics.commit()
    except RoundFailed as exc:
        raise RoundFailed(f"{str(exc).rstrip('.')}. The checkpoint after round {done} is in {out}; once the "
                          "clients are back, continue with --run-config 'resume=true' (same out)") from None
    finally:
        metrics.close()
    export.write_run_adapters(out, cfg, strategy.global_params, {})  # the global adapter; the clients write theirs
    ckpt.write_json(out / ckpt.RESULTS, results)  # last: its presence means "finished"
    log.info("results: %s", out / ckpt.RESULTS)
    return results


def train_round(grid: Grid, strategy: MethodStrategy, r: int, timeout: float, metrics: ckpt.MetricsLog) -> None:
    """Round r (0-based), its metrics rows as the in-process engine writes them."""
    tic = time.perf_counter()
    messages = strategy.configure_train(r + 1, wire.to_record(strategy.global_params), ConfigRecord(), grid)
    strategy.aggregate_train(r + 1, grid.send_and_receive(messages, timeout=timeout))
    results, weights = strategy.results, strategy.weights
    for k, res in results:
        for t, loss in enumerate(res.losses):
            metrics.write(event="train_step", round=r, client=k, step=t, loss=loss)
        metrics.write(event="client_round", round=r, client=k, gsnr_mean=res.gsnr_mean, gsnr_ratio=res.gsnr_ratio,
                      update_norm=res.update_norm, model_norm=res.model_norm)
    losses = [loss for _, res in results for loss in res.losses]
    seconds, mean_loss = time.perf_counter() - tic, sum(losses) / len(losses)
    extra = {"missing": sorted(strategy.missing)} if strategy.missing else {}
    if strategy.rejected:
        extra["rejected"] = sorted(strategy.rejected)
    metrics.write(
        event="round", round=r, seconds=seconds, clients=[k for k, _ in results], mean_loss=mean_loss,
        consistency_update_norm=sum(w * res.update_norm for w, (_, res) in zip(weights, results)),
        consistency_model_norm=sum(w * res.model_norm for w, (_, res) in zip(weights, results)),
        bytes_to_clients=strategy.bytes_down, bytes_from_clients=strategy.bytes_up, **extra)
    log.info("round %d/%d: mean loss %.4f (%.1f s)", r + 1, strategy.cfg.rounds, mean_loss, seconds)


def round_eval(grid: Grid, strategy: MethodStrategy, r: int, timeout: float, metrics: ckpt.MetricsLog) -> None:
    """`eval.every`: the clients score their personalized and the global model on their
    first `eval.every_max_test` test examples."""
    config = ConfigRecord({"limit": strategy.cfg.eval.every_max_test or 0, "base": False, "predictions": False})
    messages = strategy.configure_evaluate(r + 1, wire.to_record(strategy.global_params), config, grid)
    strategy.aggregate_evaluate(r + 1, grid.send_and_receive(messages, timeout=timeout))
    for k, s in strategy.scores.items():
        metrics.write(event="round_eval", round=r, client=k, task=s["task"], n_test=int(s["n-test"]),
                      rouge_l_personalized=s["rouge-l-personalized"], rouge_l_global=s["rouge-l-global"])


def evaluate(grid: Grid, strategy: MethodStrategy, timeout: float) -> dict:
    """Final scores of every client that can be reached; `results.json`'s content."""
    cfg = strategy.cfg
    config = ConfigRecord({"limit": 0, "base": cfg.eval.base_model, "predictions": True})
    messages = strategy.configure_evaluate(cfg.rounds + 1, wire.to_record(strategy.global_params), config, grid)
    strategy.aggregate_evaluate(cfg.rounds + 1, grid.send_and_receive(messages, timeout=timeout))
    if not strategy.scores:
        raise UserError("no client could be evaluated: " + "; ".join(
            f"{strategy.name(k)}: {why}" for k, why in sorted(strategy.missing.items())))
    rows = [{"id": k, "task": s["task"], "n_train": int(s["n-train"]), "n_test": int(s["n-test"]),
             "rouge_l_personalized": s["rouge-l-personalized"], "rouge_l_global": s["rouge-l-global"],
             "rouge_l_base": s.get("rouge-l-base")} for k, s in strategy.scores.items()]
    results = summarize(cfg, rows, sum(int(s["truncated"]) for s in strategy.scores.values()))
    results["flower"] = {
        "experiment": strategy.experiment,
        "rounds_done": {str(k): n for k, n in sorted(strategy.rounds_done.items())},  # rounds accepted per client
        "missing_clients": [{"id": k, "task": strategy.tasks[k], "reason": why} for k, why in sorted(strategy.missing.items())],
    }
    return results


def save(out: Path, strategy: MethodStrategy, rounds_done: int, metrics_offset: int) -> None:
    ckpt.save_run_checkpoint(out, {
        "rounds_done": rounds_done,
        "global": strategy.global_params,
        "server_state": strategy.server_state,
        "metrics_offset": metrics_offset,
        "flower": {"experiment": strategy.experiment, "rounds_done": strategy.rounds_done},
    })
