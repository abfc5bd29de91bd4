"""End to end on a tiny random model: results, checkpoints, resume, weighting."""

import json

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.config import build_config
from pflalign.run.client_store import client_records
from pflalign.run.engine import Federation, run
from pflalign.run.lifecycle import Recorder, sample_clients
from pflalign.errors import UserError

TINY = {
    "model": "tiny-llama",
    "lora": {"r": 4, "alpha": 8},
    "data": {"name": "synthetic", "clients": ["arithmetic", "sorting"], "max_train": 12, "max_test": 3},
    "rounds": 2,
    "local_steps": 2,
    "batch_size": 2,
    "max_seq_len": 96,
    "eval": {"max_new_tokens": 4, "batch_size": 4},
    # the paper's defaults (lr 0.04, pFLAlign's β 0.9) also where a test starts a run as a user does
    # (pflalign run, a Flower run's config): the runs pinned before issue 56 (not in config.json)
    "defaults": "paper",
}


def tiny_config(**over):
    cfg = json.loads(json.dumps(TINY))
    cfg.update(over)
    return build_config(None, cfg)


def _adapters(out):
    """The checkpoint with every client's record (from clients/) under "clients", as before issue 21."""
    payload = ckpt.load_checkpoint(out / ckpt.CHECKPOINT)
    return {**payload, "clients": client_records(out, payload)}


def _assert_same_params(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("method", ["pflalign", "fedavg"])
def test_run_writes_results_and_resume_matches_uninterrupted(tmp_path, method):
    cfg = tiny_config(method=method)
    full = run(cfg, tmp_path / "full", progress=False)
    assert full["method"] == method and full["dataset"] == "synthetic"
    assert [c["task"] for c in full["clients"]] == ["arithmetic", "sorting"]
    for c in full["clients"]:
        assert c["n_train"] == 12 and c["n_test"] == 3
        for key in ("rouge_l_personalized", "rouge_l_global", "rouge_l_base"):
            assert 0.0 <= c[key] <= 100.0
    on_disk = json.loads((tmp_path / "full" / ckpt.RESULTS).read_text())
    assert on_disk["avg_rouge_l_personalized"] == pytest.approx(
        sum(c["rouge_l_personalized"] for c in full["clients"]) / 2)

    assert run(cfg, tmp_path / "split", stop_after=1, progress=False) is None
    assert not (tmp_path / "split" / ckpt.RESULTS).exists()
    assert _adapters(tmp_path / "split")["rounds_done"] == 1
    resumed = run(None, tmp_path / "split", resume=True, progress=False)

    a, b = _adapters(tmp_path / "full"), _adapters(tmp_path / "split")
    _assert_same_params(a["global"], b["global"])
    for ca, cb in zip(a["clients"], b["clients"]):
        _assert_same_params(ca["personalized"], cb["personalized"])
        assert ca["state"].keys() == cb["state"].keys()
        for group in ca["state"]:
            _assert_same_params(ca["state"][group], cb["state"][group])
    assert resumed["clients"] == full["clients"]

    def steps(out):
        rows = [json.loads(l) for l in (out / ckpt.METRICS).read_text().splitlines()]
        return [(r["round"], r["client"], r["step"], r["loss"]) for r in rows if r["event"] == "train_step"]

    assert steps(tmp_path / "split") == steps(tmp_path / "full")
    assert len(steps(tmp_path / "full")) == 2 * 2 * 2  # rounds x clients x steps, each once


def test_training_changes_adapters_and_clients_personalize(tmp_path):
    run(tiny_config(method="pflalign"), tmp_path, progress=False)
    payload = _adapters(tmp_path)
    p0, p1 = (c["personalized"] for c in payload["clients"])
    assert any(not torch.equal(p0[n], p1[n]) for n in p0)  # two different personalized models
    assert any(payload["global"][n].abs().sum() > 0 for n in payload["global"] if "lora_B" in n)  # B left zero


def test_fedavg_weights_by_client_data_size(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))  # the cut data stays out of the host's cache
    cfg = tiny_config(method="fedavg", rounds=1)
    fed = Federation(cfg, progress=False)
    fed.clients[0].data.train = fed.clients[0].data.train[:4]  # 4 vs 12 examples
    seen = {"messages": []}
    original = fed.method.start_aggregation

    def spy(global_params, weights, server_state, ctx):  # the round's aggregation, its messages kept
        seen["weights"] = weights
        aggregation = original(global_params, weights, server_state, ctx)
        add = aggregation.add
        monkeypatch.setattr(aggregation, "add", lambda i, message: (seen["messages"].append(message), add(i, message)))
        return aggregation

    monkeypatch.setattr(fed.method, "start_aggregation", spy)
    rec = Recorder(tmp_path, resume=False, overwrite=False)
    rec.open(cfg)
    fed.train(rec, 0, cfg.rounds)
    rec.close()
    assert seen["weights"] == pytest.approx([0.25, 0.75])
    m0, m1 = (m["params"] for m in seen["messages"])
    for n, t in fed.global_params.items():
        assert torch.allclose(t, 0.25 * m0[n] + 0.75 * m1[n], atol=1e-7)


