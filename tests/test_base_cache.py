"""The base model's generations are cached across runs: same outputs, no second generation."""

import json

import pytest

from pflalign import checkpoint as ckpt
from pflalign.run import client, engine
from pflalign.config import build_config

TINY = {
    "model": "tiny-llama", "lora": {"r": 2, "alpha": 4}, "rounds": 1, "local_steps": 1, "batch_size": 2,
    "max_seq_len": 64, "data": {"name": "synthetic", "clients": ["arithmetic", "sorting"], "max_train": 4,
                                "max_test": 3},
    "eval": {"max_new_tokens": 3, "batch_size": 4},
}


@pytest.fixture
def counted(monkeypatch, tmp_path):
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    calls = []
    real = client.generate

    def counting(*args, **kwargs):
        calls.append(kwargs.get("desc"))
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "generate", counting)
    return calls


def _run(out, **over):
    cfg = json.loads(json.dumps(TINY))
    cfg.update(over)
    return engine.run(build_config(None, cfg), out, progress=False)


def test_second_run_of_the_same_split_reuses_the_base_generations(tmp_path, counted):
    first = _run(tmp_path / "a", method="fedavg")
    assert sum("base" in d for d in counted) == 2  # one per client
    counted.clear()
    second = _run(tmp_path / "b", method="pflalign", seed=3)  # another method and seed, same split
    assert not any("base" in d for d in counted) and len(counted) == 4  # personalized + global only
    assert [c["rouge_l_base"] for c in second["clients"]] == [c["rouge_l_base"] for c in first["clients"]]
    base = lambda out: [p["base"] for p in map(json.loads, (out / ckpt.PREDICTIONS).read_text().splitlines())]  # noqa: E731
    assert base(tmp_path / "b") == base(tmp_path / "a")
    counted.clear()
    _run(tmp_path / "c", method="fedavg", eval={"max_new_tokens": 2, "batch_size": 4})  # another key
    assert sum("base" in d for d in counted) == 2


def test_damaged_entry_is_regenerated(tmp_path, counted):
    first = _run(tmp_path / "a", method="fedavg")
    for entry in (tmp_path / "cache" / "base-eval").glob("*.json"):
        entry.write_text('["trunc')
    counted.clear()
    again = _run(tmp_path / "b", method="fedavg")
    assert sum("base" in d for d in counted) == 2
    assert again["clients"] == first["clients"]



def test_source_digest_covers_the_code_generation_runs_through():
    """The key's source digest must change when the model, its kernels, the generation or the
    prompt format change, wherever those modules sit in the package (a module moved into a
    subpackage must not drop out of it); the data, methods and Flower code stay out."""
    import importlib
    from pathlib import Path

    import pflalign
    from pflalign.model import base_cache
    from pflalign import evaluate, model, prompts

    covered = set(base_cache.digested_sources())
    lm = importlib.import_module(model.FederatedLM.__module__)  # the model's rooms: its loss and its kernels
    kernels = [importlib.import_module(f.__module__) for f in (lm.use_segment_attention, lm.use_fused_lora_mlp,
                                                                lm.use_fused_rms_norm, lm.head_cross_entropy_sum)]
    rooms = [importlib.import_module(f.__module__) for f in (model.load_base_model, model.build_model)]
    for module in (model, lm, *rooms, evaluate, prompts, base_cache, *kernels):
        assert Path(module.__file__) in covered, module.__name__
    root = Path(pflalign.__file__).parent
    assert not [p for p in covered if p.relative_to(root).parts[0] in ("data", "methods", "flower")]
