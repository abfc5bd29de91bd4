"""Issue 57: a Flower ClientApp that runs out of memory says what ran out and what to lower, and
the server's log line for the missing client carries that reason (before: a bare MemoryError,
whose Flower error reply said nothing)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, MessageType, RecordDict  # noqa: E402

from pflalign.config import build_config  # noqa: E402
from pflalign.errors import OutOfMemory  # noqa: E402
from pflalign.flower import client_app, replies, wire  # noqa: E402
from pflalign.methods import method_class  # noqa: E402
from pflalign.run import client as run_client  # noqa: E402
from pflalign.run.server import Server  # noqa: E402

from test_engine import TINY  # noqa: E402


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(client_app, "_CACHE", {})
    cfg = build_config(None, {**json.loads(json.dumps(TINY)), "method": "fedavg"})
    context = Context(run_id=1, node_id=100, node_config={"partition-id": 0, "num-partitions": 2,
                                                          "state-dir": str(tmp_path / "state")},
                      state=RecordDict(), run_config={})
    lm, _ = client_app.build_client(cfg, context)
    server = Server(method_class("fedavg")(), lm.get_lora(), 2)
    return cfg, context, server


def _message(cfg, server, kind: str):
    """What the strategy sends client 0 (its content; the handlers raise before they reply)."""
    config = {"cfg": wire.config_json(cfg), "experiment": "oom", "done": 0}
    content = {wire.GLOBAL: wire.to_record(server.global_params)}
    if kind == MessageType.TRAIN:
        content.update(wire.pack(wire.BROADCAST, server.broadcast()))
        config["round"] = 0
    return SimpleNamespace(content=RecordDict({**content, "config": ConfigRecord(config)}))


def test_training_out_of_memory_names_the_client_and_what_to_lower(setup, monkeypatch):
    cfg, context, server = setup

    def no_memory(*args, **kwargs):
        raise MemoryError()  # what a CPU process gets: no message at all

    monkeypatch.setattr(run_client, "train_client", no_memory)
    with pytest.raises(OutOfMemory, match=r"out of memory training client 0 \(arithmetic\) with batch_size=2, "
                                          r"max_seq_len=96, model tiny-llama: lower batch_size or max_seq_len"):
        client_app.train(_message(cfg, server, MessageType.TRAIN), context)


def test_scoring_out_of_memory_names_the_model_and_the_eval_batch(setup, monkeypatch):
    cfg, context, server = setup

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(run_client, "score_client", no_memory)
    with pytest.raises(OutOfMemory, match=r"out of memory scoring client 0 \(arithmetic\)'s personalized model with "
                                          r"eval.batch_size=4, .*lower eval.batch_size"):
        client_app.evaluate(_message(cfg, server, MessageType.EVALUATE), context)


def test_the_servers_reason_for_a_missing_client_is_the_clientapps_line():
    # Flower's error reply for an exception raised in a ClientApp (flwr's run_clientapp words it so)
    text = "out of memory training client 1 (sorting) with batch_size=4, max_seq_len=1024, model x: lower it"
    reason = f"<class 'pflalign.errors.OutOfMemory'>:<'{text}'>"
    assert replies.readable(reason) == f"OutOfMemory: {text}"
    assert replies.readable("<class 'MemoryError'>:<''>") == "MemoryError"
    assert replies.readable("no reply before the timeout") == "no reply before the timeout"
    sent = SimpleNamespace(metadata=SimpleNamespace(message_id="m1"))
    reply = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"), has_error=lambda: True,
                            error=SimpleNamespace(reason=reason))
    got, missing = replies.match([(sent, 1)], {}, [reply], str)
    assert got == {} and missing == {1: f"OutOfMemory: {text}"}