def test_same_seed_same_result_other_seed_differs(tmp_path):
    a = run(tiny_config(seed=1, rounds=1), tmp_path / "a", progress=False)
    b = run(tiny_config(seed=1, rounds=1), tmp_path / "b", progress=False)
    run(tiny_config(seed=2, rounds=1), tmp_path / "c", progress=False)
    _assert_same_params(_adapters(tmp_path / "a")["global"], _adapters(tmp_path / "b")["global"])
    assert a["clients"] == b["clients"]
    ga, gc = _adapters(tmp_path / "a")["global"], _adapters(tmp_path / "c")["global"]
    assert any(not torch.equal(ga[n], gc[n]) for n in ga)


def test_opt_family_runs_end_to_end(tmp_path):
    res = run(tiny_config(model="tiny-opt", rounds=1), tmp_path, progress=False)
    assert len(res["clients"]) == 2


def test_run_directory_is_protected(tmp_path):
    cfg = tiny_config(rounds=1)
    run(cfg, tmp_path, progress=False)
    with pytest.raises(UserError, match="finished run"):
        run(cfg, tmp_path, progress=False)
    run(cfg, tmp_path, overwrite=True, progress=False)
    other = tmp_path / "other"
    run(tiny_config(), other, stop_after=1, progress=False)
    with pytest.raises(UserError, match="--resume"):
        run(tiny_config(), other, progress=False)
    with pytest.raises(UserError, match="no checkpoint"):
        run(None, tmp_path / "empty", resume=True, progress=False)


def test_partial_participation_is_seeded():
    assert sample_clients(4, 1.0, 0, 3) == [0, 1, 2, 3]
    picks = [sample_clients(10, 0.3, 5, r) for r in range(20)]
    assert all(len(p) == 3 and len(set(p)) == 3 for p in picks)
    assert picks == [sample_clients(10, 0.3, 5, r) for r in range(20)]
    assert len({tuple(p) for p in picks}) > 1


def test_batch_larger_than_client_data_is_refused():
    with pytest.raises(UserError, match="fewer than batch_size"):
        Federation(tiny_config(batch_size=13), progress=False)


@pytest.mark.parametrize("method", sorted(__import__("pflalign.methods", fromlist=["METHODS"]).METHODS))
def test_every_method_runs_two_rounds_end_to_end(tmp_path, method):
    res = run(tiny_config(method=method, local_steps=1, eval={"max_new_tokens": 2, "batch_size": 4}),
              tmp_path, progress=False)
    assert res["method"] == method and len(res["clients"]) == 2
    assert json.loads((tmp_path / ckpt.RESULTS).read_text())["method"] == method


