"""`MethodStrategy`: a Flower strategy that runs one of our methods' server rule.

It runs the in-process engine's server: a `pflalign.run.server.Server` (the
method, the global adapter w^r and the method's server state: SCAFFOLD's c,
FedDyn's h, FedOpt's moments), which the ServerApp builds, restores and hands
it; besides it holds what only a Flower run has: per client, how many rounds
it has finished and the |D_k| it declared, and the DP noise of each round
(`state_dict` / `load_state_dict`: the checkpoint's ``flower`` entry). Which
SuperNode is which client (their node config's ``partition-id``, asked with a
``query`` message) is its `Nodes`' business (nodes.py); matching and checking the replies is
`replies.ReplyChecks`' (replies.py, over validate.py's checks).

* `configure_train`: the round's participants are `lifecycle.sample_clients`
  (the same seeded sample); each is sent w^r and ``method.broadcast(...)``.
* `collect_train` (`aggregate_train` for Flower's interface): the replies in
  client order, aggregated by the server (`Server.start_round` with |D_k|
  over the clients whose replies passed the checks, fed one decoded update
  at a time, `Server.finish_round`) and returned as a `TrainOutcome` that
  holds w^{r+1}. A client that did not reply (node gone, error,
  timeout) is logged by name and left out, as long as at least
  ``min-clients`` replied (0: all sampled clients); otherwise `RoundFailed`.
  A reply whose update fails the checks of `validate` (names, shapes, dtypes,
  finite values, the ``max-update-norm`` bound) is rejected, logged with its
  SuperNode id and left out too; so is one whose declared |D_k| exceeds
  ``max-size-ratio`` times the round's median declared size (its weight would
  swamp the others'; `validate.oversized`); clients are not trusted.
* `configure_evaluate` / `collect_evaluate` (`aggregate_evaluate`): every
  client (or the seeded sample of ``eval.clients``, as in process) scores its
  personalized model, the global model (and the base model), returned as an
  `EvalOutcome`.

Before each of them the strategy looks for new SuperNodes and waits for the
clients the round needs (its sample) that have never connected, until
``connect-timeout`` after the start of the run; a sampled client that has no
SuperNode then counts as missing.

The ServerApp drives these hooks itself rather than with ``Strategy.start``,
so that every round is checkpointed and a run can resume.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..run.client import ClientRound
from ..config import RunConfig
from ..errors import UserError
from ..run.lifecycle import eval_clients, sample_clients
from ..params import Params
from ..run.server import RoundPlan, RoundRecord, Server
from . import privacy as priv, replies as checks, validate, wire
from .nodes import Nodes

log = logging.getLogger("flwr.pflalign")


class RoundFailed(UserError):
    """Fewer clients replied to a round than the configured minimum."""


@dataclass
class TrainOutcome:
    """What a training round gave: the aggregated clients' replies and who is absent, and why."""

    record: RoundRecord  # w^{r+1}; the accepted replies (client order), their weights
    missing: dict[int, str] = field(default_factory=dict)  # sampled clients without a reply → why
    rejected: dict[int, str] = field(default_factory=dict)  # replies that failed `validate` → why
    bytes_down: int = 0  # the round's tensor payload to the clients
    bytes_up: int | None = 0  # and from them (None: not counted, under SecAgg+)


@dataclass
class EvalOutcome:
    """What an evaluation gave: each replying client's scores, and who is absent, and why."""

    scores: dict[int, dict]
    missing: dict[int, str]


def client_round(metrics: dict) -> ClientRound:
    """A checked training reply's metrics as the client's round, for the metrics lines (its update
    goes to the server's sums, not here)."""
    m = metrics
    return ClientRound(message={}, personalized=None, losses=list(m["losses"]), gsnr_mean=m.get("gsnr_mean"),
                       gsnr_ratio=m.get("gsnr_ratio"), update_norm=m["update_norm"], model_norm=m["model_norm"],
                       method_metrics=wire.method_metrics(m))


