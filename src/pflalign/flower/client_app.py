"""The Flower ClientApp: one federated client, on its own SuperNode.

Which client a node is comes from its node config: ``partition-id`` k (the
k-th client of the run's clients, `pflalign.data.clients`: the k-th
category of ``data.clients``, or client k of ``data.partition``'s split)
and ``num-partitions`` (must equal the number of clients). Optional
node-config keys: ``data-dir`` (the dataset on this host; replaces
``data.dir``) and ``state-dir`` (see below). Client k computes its own share
from the run's configuration and its host's data, with the same code as
``pflalign run`` (`pflalign.run.data_cache.client_data`, `pflalign.data.clients`):
the same examples in the same order as client k in process.

Three message types, all answered from this one module:

* ``query``: which client am I (partition-id, num-partitions); nothing is loaded.
* ``train``: one round. Builds the model and this client's data, loads its
  state, runs `pflalign.run.client.train_client` (the one client-side
  implementation, which the in-process engine runs too: the same minibatches,
  the same steps), saves the state and sends back only the method's message
  plus metrics.
* ``evaluate``: ROUGE-L of its personalized model, of the global model it is
  sent and of the base model, on its own test split (`pflalign.run.client.score_client`);
  the generations are written next to its state, only the scores are sent.

Client state: the method's per-client `State`, the personalized adapter and
the data sampler's position (``steps_taken``) are kept in files on this host,
``<state-dir>/<experiment>/client-<k>/round-<n>.pt``: the state after the
client's n-th round. The server tells the client, with every message, how
many of its rounds it has accepted (n); the client starts from
``round-<n>.pt`` (n = 0: a fresh state from w^0) and writes
``round-<n+1>.pt``. A round the server did not accept (a lost reply, a failed
round) is thus forgotten, exactly as in the in-process engine, and a resumed
run continues from the right state. The two newest files are kept; the
newest holds the client's personalized adapter. ``state-dir`` is the node
config's ``state-dir``, else the run config's ``client-dir``, else
``$PFLALIGN_CACHE/flower`` (``~/.cache/pflalign/flower``); ``experiment`` is
an id the ServerApp draws for a run and keeps across ``resume``. Files
rather than Flower's ``Context.state``: they survive a SuperNode restart and
a resumed run, and they leave the personalized adapter on the client's
host. Nothing of them leaves the host.

Within one process (the Simulation Engine's Ray actors) the model and the
client's tokenized data are built once and reused across messages. Across
processes (the Deployment Engine starts one per message) they come from the
host's caches: the model's de-quantized safetensors copy, memory-mapped
(`pflalign.model.model_cache`), and this client's examples with their token ids
(`pflalign.run.data_cache`); on a miss a process loads client k's category alone,
or makes the partition once (it needs the whole table) and keeps it for
the other clients it serves. Its first
train message logs how long after the process started its first local step
began, and the CPU seconds it had used by then (benchmarks/README.md has the
figures).

This module imports only Flower and light parts of pflalign: torch,
transformers and the training code are imported by the train and evaluate
handlers. Every SuperNode's first message is a ``query``, and on the
Deployment Engine it runs in a fresh process of its own, which then costs
Flower's start alone (1.1–1.2 CPU seconds in benchmarks/clientapp_start.py,
against 5.1–5.6 with torch and transformers).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.client.mod import fixedclipping_mod as legacy_fixedclipping_mod, secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from ..errors import OutOfMemory, UserError

if TYPE_CHECKING:  # imported where they are used (see the module docstring)
    from ..run.client import Client
    from ..config import RunConfig
    from ..model import FederatedLM

log = logging.getLogger("flwr.pflalign")


def privacy_mods(msg: Message, context: Context, call_next) -> Message:
    """Flower's mods for the privacy options (privacy.py), on the training messages that ask
    for them: a SecAgg+ stage (its ConfigRecord ``secaggplus_configs``) goes through
    `secaggplus_mod`, which calls this app only in the stage that collects the masked upload;
    a ``clipping_norm`` in the message's config (DP) puts Flower's `fixedclipping_mod` around
    the app (its legacy twin inside SecAgg+, whose messages have the legacy layout), so the
    upload is clipped before it is masked or sent. Other messages go straight to the app."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    from . import privacy

    if RECORD_KEY_CONFIGS in msg.content.config_records:
        def clipped(inner: Message, ctx: Context) -> Message:
            if privacy.KEY_CLIPPING_NORM in inner.content.config_records[privacy.LEGACY_FITINS]:
                return legacy_fixedclipping_mod(inner, ctx, call_next)
            return call_next(inner, ctx)
        return secaggplus_mod(msg, context, clipped)
    config = msg.content.config_records.get("config")
    if config is not None and privacy.KEY_CLIPPING_NORM in config:
        return fixedclipping_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[privacy_mods])