def test_metrics_record_gsnr_and_consistency_per_round(tmp_path):
    run(tiny_config(method="fedavg", rounds=2, local_steps=3), tmp_path, progress=False)
    rows = [json.loads(l) for l in (tmp_path / ckpt.METRICS).read_text().splitlines()]
    for r in range(2):
        clients = [x for x in rows if x["event"] == "client_round" and x["round"] == r]
        (summary,) = [x for x in rows if x["event"] == "round" and x["round"] == r]
        assert len(clients) == 2 and all(c["gsnr_mean"] > 0 and c["gsnr_ratio"] > 0 for c in clients)
        # equal client sizes: the data-weighted sums are plain means
        assert summary["consistency_update_norm"] == pytest.approx(sum(c["update_norm"] for c in clients) / 2)
        assert summary["consistency_model_norm"] == pytest.approx(sum(c["model_norm"] for c in clients) / 2)
        assert summary["seconds"] > 0


def test_divergence_names_client_round_step_and_keeps_last_checkpoint(tmp_path):
    from pflalign.errors import TrainingDiverged

    out = tmp_path / "run"
    run(tiny_config(method="fedavg", rounds=3), out, stop_after=1, progress=False)
    before = (out / ckpt.CHECKPOINT).read_bytes(), (out / ckpt.METRICS).read_bytes()
    # an absurd learning rate, resumed from the good round-1 checkpoint (a recipe change, allowed)
    cfg = json.loads((out / ckpt.CONFIG).read_text())
    cfg["lr"] = 1e30
    (out / ckpt.CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(TrainingDiverged, match=r"client 0 \(arithmetic\).*round 2, local step \d.*lower learning rate; "
                                               r"the checkpoint after round 1 is kept$"):
        run(None, out, resume=True, progress=False, allow_recipe_change=True)
    assert ((out / ckpt.CHECKPOINT).read_bytes(), (out / ckpt.METRICS).read_bytes()) == before  # as after round 1
    assert not (out / ckpt.RESULTS).exists()


def test_results_split_the_evaluation_time_by_model(tmp_path, monkeypatch):
    """results.json says where the final evaluation's seconds went; the base model's generations
    come from the cache the second time, so its share drops to almost nothing."""
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(method="fedavg", rounds=1)
    by_model = []
    for out in ("a", "b"):
        run(cfg, tmp_path / out, progress=False)
        results = json.loads((tmp_path / out / ckpt.RESULTS).read_text())
        by_model.append(results["seconds_eval_by_model"])
        assert set(by_model[-1]) == {"personalized", "global", "base"}
        assert 0 <= sum(by_model[-1].values()) <= results["seconds_eval"]
    assert by_model[1]["base"] < by_model[0]["base"]


def _train_with_losses(cfg, rec, start, end, losses):
    """Rounds start..end-1 of clients whose local steps have these losses (per round, a list of steps
    of client 0, or a dict client → steps), recorded and watched as an engine's loop does: the round's
    lines, the watch, a checkpoint."""
    from pflalign.run.client import ClientRound
    from pflalign.run.lifecycle import LossWatch
    from pflalign.run.server import RoundRecord

    rec.open(rec.config(cfg))
    watch = LossWatch(rec, ["alpha", "beta", "gamma"])  # the clients' names, as the engines pass them
    for r in range(start, end):
        by_client = losses[r] if isinstance(losses[r], dict) else {0: losses[r]}
        record = RoundRecord({}, list(by_client), [ClientRound({}, {}, steps, None, None, 0.0, 0.0)
                                                   for steps in by_client.values()], [1.0] * len(by_client))
        rec.round(r, record, 0.0)
        watch.round(r, record)
        rec.save(r + 1, {})
    rec.close()


def test_a_round_past_twice_the_starting_loss_warns_once_also_after_a_resume(tmp_path, caplog):
    import logging

    cfg = tiny_config(rounds=6)
    # round means 1.0, 0.5, 2.0, 4.5, 0.4, 5.0 from a start of 1.0: 2.0 is not past 2 × 1.0, 4.5 is, and
    # past 4 × the client's early level (1.0) too
    losses = [[1.0, 1.0], [0.5], [2.0], [4.5], [0.4], [5.0]]
    with caplog.at_level(logging.WARNING, logger="pflalign.run.lifecycle"):
        _train_with_losses(cfg, Recorder(tmp_path, resume=False, overwrite=False), 0, 3, losses)
        assert not caplog.records
        # the start read back from round 1's train_step lines
        _train_with_losses(cfg, Recorder(tmp_path, resume=True, overwrite=False), 3, 6, losses)
    # one client: the run's line and the client's are passed in the same round, each warned once
    assert [r.getMessage() for r in caplog.records] == [
        "round 4: mean training loss 4.5 is 4.5 × the loss the run started from (1): the run is diverging "
        "(a smaller lr or server step may hold it; pflalign report marks a run that ends so)",
        "round 4: alpha's mean step loss 4.5 is 4.5 × its early level (1, the median step loss of its first "
        "round): its training is blowing up, which the run's mean can hide (pflalign report lists the clients "
        "that did)"]


def test_one_clients_blow_up_that_the_runs_mean_hides_warns_once_also_after_a_resume(tmp_path, caplog):
    import logging

    # client 0 starts at 1.0 and holds; client 1 first trains in round 2 (early level 3.5, the median of 4.0
    # and 3.0) and passes 4 × 3.5 in round 5 (15.0), then again in round 6 (14.5); client 2 starts at 10.0 and
    # dwarfs the run's mean: the run's start is (1 + 10) / 2 = 5.5 and no round's mean passes 11
    losses = [{0: [1.0, 0.5], 2: [10.0, 6.0]}, {1: [4.0, 3.0], 2: [5.0]}, {0: [0.8], 1: [12.0]},
              {0: [0.7], 2: [4.0]}, {1: [15.0], 2: [3.0]}, {1: [14.5], 2: [2.0]}]
    with caplog.at_level(logging.WARNING, logger="pflalign.run.lifecycle"):
        _train_with_losses(tiny_config(rounds=6), Recorder(tmp_path, resume=False, overwrite=False), 0, 3, losses)
        assert not caplog.records  # client 1's 12.0 is not past 4 × 3.5
        # client 1's start read back from round 2's line
        _train_with_losses(tiny_config(rounds=6), Recorder(tmp_path, resume=True, overwrite=False), 3, 6, losses)
    assert [r.getMessage() for r in caplog.records] == [
        "round 5: beta's mean step loss 15 is 4.3 × its early level (3.5, the median step loss of its first "
        "round): its training is blowing up, which the run's mean can hide (pflalign report lists the clients "
        "that did)"]


def test_a_blow_up_within_round_1_warns_in_round_1(tmp_path, caplog):
    """Against round 1's mean loss (11) this run never passes 2 ×; against its start (1.0) it does, and the
    client's round 1 passes 4 × its early level (2.0, the median of its first round: the last step's 30 does
    not lift it)."""
    import logging

    losses = [[1.0, 2.0, 30.0], [5.0], [6.0]]  # round 1's mean 11, first step 1.0
    with caplog.at_level(logging.WARNING, logger="pflalign.run.lifecycle"):
        _train_with_losses(tiny_config(rounds=3), Recorder(tmp_path, resume=False, overwrite=False), 0, 3, losses)
    assert [r.getMessage() for r in caplog.records] == [
        "round 1: mean training loss 11 is 11.0 × the loss the run started from (1): the run is diverging "
        "(a smaller lr or server step may hold it; pflalign report marks a run that ends so)",
        "round 1: alpha's mean step loss 11 is 5.5 × its early level (2, the median step loss of its first "
        "round): its training is blowing up, which the run's mean can hide (pflalign report lists the clients "
        "that did)"]