class MethodStrategy(Strategy):
    def __init__(self, server: Server, cfg: RunConfig, experiment: str,
                 min_clients: int = 0, query_timeout: float = 120.0, max_update_norm: float = 0.0,
                 max_update_ratio: float = wire.RUN_DEFAULTS["max-update-ratio"],
                 max_size_ratio: float = wire.RUN_DEFAULTS["max-size-ratio"],
                 privacy: priv.Privacy = priv.Privacy(),
                 connect_timeout: float = wire.RUN_DEFAULTS["connect-timeout"], names: list[str] | None = None):
        self.server, self.method, self.cfg, self.experiment = server, server.method, cfg, experiment
        self.privacy = privacy  # DP and SecAgg+ (privacy.py); checked against the method by the ServerApp
        self.dtype = next(iter(server.global_params.values())).dtype
        # the clients' names (`wire.client_names`; the ServerApp passes those it read for the server's N)
        self.nodes = Nodes(names if names is not None else wire.client_names(cfg), query_timeout)
        self.min_clients = min_clients
        # a client that has never had a SuperNode is waited for until connect-timeout after the first `connect`
        self.connect_timeout = connect_timeout
        # what a reply must look like and the bounds it is held to: max_update_norm (0: no bound),
        # max_update_ratio (x the global model's norm), max_size_ratio (a declared n_train / n_test x
        # the round's median; 0: no bound)
        self.checks = checks.ReplyChecks(validate.expected_message(server.method, server.global_params),
                                         cfg.local_steps, cfg.lr, max_update_norm, max_update_ratio, max_size_ratio)
        self.rounds_done: dict[int, int] = {}  # client → rounds it finished (saved in the checkpoint)
        self.noise_std: dict[int, float] = {}  # round → the DP noise's standard deviation (saved too)
        self.n_train: dict[int, int] = {}  # client → |D_k|, as the clients report it (saved in the checkpoint)
        # between a configure_* hook and its collect_*: the messages sent and their clients, and
        # the clients not even sent one (no SuperNode) → why
        self._pending: list[tuple[Message, int]] = []
        self._unreached: dict[int, str] = {}

    # ---- checkpoint (its ``flower`` entry; the server's part is `Server.state_dict`) -----------
    def state_dict(self) -> dict:
        return {"experiment": self.experiment, "rounds_done": self.rounds_done, "noise_std": self.noise_std,
                "n_train": self.n_train, "privacy": asdict(self.privacy)}

    def results_entry(self, missing: dict[int, str]) -> dict:
        """results.json's ``flower`` entry: the experiment, the rounds accepted per client, the
        clients not scored (`missing`: client → why) and, under DP, the (ε, δ) that the noise
        each round's mean got (also in that round's metrics line) gives."""
        entry = {
            "experiment": self.experiment,
            "rounds_done": {str(k): n for k, n in sorted(self.rounds_done.items())},
            "missing_clients": [{"id": k, "task": self.nodes.names[k], "reason": why}
                                for k, why in sorted(missing.items())],
        }
        report = self.privacy.report([self.noise_std.get(r) for r in range(self.cfg.rounds)])
        if report:
            entry["privacy"] = report
        return entry

    def load_state_dict(self, saved: dict) -> None:
        """Back to a checkpoint's `state_dict`; refused (`privacy.check_resume`) when the run's
        privacy options differ from the checkpoint's."""
        priv.check_resume(saved.get("privacy"), self.privacy)
        self.experiment, self.rounds_done = saved["experiment"], saved["rounds_done"]
        self.noise_std = saved.get("noise_std", {})
        self.n_train = saved.get("n_train", {})  # the sizes clients declared first

    @property
    def num_clients(self) -> int:
        return len(self.nodes.names)

    def name(self, k: int) -> str:
        return self.nodes.name(k)

    def summary(self) -> None:
        log.info("pflalign %s: %s, participation %g, %d rounds x %d local steps, min-clients %s",
                 self.cfg.method, wire.describe_clients(self.nodes.names), self.cfg.participation,
                 self.cfg.rounds, self.cfg.local_steps, self.min_clients or "all")
        checks = self.checks
        bound = {k: f"{v:g}" if v else "off" for k, v in (("max-update-norm", checks.max_update_norm),
                                                          ("max-update-ratio", checks.max_update_ratio),
                                                          ("max-size-ratio", checks.max_size_ratio))}
        log.info("replies checked: %s", ", ".join(f"{k} {v}" for k, v in bound.items()))
        if not checks.max_size_ratio:
            log.warning("max-size-ratio=0: the bound on the sizes clients declare is off; one reply claiming a "
                        "huge n_train takes nearly the whole aggregation weight (docs/distributed.md)")
        if not checks.max_update_ratio:
            log.warning("max-update-ratio=0: updates are not bounded relative to the global model's norm "
                        "(docs/distributed.md)")

    def clients_of_round(self, r: int) -> list[int]:
        """Round r's participants (0-based; the seeded sample, `lifecycle.sample_clients`, the
        in-process engine's); r = rounds: the clients scored at the end (`eval_clients`)."""
        if r >= self.cfg.rounds:
            return eval_clients(self.num_clients, self.cfg.eval.clients, self.cfg.seed)
        return sample_clients(self.num_clients, self.cfg.participation, self.cfg.seed, r)

    def connect(self, grid: Grid, need: Iterable[int] = ()) -> dict[int, str]:
        """Pick up new and restarted SuperNodes, forget gone ones, and wait for the clients of
        `need` that have never had a SuperNode, until connect-timeout after the first call
        (the start of the run): a Flower run waits for the clients a round samples, not for
        all N. Returns the clients of `need` without a SuperNode → why (they count as missing)."""
        return self.nodes.wait(grid, need, self.connect_timeout)

    # ---- messages and their replies -------------------------------------------------
    def _messages(self, clients: Iterable[int], content_of, message_type: str, server_round: int) -> list[Message]:
        self._pending = [(Message(content_of(k), self.nodes.of[k], message_type, group_id=str(server_round)), k)
                         for k in clients]
        return [msg for msg, _ in self._pending]

    def _match(self, replies: Iterable[Message]) -> tuple[dict[int, Message], dict[int, str]]:
        """Replies by client, and the clients without a good reply → why (with the unreached ones)."""
        return checks.match(self._pending, self._unreached, replies, self.name)

    def _config(self, k: int, **extra) -> ConfigRecord:
        # done: the client's rounds this server has accepted; the client starts from its state after them
        return ConfigRecord({"cfg": wire.config_json(self.cfg), "experiment": self.experiment,
                             "done": self.rounds_done.get(k, 0), **extra})

    # ---- training -------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        r = server_round - 1
        chosen = self.clients_of_round(r)
        self._unreached = self.connect(grid, chosen)
        broadcast = wire.pack(wire.BROADCAST, self.server.broadcast())
        dp = {priv.KEY_CLIPPING_NORM: self.privacy.clipping_norm} if self.privacy.dp else {}  # fixedclipping_mod's
        return self._messages(
            [k for k in chosen if k in self.nodes.of],
            lambda k: RecordDict({wire.GLOBAL: arrays, **broadcast, "config": self._config(k, round=r, **dp)}),
            MessageType.TRAIN, server_round)

    def collect_train(self, server_round: int, replies: Iterable[Message]) -> TrainOutcome:
        """Round `server_round`'s replies, checked and aggregated by the server into w^{r+1}."""
        r = server_round - 1
        sampled = len(self._pending) + len(self._unreached)
        bytes_down = sum(wire.payload_bytes(msg.content) for msg, _ in self._pending)
        got, missing = self._match(replies)
        bytes_up = sum(wire.payload_bytes(reply.content) for reply in got.values())
        for k in sorted(missing):
            log.warning("round %d: %s is missing: %s", server_round, self.name(k), missing[k])
        need = sampled if self.min_clients <= 0 else min(self.min_clients, sampled)
        if len(got) < need:
            raise RoundFailed(
                f"round {server_round}: {len(got)} of {sampled} clients replied, fewer than "
                f"min-clients={self.min_clients or 'all'}; missing: "
                + "; ".join(f"{self.name(k)}: {why}" for k, why in sorted(missing.items())))
        accepted, rejected = self.checks.train_round(got, self.n_train, self._reference())
        for k in sorted(rejected):
            log.warning("round %d: rejected the update of %s from SuperNode %d: %s", server_round,
                        self.name(k), got[k].metadata.src_node_id, rejected[k])
        results = {k: client_round(m) for k, m in sorted(accepted.items()) if k not in rejected}
        self.n_train.update({k: accepted[k]["n_train"] for k in results})
        if len(results) < max(1, min(self.min_clients, sampled)):  # rejected ones do not count
            raise RoundFailed(f"round {server_round}: " + ("no valid update to aggregate" if not results else
                              f"{len(results)} valid updates, fewer than min-clients={self.min_clients}")
                              + "; rejected: "
                              + "; ".join(f"{self.name(k)}: {why}" for k, why in sorted(rejected.items())))
        ids = list(results)
        # the weights are known once every reply is checked; with DP the rule runs on the noised mean
        plan = self.server.start_round(r, ids, [self.n_train[k] for k in ids], presummed=self.privacy.dp)

        def fed(running):  # the accepted updates added in client order, one decoded at a time
            for i, k in enumerate(ids):
                running.add(i, self._decode(got[k].content))
            return running

        extra = {}
        if self.privacy.dp:  # the method's rule on the noised mean (privacy.py says why there)
            mean = fed(priv.WeightedMean(plan.weights)).result()
            extra["dp_noise_std"] = self.noise_std[r] = priv.add_noise(self.privacy, mean, plan.weights)
            plan.add(0, mean)
        else:
            fed(plan)
        return TrainOutcome(self._finish(plan, results, extra), missing, rejected, bytes_down, bytes_up)

    def train_secagg(self, server_round: int, grid: Grid, timeout: float) -> TrainOutcome:
        """Round `server_round` with Flower's SecAgg+ (`privacy.secagg_round`): the sampled
        clients' uploads are summed under masks, the server gets their data-weighted mean and
        each client's metrics, and the method's rule runs on that mean (plus DP noise when on).
        An upload cannot be checked or left out once it is in the sum: a client whose metrics
        are malformed, or whose |D_k| exceeds ``secagg-max-weight`` (its weight would not be
        quantized faithfully), fails the round."""
        r = server_round - 1
        chosen = self.clients_of_round(r)
        missing = self.connect(grid, chosen)
        clients = [k for k in chosen if k in self.nodes.of]
        need = len(chosen) if self.min_clients <= 0 else min(self.min_clients, len(chosen))
        if len(clients) < max(2, need):
            raise RoundFailed(f"round {server_round}: SecAgg+ needs at least 2 clients (and min-clients="
                              f"{self.min_clients or 'all'}); {len(clients)} of {len(chosen)} connected")
        names = list(self.server.global_params)
        parameters = priv.to_parameters(self.server.global_params.values())
        fitins = {self.nodes.of[k]: priv.FitIns(parameters, priv.fit_config(self._config(k, round=r), names,
                                                                            self.privacy))
                  for k in clients}
        client_of = {self.nodes.of[k]: k for k in clients}
        mean, replies, failures = priv.secagg_round(self.privacy, grid, server_round, fitins, timeout)
        got = {client_of[node]: res for node, res in replies if node in client_of}
        for k in clients:
            if k not in got:
                missing[k] = "it dropped out of the SecAgg+ protocol (see the ServerApp log)"
        for k in sorted(missing):
            log.warning("round %d: %s is missing: %s", server_round, self.name(k), missing[k])
        if mean is None or len(got) < need:
            raise RoundFailed(f"round {server_round}: secure aggregation over {len(got)} of {len(chosen)} "
                              f"clients (min-clients={self.min_clients or 'all'}) did not finish; missing: "
                              + "; ".join(f"{self.name(k)}: {why}" for k, why in sorted(missing.items())))
        metrics, bad = self.checks.secagg_metrics(got, self.n_train, self.privacy.max_weight)
        if bad:  # its upload is already in the sum: the round cannot go on without it
            k = min(bad)
            raise RoundFailed(f"round {server_round}: {self.name(k)} sent malformed metrics under SecAgg+ "
                              f"(its upload cannot be left out of the sum): {bad[k]}")
        self.n_train.update({k: got[k].num_examples for k in metrics})
        results = {k: client_round(m) for k, m in metrics.items()}
        ids = list(results)
        try:
            average = priv.unflatten(mean, self.checks.expected)
        except UserError as exc:
            raise RoundFailed(f"round {server_round}: {exc}") from None
        reason = validate.validate_update(average, self.checks.expected)
        if reason:
            raise RoundFailed(f"round {server_round}: the secure aggregate is unusable: {reason}")
        average = {g: {n: t.to(self.dtype) for n, t in ts.items()} for g, ts in average.items()}
        # the method's rule on the secure (and, with DP, noised) mean of the uploads
        plan = self.server.start_round(r, ids, [self.n_train[k] for k in ids], presummed=True)
        extra = {"secagg": True}
        if self.privacy.dp:
            extra["dp_noise_std"] = self.noise_std[r] = priv.add_noise(self.privacy, average, plan.weights)
        plan.add(0, average)
        record = self._finish(plan, results, extra)
        # down: w^r in each FitIns; up: not counted (masked vectors travel in ConfigRecords)
        return TrainOutcome(record, missing, {}, sum(len(b) for b in parameters.tensors) * len(clients), None)

    def _finish(self, plan: RoundPlan, results: dict[int, ClientRound], extra: dict) -> RoundRecord:
        """The server's w^{r+1} and the round's record; each aggregated client has a round more done."""
        record = self.server.finish_round(plan, list(results.values()), extra)
        for k in record.clients:
            self.rounds_done[k] = self.rounds_done.get(k, 0) + 1
        return record

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord, MetricRecord]:
        """Flower's hook: `collect_train`, as records."""
        outcome = self.collect_train(server_round, replies)
        losses = [loss for res in outcome.record.results for loss in res.losses]
        return wire.to_record(outcome.record.global_params), MetricRecord({"mean_loss": sum(losses) / len(losses)})

    def _reference(self) -> dict[str, Params]:
        """w^r for each of the method's weight groups: what an update's ratio bound is measured against."""
        return {g: self.server.global_params for g in self.method.weight_groups}

    def _accept(self, content: RecordDict, k: int | None = None) -> dict:
        """A training reply's metrics once it passes the checks (`ReplyChecks.train_reply`)."""
        return self.checks.train_reply(content, self.n_train.get(k), self._reference())

    def _decode(self, content: RecordDict) -> dict[str, Params]:
        """An accepted reply's update (`_accept`), cast to the adapter's dtype."""
        return checks.decode(content, self.dtype)

    # ---- evaluation -----------------------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """`config`: ``limit`` (test examples per client, 0: all), ``base`` (also the base
        model), ``predictions`` (clients write their generations next to their state)."""
        scored = self.clients_of_round(self.cfg.rounds)  # all, or the seeded sample of eval.clients
        self._unreached = self.connect(grid, scored)
        clients = [k for k in scored if k in self.nodes.of]
        return self._messages(clients, lambda k: RecordDict({wire.GLOBAL: arrays, "config": self._config(k, **config)}),
                              MessageType.EVALUATE, server_round)

    def collect_evaluate(self, server_round: int, replies: Iterable[Message]) -> EvalOutcome:
        got, missing = self._match(replies)
        scores, rejected = self.checks.eval_replies(got, self.n_train)
        missing.update(rejected)
        for k in sorted(missing):
            log.warning("evaluation: %s is missing: %s", self.name(k), missing[k])
        return EvalOutcome(scores, missing)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord:
        """Flower's hook: `collect_evaluate`, averaged."""
        scores = self.collect_evaluate(server_round, replies).scores
        out = {}
        for key in ("rouge_l_personalized", "rouge_l_global"):
            values = [s[key] for s in scores.values()]
            if values:
                out[key] = sum(values) / len(values)
        return MetricRecord(out)
