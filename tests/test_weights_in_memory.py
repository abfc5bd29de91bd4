"""The base weights held in ordinary memory (`in_memory`), not memory-mapped from their file:
the engine's rule for the process that trains (issue 42; benchmarks/memory_pressure.py)."""

import json

import pytest
import torch

from pflalign.config import build_config
from pflalign.data import Example
from pflalign.run.engine import Federation
from pflalign.model import FederatedLM, LoraSettings, load_base_model, mapped_files
from pflalign.prompts import collate_train, encode_train


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """tiny-llama saved as a model folder (model.safetensors): transformers memory-maps it on load."""
    folder = tmp_path_factory.mktemp("tiny-llama-folder")
    model, tok = load_base_model("tiny-llama")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _step(lm):
    examples = [Example("Sort: 3, 1, 2", "1, 2, 3"), Example("Upper: abc def", "ABC DEF")]
    batch = collate_train([encode_train(lm.tokenizer, e, 96) for e in examples], lm.tokenizer.pad_token_id)
    lm.set_lora({n: t + 0.05 * torch.ones_like(t) for n, t in lm.get_lora().items()})  # B != 0
    loss, grads = lm.loss_and_grads(batch)
    return loss, {n: g.clone() for n, g in grads.items()}


def test_in_memory_weights_are_not_mapped_and_train_bit_identically(tiny_folder):
    weights = str(tiny_folder / "model.safetensors")
    mapped = FederatedLM.build(str(tiny_folder), LoraSettings(r=4, alpha=8), seed=0)
    held = FederatedLM.build(str(tiny_folder), LoraSettings(r=4, alpha=8), seed=0, in_memory=True)
    assert mapped_files(mapped.model) == {weights}  # the default: the file's pages
    assert mapped_files(held.model) == set()
    base = held.model.get_base_model()
    assert base.model.embed_tokens.weight is base.lm_head.weight  # still tied
    for (n, a), (m, b) in zip(mapped.model.state_dict().items(), held.model.state_dict().items()):
        assert n == m and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
    loss_m, grads_m = _step(mapped)
    loss_h, grads_h = _step(held)
    assert loss_m == loss_h
    assert all(torch.equal(grads_m[n], grads_h[n]) for n in grads_m)


def test_the_engine_trains_on_weights_in_memory(tiny_folder):
    """workers = 1: the engine's process trains, so it holds the weights (worker processes keep
    the mapping, which they share: `pflalign.run.workers` builds its model mapped)."""
    cfg = build_config(None, json.loads(json.dumps({
        "model": str(tiny_folder), "lora": {"r": 4, "alpha": 8}, "rounds": 1, "local_steps": 1, "batch_size": 2,
        "data": {"name": "synthetic", "clients": ["arithmetic", "sorting"], "max_train": 4, "max_test": 2}})))
    fed = Federation(cfg, progress=False, workers=1)
    assert mapped_files(fed.lm.model) == set()