_CACHE: dict[str, object] = {}  # model, w^0 and partition, per process (reused by the Simulation Engine's actors)
# Clients' tokenized data, per process: the most recently served ones only. A Simulation Engine
# actor serves any of N clients, so keeping all would grow with N; one evicted is reloaded from
# the host's tokenized-data cache (run/data_cache.py), which costs a file read.
MAX_CLIENTS_PER_PROCESS = 8
_CLIENTS: OrderedDict[str, object] = OrderedDict()


# ---- which client, where ----------------------------------------------------------
def partition(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as exc:
        raise UserError(f"node config lacks {exc.args[0]!r}: start the SuperNode with "
                        "--node-config 'partition-id=K num-partitions=N'") from None


def state_folder(context: Context, experiment: str, k: int) -> Path:
    from ..model import cache_dir

    base = (context.node_config.get("state-dir") or context.run_config.get("client-dir")
            or cache_dir() / "flower")
    return Path(str(base)).expanduser() / experiment / f"client-{k}"


# ---- the client, built once per process ------------------------------------------------
def _cached(key: str, build):
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def build_client(cfg: RunConfig, context: Context) -> tuple[FederatedLM, Client]:
    """The model (with w^0 as its live adapter on first build) and client k's data."""
    from ..run.client import Client, make_client
    from ..run.data_cache import client_data
    from ..model import build_model
    from ..data.clients import client_shares, names_from_config, select
    from . import quiet_progress_bars, wire

    k, n = partition(context)
    names = names_from_config(cfg)  # None: a natural partition of files by a column (the data names them)
    if not 0 <= k < n or (names is not None and n != len(names)):
        raise UserError(f"node config partition-id={k} num-partitions={n} does not fit the run's "
                        + (wire.describe_clients(names) if names is not None else "clients"))
    model_key = repr((cfg.model, cfg.lora, cfg.seed, cfg.dtype, cfg.device))
    quiet_progress_bars()
    lm = _cached(model_key, lambda: build_model(cfg))
    data_dir = context.node_config.get("data-dir") or cfg.data.dir
    data_key = repr((model_key, k, cfg.data, data_dir, cfg.batch_size, cfg.max_seq_len))

    def federation():
        # the clients are made from the whole table (making them costs O(N)): once per process for
        # every client the process serves (a Simulation Engine actor serves many), never sent
        return _cached(repr(("federation", cfg.data, data_dir)), lambda: client_shares(cfg, data_dir))

    def load():  # client k's data, tokenized once per host (run/data_cache.py): on a hit nothing is read
        share, encoded = client_data(cfg, lm.tokenizer, k, data_dir, lambda: select(federation(), [k])[0])
        return make_client(k, share, lm.tokenizer, cfg, state={}, encoded=encoded)

    if data_key in _CLIENTS:
        _CLIENTS.move_to_end(data_key)
    else:
        _CLIENTS[data_key] = load()
        while len(_CLIENTS) > MAX_CLIENTS_PER_PROCESS:
            _CLIENTS.popitem(last=False)
    client = _CLIENTS[data_key]
    return lm, Client(client.id, client.data, client.train, state={})  # fresh state, shared data


def _w0(lm: FederatedLM, cfg: RunConfig) -> dict:
    """w^0, the seeded initial adapter (what the engine's clients initialise their state from)."""
    return _cached(repr(("w0", cfg.model, cfg.lora, cfg.seed, cfg.dtype)), lm.get_lora)


def load_state(folder: Path, done: int, client: Client, method, w0) -> None:
    """The client's state after its `done`-th accepted round (0: a fresh state from w^0)."""
    from .. import checkpoint as ckpt

    if done == 0:
        client.state = method.init_client_state(w0)
        return
    path = folder / f"round-{done}.pt"
    if not path.exists():
        raise UserError(f"client {client.id} has no state file {path} for its round {done}; "
                        "was the node's state-dir changed or cleaned?")
    saved = ckpt.load_checkpoint(path)
    client.state, client.personalized, client.steps_taken = saved["state"], saved["personalized"], saved["steps_taken"]


def save_state(folder: Path, n: int, client: Client) -> None:
    """Write round-<n>.pt; keep it and round-<n-1>.pt (the state the server has accepted)."""
    from .. import checkpoint as ckpt

    ckpt.save_checkpoint(folder / f"round-{n}.pt", {"client": client.id, "task": client.name,
                                                    "state": client.state, "personalized": client.personalized,
                                                    "steps_taken": client.steps_taken})
    for old in folder.glob("round-*.pt"):
        if int(old.stem.split("-")[1]) < n - 1:
            old.unlink(missing_ok=True)


def _setup(msg: Message, context: Context, conf: ConfigRecord | None = None):
    from ..config import make_method
    from . import wire

    conf = msg.content["config"] if conf is None else conf
    cfg = wire.config_from_json(str(conf["cfg"]))
    lm, client = build_client(cfg, context)
    method = make_method(cfg)
    folder = state_folder(context, str(conf["experiment"]), client.id)
    load_state(folder, int(conf["done"]), client, method, _w0(lm, cfg))
    return cfg, conf, lm, client, method, folder


def _info(client: Client) -> dict:
    return {"metrics": MetricRecord({"n_train": client.n_train, "n_test": len(client.data.test),
                                     "truncated": sum(e.truncated for e in client.train)}),
            "info": ConfigRecord({"client": client.id, "task": client.name})}


@contextmanager
def out_of_memory_said(say):
    """Out of memory (a GPU's, or this process's: a CPU `MemoryError` carries no message) as
    `OutOfMemory` with what ran out and what to lower (`say()`): Flower's error reply carries the
    exception's text, which the server logs as the client's reason for missing the round."""
    import torch

    try:
        yield
    except (torch.OutOfMemoryError, MemoryError):
        raise OutOfMemory(say()) from None


# ---- the three message handlers ---------------------------------------------------------
@app.query()
def query(msg: Message, context: Context) -> Message:
    k, n = partition(context)
    return Message(RecordDict({"info": ConfigRecord({"partition-id": k, "num-partitions": n})}), reply_to=msg)


def _process_age() -> float | None:
    """Seconds since this process started (the kernel's start time), None if unknown."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # psutil missing (it comes with the flower extra) or no such information
        return None


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round. Under SecAgg+ the message and the reply have Flower's legacy FitIns/FitRes
    layout (privacy.py): the same round, with w^r from ``fitins.parameters`` and the upload
    (masked by `secaggplus_mod` after this returns) in ``fitres.parameters``."""
    from ..run.client import train_client
    from ..run.jobs import training_out_of_memory
    from . import privacy, wire

    tic = time.perf_counter()
    first = not _CACHE  # this process's first message: it loads the model and the data
    secagg = privacy.LEGACY_FITINS in msg.content.config_records
    conf, w = privacy.fitins_parts(msg.content) if secagg else (None, None)
    cfg, conf, lm, client, method, folder = _setup(msg, context, conf)
    age = _process_age()
    if first and age is not None:  # the cost of Flower's process per message (benchmarks/README.md)
        log.info("client %d (%s): first local step %.1f s after its ClientApp process started, %.1f CPU s "
                 "(setup %.1f s)", client.id, client.name, age, time.process_time(), time.perf_counter() - tic)
    dtype, device = next(iter(lm.lora.values())).dtype, lm.device
    if secagg:
        global_params, received = {n: t.to(device=device, dtype=dtype) for n, t in w.items()}, {}
    else:
        global_params = wire.from_record(msg.content[wire.GLOBAL], dtype, device)
        received = wire.unpack(msg.content, wire.BROADCAST, dtype, device)
    r = int(conf["round"])
    with out_of_memory_said(lambda: training_out_of_memory(cfg, client.id, client.name)):
        result = train_client(lm, method, client, global_params, received, cfg, r)
    save_state(folder, int(conf["done"]) + 1, client)
    log.info("client %d (%s): round %d done, mean loss %.4f", client.id, client.name, r + 1,
             sum(result.losses) / len(result.losses))
    reply = _info(client)
    metrics = reply["metrics"]
    metrics["losses"] = [float(x) for x in result.losses]
    metrics["update_norm"], metrics["model_norm"] = result.update_norm, result.model_norm
    for key, value in (("gsnr_mean", result.gsnr_mean), ("gsnr_ratio", result.gsnr_ratio)):
        if value is not None:  # None (fewer than 2 steps) is left out
            metrics[key] = float(value)
    for key, value in result.method_metrics.items():  # Method.round_metrics, for the metrics line
        metrics[wire.METHOD_METRIC + key] = float(value)
    if secagg:
        return Message(privacy.fitres_reply(result.message, client.n_train,
                                            {k: v for k, v in metrics.items() if k != "n_train"}), reply_to=msg)
    return Message(RecordDict({**wire.pack(wire.MESSAGE, result.message), **reply}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Score the personalized model (the global one if this client never trained), the global
    model and, when asked, the base model on the first `limit` test examples (0: all)."""
    from .. import checkpoint as ckpt
    from ..run import export
    from ..run.client import score_client
    from ..run.jobs import scoring_out_of_memory
    from . import wire

    cfg, conf, lm, client, method, folder = _setup(msg, context)
    dtype, device = next(iter(lm.lora.values())).dtype, lm.device
    global_params = wire.from_record(msg.content[wire.GLOBAL], dtype, device)
    limit = int(conf.get("limit", 0)) or None
    test = client.data.test[:limit]
    personal = global_params if client.personalized is None else \
        method.personalized_after_aggregation(global_params, client.personalized, client.state)
    outputs, reply = {}, _info(client)
    jobs = [("personalized", personal), ("global", global_params)] + ([("base", None)] if conf.get("base") else [])
    for label, adapter in jobs:
        with out_of_memory_said(lambda: scoring_out_of_memory(cfg, client.id, label, client.name)):
            score, outputs[label] = score_client(lm, test, adapter, cfg, f"eval {label} {client.name}", False)
        reply["metrics"][f"rouge_l_{label}"] = score
    reply["metrics"]["n_test"] = len(test)
    if conf.get("predictions"):
        ckpt.write_jsonl(folder / "predictions.jsonl", [
            {"client": client.id, "task": client.name, "prompt": ex.prompt, "reference": ex.response,
             **{label: outputs[label][j] for label in ("personalized", "global")},
             "base": outputs["base"][j] if "base" in outputs else None}
            for j, ex in enumerate(test)])
        # this client's personalized model as evaluated, as a PEFT adapter folder: it stays on this node
        export.write_adapters(folder / export.ADAPTERS, cfg, {client.name: personal}, {"method": cfg.method},
                              {"clients": [{"task": client.name, **dict(reply["metrics"])}]})  # its model card's scores
    return Message(RecordDict(reply), reply_to=msg)
