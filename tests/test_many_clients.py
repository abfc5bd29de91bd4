"""Many clients: per-client files in the run folder (only sampled clients on the heap, written only
when they trained), resume from them and from an older whole-federation checkpoint, a damaged
client file, a seeded evaluation sample (eval.clients) and the distribution over clients."""

import json

import pytest
import torch

from pflalign import checkpoint as ckpt
from pflalign.run.client_store import FOLDER, client_records
from pflalign.config import build_config
from pflalign.run.engine import Federation, run
from pflalign.errors import UserError
from pflalign.run.lifecycle import distribution, eval_clients, sample_clients

from test_engine import TINY

FOUR = ["arithmetic", "sorting", "key_value", "uppercase"]


def config(**over):
    cfg = json.loads(json.dumps(TINY))
    cfg["data"]["clients"] = FOUR
    for key, value in over.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    return build_config(None, cfg)


def same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for n in a:
        assert torch.equal(a[n], b[n]), f"{what}: {n}"


def assert_same_clients(out, ref) -> None:
    mine, theirs = ckpt.load_run_checkpoint(out), ckpt.load_run_checkpoint(ref)
    same(mine["global"], theirs["global"], "global")
    for k, (a, b) in enumerate(zip(client_records(out, mine), client_records(ref, theirs), strict=True)):
        assert a["steps_taken"] == b["steps_taken"]
        assert (a["personalized"] is None) == (b["personalized"] is None)
        if a["personalized"] is not None:
            same(a["personalized"], b["personalized"], f"client {k} personalized")
            for group in b["state"]:
                same(a["state"][group], b["state"][group], f"client {k} {group}")


# ---- the files -------------------------------------------------------------------------
def test_only_the_sampled_clients_are_loaded_and_tokenized(tmp_path, monkeypatch):
    cfg = config(participation=0.5, rounds=1)
    fed = Federation(cfg, progress=False, out=tmp_path)
    assert not any(c.tokenized for c in fed.clients)  # nothing tokenized up front
    assert all(c.state is None and c.personalized is None for c in fed.clients)
    from pflalign.run.lifecycle import Recorder

    rec = Recorder(tmp_path, resume=False, overwrite=False)
    rec.open(cfg)
    fed.train(rec, 0, 1)
    rec.close()
    chosen = sample_clients(4, 0.5, cfg.seed, 0)
    assert [c.tokenized for c in fed.clients] == [k in chosen for k in range(4)]
    assert all(c.state is None and c.personalized is None for c in fed.clients)  # off the heap after the round
    assert sorted(p.name for p in (tmp_path / FOLDER).iterdir()) == sorted(f"{k}.r1.safetensors" for k in chosen)


def test_checkpoint_holds_no_client_tensors(tmp_path):
    run(config(rounds=1), tmp_path, progress=False)
    payload = ckpt.load_checkpoint(tmp_path / ckpt.CHECKPOINT)
    assert "clients" not in payload
    assert [r["name"] for r in payload["client_records"]] == FOUR
    assert all(isinstance(v, (str, int, type(None))) for r in payload["client_records"] for v in r.values())


def test_resume_with_sampling_equals_an_uninterrupted_run(tmp_path):
    cfg = config(method="scaffold", participation=0.5, rounds=3)
    run(cfg, tmp_path / "full", progress=False)
    assert run(cfg, tmp_path / "split", stop_after=1, progress=False) is None
    # a crash in round 2 after some clients were written: files no checkpoint names
    (tmp_path / "split" / FOLDER / "0.r2.safetensors").write_bytes(b"half-written garbage")
    run(None, tmp_path / "split", resume=True, progress=False)
    assert_same_clients(tmp_path / "split", tmp_path / "full")
    for name in (ckpt.RESULTS, ckpt.PREDICTIONS):
        a = (tmp_path / "split" / name).read_text()
        b = (tmp_path / "full" / name).read_text()
        if name == ckpt.RESULTS:
            a, b = ({k: v for k, v in json.loads(x).items() if not k.startswith("seconds")} for x in (a, b))
        assert a == b


def test_an_old_whole_federation_checkpoint_resumes(tmp_path):
    """A checkpoint of the format before issue 21 (every client's state and adapter inside it, no
    clients/ folder) resumes to the same numbers."""
    cfg = config(method="pflalign", rounds=2)
    run(cfg, tmp_path / "full", progress=False)
    old = tmp_path / "old"
    run(cfg, old, stop_after=1, progress=False)
    payload = ckpt.load_run_checkpoint(old)
    records = client_records(old, payload)
    del payload["client_records"]
    payload["clients"] = [{"state": r["state"], "personalized": r["personalized"], "steps_taken": r["steps_taken"]}
                          for r in records]
    for name in (ckpt.CHECKPOINT, ckpt.PREVIOUS, ckpt.MANIFEST):
        (old / name).unlink(missing_ok=True)
    ckpt.save_run_checkpoint(old, payload)
    for f in (old / FOLDER).iterdir():
        f.unlink()
    (old / FOLDER).rmdir()
    run(None, old, resume=True, progress=False)
    assert_same_clients(old, tmp_path / "full")


def test_a_damaged_client_file_is_one_clear_line(tmp_path):
    cfg = config(rounds=2)
    run(cfg, tmp_path, stop_after=1, progress=False)
    path = tmp_path / FOLDER / "1.r1.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"1\.r1\.safetensors does not match its checksum.*client 1"):
        run(None, tmp_path, resume=True, progress=False)
    path.unlink()
    with pytest.raises(UserError, match=r"1\.r1\.safetensors is missing"):
        run(None, tmp_path, resume=True, progress=False)


