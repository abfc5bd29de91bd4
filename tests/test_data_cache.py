"""The tokenized-data cache (run/data_cache.py): a hit reads nothing and tokenizes nothing and gives
what loading and tokenizing give; the data files, the settings and the tokenizer are in the key;
a damaged or foreign entry is never used; a client loads only its own data."""

from __future__ import annotations

import json
import shutil

import pytest

from pflalign.run import data_cache
from pflalign.config import build_config
from pflalign.model import cache_dir, load_base_model
from pflalign.data.clients import client_shares


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenized"


@pytest.fixture(scope="module")
def tok():
    return load_base_model("tiny-llama")[1]


def flan_cfg(data_dir, **extra):
    return build_config(None, {"data": {"name": "flan", "dir": str(data_dir), "max_train": 40, "max_test": 3},
                               "max_seq_len": 96, **extra})


def fresh(cfg, tok, k):
    (share,) = client_shares(cfg, which=[k])
    return share, data_cache.encode(share, tok, cfg)


def count_loads(monkeypatch):
    calls = {"load": [], "encode": 0}
    real_shares, real_encode = data_cache.client_shares, data_cache.encode_train

    def shares(cfg, data_dir=None, which=None):
        calls["load"].append(which)
        return real_shares(cfg, data_dir, which)

    def encode(*a, **kw):
        calls["encode"] += 1
        return real_encode(*a, **kw)

    monkeypatch.setattr(data_cache, "client_shares", shares)
    monkeypatch.setattr(data_cache, "encode_train", encode)
    return calls


def test_hit_reads_and_tokenizes_nothing_and_equals_a_fresh_load(shared_data, cache, tok, monkeypatch):
    cfg = flan_cfg(shared_data / "flan")
    calls = count_loads(monkeypatch)
    first = data_cache.client_data(cfg, tok, 2)
    assert calls == {"load": [[2]], "encode": 40}  # client 2 alone: nothing of the others
    assert len(list(cache.iterdir())) == 1
    again = data_cache.client_data(cfg, tok, 2)
    assert calls == {"load": [[2]], "encode": 40}  # the hit: no data read, no example tokenized
    assert again == first == fresh(cfg, tok, 2)


def test_key_covers_files_settings_and_tokenizer(shared_data, cache, tok, tmp_path):
    flan = tmp_path / "flan"
    shutil.copytree(shared_data / "flan", flan)
    cfg = flan_cfg(flan)
    data_cache.client_data(cfg, tok, 0)
    other_tok = load_base_model("tiny-opt")[1]
    variants = [(flan_cfg(flan, max_seq_len=64), tok), (flan_cfg(flan, data={"name": "flan", "dir": str(flan),
                                                                              "max_train": 40, "max_test": 3,
                                                                              "template": "plain"}), tok),
                (cfg, other_tok)]
    for variant_cfg, variant_tok in variants:
        assert data_cache.client_data(variant_cfg, variant_tok, 0) == fresh(variant_cfg, variant_tok, 0)
    assert len(list(cache.iterdir())) == 4
    # the same data elsewhere hits (content, not path); changed content misses
    moved = tmp_path / "moved"
    shutil.copytree(flan, moved)
    data_cache.client_data(flan_cfg(moved), tok, 0)
    assert len(list(cache.iterdir())) == 4
    records = json.loads((flan / "local_training_0.json").read_text())
    records[0]["output"] = "changed " + records[0]["output"]
    (flan / "local_training_0.json").write_text(json.dumps(records))
    assert data_cache.client_data(cfg, tok, 0) == fresh(cfg, tok, 0)
    assert len(list(cache.iterdir())) == 5


@pytest.mark.parametrize("damage", ["truncated", "foreign key", "fewer token lists"])
def test_damaged_entry_is_rebuilt_not_used(shared_data, cache, tok, damage):
    cfg = flan_cfg(shared_data / "flan")
    data_cache.client_data(cfg, tok, 1)
    (entry,) = cache.iterdir()
    if damage == "truncated":
        entry.write_text(entry.read_text()[:500])
    else:
        saved = json.loads(entry.read_text())
        if damage == "foreign key":
            saved["key"]["max_seq_len"] = 1
        else:
            saved["encoded"] = saved["encoded"][:-1]
        entry.write_text(json.dumps(saved))
    assert data_cache.client_data(cfg, tok, 1) == fresh(cfg, tok, 1)
    assert data_cache._read(entry, data_cache.cache_key(cfg, tok, 1, cfg.data.dir)) is not None


def test_synthetic_cached(cache, tok):
    cfg = build_config("demo", {"data": {"max_train": 8, "max_test": 2}})
    assert data_cache.client_data(cfg, tok, 3) == fresh(cfg, tok, 3)
    assert len(list(cache.iterdir())) == 1


def test_a_partition_of_your_files_is_cached_keyed_by_its_settings(cache, tok, tmp_path, monkeypatch):
    """data.name=files with a partition (what a Flower client of such a run loads): a hit equals a
    fresh load of that client alone; every partition setting is in the key, the file's content too."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"instruction": f"q{i}", "response": f"a{i}", "task": "t" + str(i % 2)}) + "\n"
                            for i in range(40)))
    data = {"name": "files", "dir": str(rows), "partition_by": "task", "partition": "dirichlet", "num_clients": 3,
            "alpha": 1.0, "min_partition_size": 4}
    cfg = build_config(None, {"data": data, "batch_size": 2})
    calls = count_loads(monkeypatch)
    first = data_cache.client_data(cfg, tok, 1)
    assert data_cache.client_data(cfg, tok, 1) == first == fresh(cfg, tok, 1)
    assert calls["load"] == [[1]]  # the second call was a hit
    variants = [{"seed": 7}, {"alpha": 5.0}, {"num_clients": 4}, {"min_partition_size": 3}, {"test_set": "global"},
                {"partition": "iid", "alpha": None, "min_partition_size": None}]
    keys = {json.dumps(data_cache.cache_key(cfg, tok, 1, str(rows)), sort_keys=True)}
    for change in variants:
        variant = build_config(None, {"data": {**data, **change}, "batch_size": 2})
        keys.add(json.dumps(data_cache.cache_key(variant, tok, 1, str(rows)), sort_keys=True))
    assert len(keys) == 1 + len(variants)
    rows.write_text(rows.read_text().replace('"q0"', '"q0 changed"'))
    assert data_cache.client_data(cfg, tok, 1) == fresh(cfg, tok, 1)
    assert len(calls["load"]) == 2  # the file changed: a miss
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.jsonl").write_text(rows.read_text())
    in_folder = build_config(None, {"data": {**data, "dir": str(folder)}, "batch_size": 2})
    assert [p for p, _ in data_cache.cache_key(in_folder, tok, 1, str(folder))["files"]] == ["train.jsonl"]
    assert data_cache.cache_key(build_config(None, {"data": {**data, "dir": "user/hub-id"}}), tok, 1,
                                "user/hub-id") is None  # a hub id: not cached


def test_unwritable_cache_still_gives_the_data(shared_data, tok, tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("PFLALIGN_CACHE", str(blocked))
    cfg = flan_cfg(shared_data / "flan")
    assert data_cache.client_data(cfg, tok, 0) == fresh(cfg, tok, 0)
    assert cache_dir() == blocked
