"""The Flower ServerApp: the rounds of one run, written as ``pflalign run`` writes them.

Reads its run config (`wire.RUN_DEFAULTS`), builds the `pflalign.run.server.Server`
from w^0 (the seeded LoRA initialisation, as the in-process engine does) and
a `MethodStrategy` around it, waits for the SuperNodes of the first round's
clients (all N with participation 1; the seeded sample otherwise), then runs
the rounds (`train`, its loop): `configure_train`, the replies,
`collect_train`, metrics, a checkpoint. At the end every client (or
the sample of ``eval.clients``) scores its personalized, the global and the
base model on its own test split.

The run directory (``out``, on the ServerApp's host) is written by the same
`pflalign.run.lifecycle.Recorder` as ``pflalign run``'s (``config.json``,
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

import logging
import time
import uuid
from pathlib import Path

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from .. import checkpoint as ckpt, tensorboard
from ..run import export, run_dir
from ..config import make_method
from ..errors import UserError
from ..run.lifecycle import LossWatch, Recorder, client_row, results_summary, warn_at_start
from ..model import build_model
from ..run.server import RoundRecord, Server
from . import privacy as priv, quiet_progress_bars, wire
from .grid import prompt
from .strategy import MethodStrategy, RoundFailed

log = logging.getLogger("flwr.pflalign")
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        rc = wire.run_options(context.run_config)  # every value checked before the run folder is touched
        priv.from_run_config(rc)
        with run_dir.guard(Path(rc["out"]).expanduser().absolute(), rc["resume"], rc["overwrite"]):
            run(prompt(grid), rc)  # replies looked for every 0.5 s, not 3 s (grid.py)
    except UserError as exc:
        log.error("pflalign: error: %s", exc)
        raise


def run(grid: Grid, rc: dict) -> dict:
    rc = wire.run_options(rc)
    try:
        rec = Recorder(Path(rc["out"]).expanduser().absolute(), rc["resume"], rc["overwrite"],
                       rc["allow-recipe-change"])
    except UserError as exc:  # its advice names pflalign run's flags
        raise UserError(f"{exc} (here: --run-config 'resume=true' or 'overwrite=true')") from None
    cfg = rec.config(None) if rec.resuming else wire.resolve_config(rc)
    privacy = priv.from_run_config(rc)
    quiet_progress_bars()
    lm = build_model(cfg, device="cpu")
    lm.check_max_seq_len(cfg.max_seq_len)
    method = make_method(cfg)
    priv.check(privacy, method, lm.get_lora())
    names = wire.client_names(cfg)
    server = Server(method, lm.get_lora(), len(names))  # the server needs only w^0
    del lm
    strategy = MethodStrategy(server, cfg, experiment=uuid.uuid4().hex[:12], min_clients=rc["min-clients"],
                              max_update_norm=rc["max-update-norm"], max_update_ratio=rc["max-update-ratio"],
                              max_size_ratio=rc["max-size-ratio"], privacy=privacy,
                              connect_timeout=rc["connect-timeout"], names=names)
    if rec.resuming:  # the server's part as pflalign run restores it, then what only Flower keeps
        server.load_state_dict(rec.checkpoint)
        strategy.load_state_dict(rec.checkpoint["flower"])
    rec.open(cfg)
    if not rec.resuming:
        warn_at_start(cfg, method)
    rec.metrics = tensorboard.wrap(rec.metrics, cfg, rec.out, dict(enumerate(names)))  # as pflalign run
    if not rec.resuming:
        rec.save(0, checkpoint(server, strategy))  # resumable even if the first round fails
    strategy.summary()
    log.info("run directory %s, experiment %s", rec.out, strategy.experiment)
    timeout = rc["round-timeout"]
    try:
        strategy.connect(grid, strategy.clients_of_round(rec.start_round))  # the first round's clients, not all N
        tic = time.perf_counter()
        train(grid, server, strategy, rec, timeout)
        train_seconds, tic = time.perf_counter() - tic, time.perf_counter()
        results = evaluate(grid, server, strategy, timeout)
        # the global adapter; the clients write theirs
        export.write_run_adapters(rec.out, cfg, {export.GLOBAL: server.global_params}, results)
        results = rec.finish(results, train_seconds, time.perf_counter() - tic)
    except RoundFailed as exc:
        raise RoundFailed(f"{str(exc).rstrip('.')}. The checkpoint after round {rec.saved[0]} is in {rec.out}; once "
                          "the clients are back, continue with --run-config 'resume=true' (same out)") from None
    finally:
        rec.close()
    log.info("results: %s", rec.out / ckpt.RESULTS)
    return results


def train(grid: Grid, server: Server, strategy: MethodStrategy, rec: Recorder, timeout: float) -> None:
    """The rounds left, as `pflalign run` trains them (`engine.Federation.train`): a round, its
    lines, the per-round scores when ``eval.every`` says so, a checkpoint."""
    cfg = strategy.cfg
    watch = LossWatch(rec, strategy.nodes.names)
    for r in range(rec.start_round, cfg.rounds):
        tic = time.perf_counter()
        record = train_round(grid, server, strategy, r, timeout)  # the clients train, the server aggregates
        seconds = time.perf_counter() - tic
        rec.round(r, record, seconds)  # the clients' lines, then the round's
        watch.round(r, record)  # warns once if the loss runs away
        if cfg.eval.every and (r + 1) % cfg.eval.every == 0:
            rec.round_eval(r, round_eval(grid, server, strategy, r, timeout))
        rec.save(r + 1, checkpoint(server, strategy))
        log.info("round %d/%d: mean loss %.4f (%.1f s)", r + 1, cfg.rounds, record.mean_loss, seconds)


def train_round(grid: Grid, server: Server, strategy: MethodStrategy, r: int, timeout: float) -> RoundRecord:
    """Round r (0-based; Flower's server round r + 1): its record, with the round line's Flower
    fields (bytes sent and received, the clients missing or rejected)."""
    if strategy.privacy.secagg:
        outcome = strategy.train_secagg(r + 1, grid, timeout)
    else:
        messages = strategy.configure_train(r + 1, wire.to_record(server.global_params), ConfigRecord(), grid)
        outcome = strategy.collect_train(r + 1, grid.send_and_receive(messages, timeout=timeout))
    record = outcome.record
    absent = ({"missing": sorted(outcome.missing)} if outcome.missing else {}) | \
        ({"rejected": sorted(outcome.rejected)} if outcome.rejected else {})
    record.extra = {"bytes_to_clients": outcome.bytes_down, "bytes_from_clients": outcome.bytes_up, **record.extra,
                    **absent}
    return record


def round_eval(grid: Grid, server: Server, strategy: MethodStrategy, r: int, timeout: float) -> list[dict]:
    """`eval.every`: the clients score their personalized and the global model on their
    first `eval.every_max_test` test examples; a row per client (`Recorder.round_eval`)."""
    config = ConfigRecord({"limit": strategy.cfg.eval.every_max_test or 0, "base": False, "predictions": False})
    messages = strategy.configure_evaluate(r + 1, wire.to_record(server.global_params), config, grid)
    outcome = strategy.collect_evaluate(r + 1, grid.send_and_receive(messages, timeout=timeout))
    return [{"client": k, "task": s["task"], "n_test": int(s["n_test"]),
             "rouge_l_personalized": s["rouge_l_personalized"], "rouge_l_global": s["rouge_l_global"]}
            for k, s in outcome.scores.items()]


def evaluate(grid: Grid, server: Server, strategy: MethodStrategy, timeout: float) -> dict:
    """Final scores of every client that can be reached; `results.json`'s content."""
    cfg = strategy.cfg
    config = ConfigRecord({"limit": 0, "base": cfg.eval.base_model, "predictions": True})
    messages = strategy.configure_evaluate(cfg.rounds + 1, wire.to_record(server.global_params), config, grid)
    outcome = strategy.collect_evaluate(cfg.rounds + 1, grid.send_and_receive(messages, timeout=timeout))
    scores, missing = outcome.scores, outcome.missing
    if not scores:
        raise UserError("no client could be evaluated: " + "; ".join(
            f"{strategy.name(k)}: {why}" for k, why in sorted(missing.items())))
    rows = [client_row(k, s["task"], int(s["n_train"]), int(s["n_test"]), s["rouge_l_personalized"],
                       s["rouge_l_global"], s.get("rouge_l_base")) for k, s in scores.items()]
    results = results_summary(cfg, rows, sum(int(s["truncated"]) for s in scores.values()),
                              num_clients=strategy.num_clients)
    results["flower"] = strategy.results_entry(missing)
    return results


def checkpoint(server: Server, strategy: MethodStrategy) -> dict:
    """The server's part of a run, as `pflalign run` saves it (`Server.state_dict`), and Flower's
    own under ``flower``; the client states stay on the clients' hosts."""
    return {**server.state_dict(), "flower": strategy.state_dict()}