# ---- evaluation with many clients -----------------------------------------------------
def test_eval_clients_is_a_seeded_sample_the_same_for_every_method():
    assert eval_clients(10, None, 0) == list(range(10))
    assert eval_clients(10, 20, 0) == list(range(10))
    picks = eval_clients(100, 10, 3)
    assert len(set(picks)) == 10 and picks == sorted(picks) == eval_clients(100, 10, 3)
    assert picks != eval_clients(100, 10, 4)
    assert picks != sample_clients(100, 0.1, 3, 0)  # not the stream of a round's sample


def test_eval_clients_scores_and_exports_only_the_sample(tmp_path):
    cfg = config(eval={"clients": 2}, rounds=1)
    results = run(cfg, tmp_path, progress=False)
    ids = eval_clients(4, 2, cfg.seed)
    assert [c["id"] for c in results["clients"]] == ids
    assert results["clients_in_federation"] == 4
    rows = [json.loads(line) for line in (tmp_path / ckpt.PREDICTIONS).read_text().splitlines()]
    assert sorted({r["client"] for r in rows}) == ids
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == sorted(["global", *(FOUR[k] for k in ids)])
    assert results["distribution"]["personalized"]["clients"] == 2
    with pytest.raises(UserError, match="eval.clients must be > 0"):
        config(eval={"clients": 0})


def test_distribution_by_hand():
    # five clients: scores 10, 20, 30, 40, 50 with 1, 1, 1, 1, 6 training examples
    rows = [{"s": v, "n_train": n} for v, n in ((30, 1), (10, 1), (50, 6), (20, 1), (40, 1))]
    d = distribution(rows, "s")
    assert d["mean"] == 30.0
    assert d["weighted_mean"] == pytest.approx((10 + 20 + 30 + 40 + 6 * 50) / 10)  # 40
    assert d["worst_10pct_mean"] == 10.0  # ceil(0.1·5) = 1 client: the lowest
    assert (d["min"], d["median"], d["max"], d["clients"]) == (10.0, 30.0, 50.0, 5)
    many = [{"s": float(v), "n_train": 1} for v in range(100)]
    assert distribution(many, "s")["worst_10pct_mean"] == pytest.approx(4.5)  # mean of 0..9
    assert distribution([{"s": None, "n_train": 1}], "s") is None


def test_an_overwrite_failing_before_its_first_checkpoint_restores_the_old_client_files(tmp_path, monkeypatch):
    """The new run's round-1 files have the old run's names (k.r1): they must not replace the old
    run's, which its restored checkpoint names by checksum."""
    from pflalign.errors import TrainingDiverged
    from pflalign.run.lifecycle import Recorder

    out = tmp_path / "run"
    run(config(rounds=2), out, stop_after=1, progress=False)
    before = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    def fail(self, *args, **kwargs):
        raise TrainingDiverged("loss is nan")

    monkeypatch.setattr(Recorder, "save", fail)
    with pytest.raises(TrainingDiverged):
        run(config(rounds=2, method="fedprox"), out, overwrite=True, progress=False)
    monkeypatch.undo()
    assert {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    run(None, out, resume=True, progress=False)  # the old run goes on from its own files
    assert json.loads((out / ckpt.RESULTS).read_text())["method"] == "pflalign"


def _placed(name: str) -> str:
    """The folder an adapter is written for: export writes ".NAME.tmp" beside it, then renames it in."""
    return name.removeprefix(".").removesuffix(".tmp")


def test_export_reads_one_client_at_a_time(tmp_path, monkeypatch):
    """`pflalign export` writes each client's adapter right after reading its file: it never
    holds every client's tensors at once (with many clients they would not fit)."""
    from pflalign.run import client_store, export

    run(config(rounds=1), tmp_path / "run", progress=False)
    events = []
    load, write = client_store.ClientStore.load, export.write_adapter
    monkeypatch.setattr(client_store.ClientStore, "load",
                        lambda self, k, device: events.append(("read", k)) or load(self, k, device))
    monkeypatch.setattr(export, "write_adapter",
                        lambda folder, *a, **kw: events.append(("write", _placed(folder.name))) or write(folder, *a, **kw))
    export.export_run(tmp_path / "run", tmp_path / "out")
    assert events == [("write", "global")] + [e for k, name in enumerate(FOUR) for e in (("read", k), ("write", name))]
    events.clear()
    export.export_run(tmp_path / "run", tmp_path / "one", client="key_value")
    assert events == [("read", 2), ("write", "key_value")]


def test_tensors_in_reads_the_clients_files(tmp_path):
    """`client_store.tensors_in` walks `client_records`' clients (a Sequence read from the files,
    not a list) as well as a checkpoint's nested dicts."""
    from pflalign.run.client_store import ClientStore, tensors_in

    store = ClientStore(tmp_path, ["a", "b"])
    store.folder.mkdir()
    store.save(1, 1, {"delta": {"w": torch.ones(2, dtype=torch.float64)}}, {"w": torch.zeros(3)})
    payload = {"client_records": store.table()}
    found = list(tensors_in(client_records(tmp_path, payload)))
    assert sorted((str(t.dtype), t.numel()) for t in found) == [("torch.float32", 3), ("torch.float64", 2)]
    assert [t.numel() for t in tensors_in({"g": {"x": torch.ones(4)}, "s": [torch.ones(1), (torch.ones(2), "no")]})] \
        == [4, 1, 2]
