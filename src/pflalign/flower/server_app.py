"""The Flower ServerApp: the rounds of one run, written as ``pflalign run`` writes them.

Reads its run config (`wire.RUN_DEFAULTS`), builds w^0 (the seeded LoRA
initialisation, as the in-process engine does) and a `MethodStrategy`, waits
for the SuperNodes of the first round's clients (all N with participation 1;
the seeded sample otherwise), then runs the rounds: `configure_train`, the
replies, `aggregate_train`, metrics, a checkpoint. At the end every client (or
the sample of ``eval.clients``) scores its personalized, the global and the
base model on its own test split.

The run directory (``out``, on the ServerApp's host) is written by the same
`pflalign.lifecycle.Recorder` as ``pflalign run``'s (``config.json``,
``metrics.jsonl``, ``checkpoint.pt``, ``results.json``), so ``pflalign
report`` reads Flower runs too. Differences:
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

import dataclasses
import logging
import time
import uuid
from pathlib import Path

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from .. import checkpoint as ckpt, export, run_dir, tensorboard
from ..config import make_method
from ..errors import UserError
from ..lifecycle import Recorder, client_row, results_summary
from ..model import build_model
from . import privacy as priv, quiet_progress_bars, wire
from .grid import prompt
from .strategy import MethodStrategy, RoundFailed

log = logging.getLogger("flwr.pflalign")
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        rc = {**wire.RUN_DEFAULTS, **context.run_config}
        with run_dir.guard(Path(str(rc["out"])).expanduser().absolute(), bool(rc["resume"]), bool(rc["overwrite"])):
            run(prompt(grid), rc)  # replies looked for every 0.5 s, not 3 s (grid.py)
    except UserError as exc:
        log.error("pflalign: error: %s", exc)
        raise


def run(grid: Grid, rc: dict) -> dict:
    try:
        rec = Recorder(Path(str(rc["out"])).expanduser().absolute(), bool(rc["resume"]), bool(rc["overwrite"]))
    except UserError as exc:  # its advice names pflalign run's flags
        raise UserError(f"{exc} (here: --run-config 'resume=true' or 'overwrite=true')") from None
    cfg = rec.config(None) if rec.resuming else wire.resolve_config(rc)
    privacy = priv.from_run_config(rc)
    quiet_progress_bars()
    lm = build_model(cfg, device="cpu")
    lm.check_max_seq_len(cfg.max_seq_len)
    method = make_method(cfg)
    priv.check(privacy, method, lm.get_lora())
    strategy = MethodStrategy(method, cfg, lm.get_lora(),  # the server needs only w^0
                              experiment=uuid.uuid4().hex[:12], min_clients=int(rc["min-clients"]),
                              max_update_norm=float(rc["max-update-norm"]),
                              max_update_ratio=float(rc["max-update-ratio"]),
                              max_size_ratio=float(rc["max-size-ratio"]), privacy=privacy,
                              connect_timeout=float(rc["connect-timeout"]))
    del lm
    if rec.resuming:
        saved = rec.checkpoint
        strategy.global_params, strategy.server_state = saved["global"], saved["server_state"]
        strategy.experiment, strategy.rounds_done = saved["flower"]["experiment"], saved["flower"]["rounds_done"]
        strategy.noise_std = saved["flower"].get("noise_std", {})
        strategy.n_train = saved["flower"].get("n_train", {})  # the sizes clients declared first
        priv.check_resume(saved["flower"].get("privacy"), privacy)
    rec.open(cfg)
    rec.metrics = tensorboard.wrap(rec.metrics, cfg, rec.out,  # log.tensorboard, as pflalign run
                                   dict(enumerate(strategy.nodes.names)))
    if not rec.resuming:
        rec.save(0, checkpoint(strategy))  # resumable even if the first round fails
    strategy.summary()
    log.info("run directory %s, experiment %s", rec.out, strategy.experiment)
    timeout = float(rc["round-timeout"])

    def after(r, mean_loss, seconds):
        log.info("round %d/%d: mean loss %.4f (%.1f s)", r + 1, cfg.rounds, mean_loss, seconds)

    try:
        strategy.connect(grid, strategy.clients_of_round(rec.start_round))  # the first round's clients, not all N
        tic = time.perf_counter()
        rec.train(cfg, rec.start_round, cfg.rounds, lambda r: train_round(grid, strategy, r, timeout, rec),
                  lambda r: round_eval(grid, strategy, r, timeout, rec), lambda: checkpoint(strategy), after)
        train_seconds, tic = time.perf_counter() - tic, time.perf_counter()
        results = evaluate(grid, strategy, timeout)
        export.write_run_adapters(rec.out, cfg, {export.GLOBAL: strategy.global_params}, results)  # the global adapter; the clients write theirs
        results = rec.finish(results, train_seconds, time.perf_counter() - tic)
    except RoundFailed as exc:
        raise RoundFailed(f"{str(exc).rstrip('.')}. The checkpoint after round {rec.saved[0]} is in {rec.out}; once "
                          "the clients are back, continue with --run-config 'resume=true' (same out)") from None
    finally:
        rec.close()
    log.info("results: %s", rec.out / ckpt.RESULTS)
    return results


def train_round(grid: Grid, strategy: MethodStrategy, r: int, timeout: float, rec: Recorder):
    """Round r (0-based; Flower's server round r + 1): the clients' lines, as the in-process
    engine writes them; the round's record for its line."""
    if strategy.privacy.secagg:
        outcome = strategy.train_secagg(r + 1, grid, timeout)
    else:
        messages = strategy.configure_train(r + 1, wire.to_record(strategy.global_params), ConfigRecord(), grid)
        outcome = strategy.collect_train(r + 1, grid.send_and_receive(messages, timeout=timeout))
    record = outcome.record
    for k, res in zip(record.clients, record.results):
        for t, loss in enumerate(res.losses):
            rec.train_step(r, k, t, loss)
        rec.client_round(r, k, res)
    if outcome.missing:
        record.extra["missing"] = sorted(outcome.missing)
    if outcome.rejected:
        record.extra["rejected"] = sorted(outcome.rejected)
    record.extra = {"bytes_to_clients": outcome.bytes_down, "bytes_from_clients": outcome.bytes_up, **record.extra}
    return record


def round_eval(grid: Grid, strategy: MethodStrategy, r: int, timeout: float, rec: Recorder) -> None:
    """`eval.every`: the clients score their personalized and the global model on their
    first `eval.every_max_test` test examples."""
    config = ConfigRecord({"limit": strategy.cfg.eval.every_max_test or 0, "base": False, "predictions": False})
    messages = strategy.configure_evaluate(r + 1, wire.to_record(strategy.global_params), config, grid)
    outcome = strategy.collect_evaluate(r + 1, grid.send_and_receive(messages, timeout=timeout))
    for k, s in outcome.scores.items():
        rec.round_eval(r, k, s["task"], int(s["n_test"]), s["rouge_l_personalized"], s["rouge_l_global"])


def evaluate(grid: Grid, strategy: MethodStrategy, timeout: float) -> dict:
    """Final scores of every client that can be reached; `results.json`'s content."""
    cfg = strategy.cfg
    config = ConfigRecord({"limit": 0, "base": cfg.eval.base_model, "predictions": True})
    messages = strategy.configure_evaluate(cfg.rounds + 1, wire.to_record(strategy.global_params), config, grid)
    outcome = strategy.collect_evaluate(cfg.rounds + 1, grid.send_and_receive(messages, timeout=timeout))
    scores, missing = outcome.scores, outcome.missing
    if not scores:
        raise UserError("no client could be evaluated: " + "; ".join(
            f"{strategy.name(k)}: {why}" for k, why in sorted(missing.items())))
    rows = [client_row(k, s["task"], int(s["n_train"]), int(s["n_test"]), s["rouge_l_personalized"],
                       s["rouge_l_global"], s.get("rouge_l_base")) for k, s in scores.items()]
    results = results_summary(cfg, rows, sum(int(s["truncated"]) for s in scores.values()),
                              num_clients=strategy.num_clients)
    results["flower"] = {
        "experiment": strategy.experiment,
        "rounds_done": {str(k): n for k, n in sorted(strategy.rounds_done.items())},  # rounds accepted per client
        "missing_clients": [{"id": k, "task": strategy.nodes.names[k], "reason": why}
                            for k, why in sorted(missing.items())],
    }
    # the noise each round's mean got (also in that round's metrics.jsonl line), and the (ε, δ) it gives
    report = strategy.privacy.report([strategy.noise_std.get(r) for r in range(cfg.rounds)])
    if report:
        results["flower"]["privacy"] = report
    return results


def checkpoint(strategy: MethodStrategy) -> dict:
    """The server's part of a run (the client states stay on the clients' hosts)."""
    return {"global": strategy.global_params, "server_state": strategy.server_state,
            "flower": {"experiment": strategy.experiment, "rounds_done": strategy.rounds_done,
                       "noise_std": strategy.noise_std, "n_train": strategy.n_train,
                       "privacy": dataclasses.asdict(strategy.privacy)}}
