"""Optional TensorBoard logging: `log.tensorboard=true` tees the per-round numbers into event files."""

from __future__ import annotations

import json

import pytest

from pflalign.config import build_config
from pflalign.errors import UserError
from pflalign import tensorboard

TINY = {
    "model": "tiny-llama", "lora": {"r": 4, "alpha": 8},
    "data": {"name": "synthetic", "clients": ["arithmetic", "sorting"], "max_train": 8, "max_test": 2},
    "rounds": 2, "local_steps": 2, "batch_size": 2, "max_seq_len": 96,
    "eval": {"max_new_tokens": 4, "batch_size": 4, "base_model": False, "every": 1, "every_max_test": 1},
    "log": {"tensorboard": True},
}


def test_off_by_default_and_a_missing_extra_is_one_clear_error(monkeypatch):
    assert build_config(None, {}).log.tensorboard is False
    monkeypatch.setattr(tensorboard, "available", lambda: False)
    with pytest.raises(UserError, match=r"pip install 'pflalign\[tensorboard\]'"):
        build_config(None, {"log": {"tensorboard": True}})


def test_a_run_writes_the_per_round_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pflalign.run.engine import run

    run(build_config(None, json.loads(json.dumps(TINY))), tmp_path, progress=False)
    events = EventAccumulator(str(tmp_path / tensorboard.FOLDER))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/mean", "consistency/update_norm", "loss/arithmetic", "gsnr/ratio/sorting",
            "rouge_l/personalized/arithmetic", "final/avg_rouge_l_personalized"} <= tags
    rounds = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [m["mean_loss"] for m in rounds if m["event"] == "round"]
    assert [e.step for e in events.Scalars("loss/mean")] == [1, 2]
    assert [e.value for e in events.Scalars("loss/mean")] == pytest.approx(losses)
    assert [(e.step, e.value) for e in events.Scalars("lr")] == [(1, pytest.approx(0.04)), (2, pytest.approx(0.04))]


def test_the_lr_of_every_round_follows_the_schedule(tmp_path):
    """Cosine over 2 rounds from lr 0.1 to min_lr 0.02: 0.1 in round 1, 0.06 in round 2 (`optim.round_lr`)."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pflalign.run.engine import run

    over = {**json.loads(json.dumps(TINY)), "method": "fedavg", "lr": 0.1,
            "optimizer": {"schedule": "cosine", "min_lr": 0.02}, "eval": {**TINY["eval"], "every": 0}}
    run(build_config(None, over), tmp_path, progress=False)
    events = EventAccumulator(str(tmp_path / tensorboard.FOLDER))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("lr")] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.06))]


def test_a_run_writes_its_config_as_hparams_and_every_steps_loss(tmp_path):
    """The HParams dashboard gets every config key (flattened), the config.json as text, and each
    client's minibatch loss per local step, counted over rounds (round · local_steps + step + 1)."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    from pflalign.run.engine import run

    run(build_config(None, json.loads(json.dumps(TINY))), tmp_path, progress=False)
    events = EventAccumulator(str(tmp_path / tensorboard.FOLDER))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = start.session_start_info.hparams
    assert hp["lora.r"].number_value == 4 and hp["rounds"].number_value == 2 and hp["method"].string_value == "pflalign"
    assert hp["data.clients"].string_value == "arithmetic,sorting" and hp["data.seed"].string_value == "None"
    assert hp["log.tensorboard"].string_value == "true" and hp["lr"].number_value == pytest.approx(build_config(None, {}).lr)
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == list(tensorboard.HPARAM_METRICS)
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.removeprefix("```json\n").removesuffix("\n```")) == json.loads((tmp_path / "config.json").read_text())

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for client, name in enumerate(["arithmetic", "sorting"]):
        steps = [m for m in lines if m["event"] == "train_step" and m["client"] == client]
        logged = events.Scalars(f"loss/step/{name}")
        assert [e.step for e in logged] == [1, 2, 3, 4] == [m["round"] * 2 + m["step"] + 1 for m in steps]
        assert [e.value for e in logged] == pytest.approx([m["loss"] for m in steps])
