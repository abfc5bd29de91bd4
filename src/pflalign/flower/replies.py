"""The SuperNodes' replies, matched to the messages they answer and checked: clients are not trusted.

`match` says which reply is whose (and which client has none, and why); `ReplyChecks` applies
`validate`'s checks to a round's replies: a training reply's records, metrics and update (one
reply at a time: `train_reply`), the declared sizes against each other (`train_round`), the
metrics of replies already summed under SecAgg+ (`secagg_metrics`) and an evaluation's scores
(`eval_replies`). What fails is left out with the reason, never aggregated; the strategy logs it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flwr.app import Message, RecordDict

from ..errors import TrainingDiverged
from ..params import Params
from . import validate, wire


def match(pending: list[tuple[Message, int]], unreached: dict[int, str], replies: Iterable[Message],
          name: Callable[[int], str]) -> tuple[dict[int, Message], dict[int, str]]:
    """Replies by client, and the clients without a good reply → why (`unreached` included):
    an error reply, or none before the timeout. A client whose training diverged stops the run."""
    by_id = {msg.metadata.message_id: k for msg, k in pending}
    got, missing = {}, dict(unreached)
    for reply in replies:
        k = by_id.get(reply.metadata.reply_to_message_id)
        if k is None:
            continue
        if reply.has_error():
            if "TrainingDiverged" in reply.error.reason:
                raise TrainingDiverged(f"{name(k)}: {reply.error.reason}")
            missing[k] = readable(reply.error.reason)
        else:
            got[k] = reply
    for _, k in pending:
        if k not in got and k not in missing:
            missing[k] = "no reply before the timeout"
    return got, missing


def readable(reason: str) -> str:
    """A ClientApp's exception as Flower words its error reply ("<class 'pkg.Error'>:<'text'>") in one
    line, "Error: text"; any other reason as it is."""
    match_ = re.fullmatch(r"<class '(?:[\w.]+\.)?(\w+)'>:<'(.*)'>", reason.strip(), flags=re.S)
    if not match_:
        return reason
    name, text = match_.groups()
    return f"{name}: {text}" if text else name


def decode(content: RecordDict, dtype) -> dict[str, Params]:
    """An accepted training reply's update, cast to the adapter's dtype."""
    return {g: {n: t.to(dtype) for n, t in ts.items()} for g, ts in wire.unpack(content, wire.MESSAGE, dtype=None).items()}


@dataclass
class ReplyChecks:
    """The bounds a reply is held to (the run config's ``max-update-norm``, ``max-update-ratio``,
    ``max-size-ratio``; 0: that bound off) and what the method's message must look like."""

    expected: validate.Expected  # `validate.expected_message`
    local_steps: int
    lr: float
    max_update_norm: float = 0.0
    max_update_ratio: float = wire.RUN_DEFAULTS["max-update-ratio"]
    max_size_ratio: float = wire.RUN_DEFAULTS["max-size-ratio"]

    def train_reply(self, content: RecordDict, declared: int | None, reference: dict[str, Params]) -> dict:
        """A training reply's metrics, once the reply passes `validate` (`declared`: the client's
        first declared n_train; `reference`: w^r per weight group, for the update-ratio bound);
        else `validate.InvalidUpdate` saying why. Its decoded update is dropped (`decode` decodes it
        again when it is aggregated: the round never holds every decoded update at once)."""
        try:
            update = wire.unpack(content, wire.MESSAGE, dtype=None)
            metrics = dict(content.metric_records["metrics"])
        except Exception as exc:  # whatever a malformed record raises while it is decoded
            raise validate.InvalidUpdate(f"cannot decode the reply ({type(exc).__name__}: {exc})") from None
        reason = (validate.validate_records(content.array_records, self.expected, wire.MESSAGE)
                  or validate.validate_train_metrics(metrics, self.local_steps, declared)
                  or validate.validate_update(update, self.expected, self.max_update_norm, reference,
                                              self.max_update_ratio, self.lr * self.local_steps))
        if reason:
            raise validate.InvalidUpdate(reason)
        return metrics

    def train_round(self, got: dict[int, Message], n_train: dict[int, int],
                    reference: dict[str, Params]) -> tuple[dict[int, dict], dict[int, str]]:
        """The metrics of every reply that passes `train_reply`, and the rejected clients → why;
        then the declared sizes against each other, once every reply's own checks are done (a
        rejected client may still appear among the accepted metrics: the caller leaves it out)."""
        accepted, rejected = {}, {}
        for k in sorted(got):
            try:
                accepted[k] = self.train_reply(got[k].content, n_train.get(k), reference)
            except validate.InvalidUpdate as exc:  # untrusted input: left out, the round goes on
                rejected[k] = str(exc)
        rejected.update(validate.oversized({k: m["n_train"] for k, m in accepted.items()}, self.max_size_ratio))
        return accepted, rejected

    def secagg_metrics(self, got: dict, n_train: dict[int, int], max_weight: float) -> tuple[dict[int, dict], dict[int, str]]:
        """The metrics of SecAgg+ replies (Flower FitRes by client), and the clients whose metrics
        fail the checks → why. Their uploads are already in the sum, so the caller fails the round."""
        too_large = validate.oversized({k: res.num_examples for k, res in got.items()}, self.max_size_ratio)
        metrics, bad = {}, {}
        for k in sorted(got):
            m = {key: json.loads(v) if key == "losses" else v for key, v in got[k].metrics.items()}
            n = got[k].num_examples
            reason = validate.validate_train_metrics({**m, "n_train": n}, self.local_steps, n_train.get(k))
            if not reason and n > max_weight:
                reason = f"n_train {n} exceeds secagg-max-weight={max_weight:g}"
            reason = reason or too_large.get(k)
            if reason:
                bad[k] = reason
            else:
                metrics[k] = m
        return metrics, bad

    def eval_replies(self, got: dict[int, Message], n_train: dict[int, int]) -> tuple[dict[int, dict], dict[int, str]]:
        """Each evaluation reply's scores (with its task), and the clients rejected → why: malformed
        metrics, an n_train above the one declared in training, or counts that swamp the others'
        (results.json's weighted means use n_train)."""
        scores, missing = {}, {}
        for k in sorted(got):
            try:
                reply = {**dict(got[k].content.metric_records["metrics"]),
                         "task": got[k].content.config_records["info"]["task"]}
            except Exception as exc:  # a malformed reply: that client is left out
                reply = {"error": f"cannot decode the reply ({type(exc).__name__}: {exc})"}
            reason = reply.get("error") or validate.validate_eval_metrics(reply)
            if not reason and reply["n_train"] > n_train.get(k, reply["n_train"]):
                reason = (f"metric 'n_train' is {reply['n_train']}, more than the {n_train[k]} the client "
                          "declared in training")
            if reason:
                missing[k] = f"evaluation rejected: {reason} (SuperNode {got[k].metadata.src_node_id})"
            else:
                scores[k] = reply
        for what in ("n_train", "n_test"):
            for k, why in validate.oversized({k: s[what] for k, s in scores.items()}, self.max_size_ratio,
                                             what).items():
                missing[k] = f"evaluation rejected: {why} (SuperNode {got[k].metadata.src_node_id})"
                del scores[k]
        return scores, missing
