"""The de-quantized model cache (model/model_cache.py): a GGUF loads from its safetensors copy with
exactly the GGUF's weights, config and tokenizer; a damaged, foreign or half-written entry is
never used; the copy is memory-mapped; no progress bar when transformers' bars are off."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pflalign.model import model_cache
from pflalign.model import FederatedLM, LoraSettings, cache_dir, embedded_model_path, load_base_model
from pflalign.prompts import collate_train, encode_train
from pflalign.data import Example

from tiny_gguf import write_tiny_gguf


@pytest.fixture
def gguf(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "dequantized").iterdir() if p.is_dir())


def no_gguf_load(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("the GGUF was loaded: the cache was not used")

    monkeypatch.setattr(model_cache, "load_gguf", refuse)


def test_cached_copy_equals_the_gguf_and_is_used_next_time(gguf, monkeypatch):
    direct, direct_tok = model_cache.load_gguf(gguf, torch.float32)
    model, tok = load_base_model(str(gguf))  # builds the copy
    (entry,) = entries(cache_dir())
    assert model_cache.differences(direct, direct_tok, model, tok) == []
    no_gguf_load(monkeypatch)
    again, again_tok = load_base_model(str(gguf))
    assert model_cache.differences(direct, direct_tok, again, again_tok) == []
    assert again.model.embed_tokens.weight.data_ptr() == again.lm_head.weight.data_ptr()  # still tied
    # memory-mapped from the cache file: shared page-cache pages, not a private copy
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert str(entry / model_cache.WEIGHTS) in maps
    assert json.loads((entry / model_cache.KEY_FILE).read_text())["key"]["gguf_sha256"] == model_cache.file_sha256(gguf)


def test_training_step_is_bit_identical_with_the_cached_copy(gguf, monkeypatch):
    """The whole model path (PEFT, fused kernels, the loss and its gradients) on the cached copy
    gives the bytes the GGUF-loaded model gives."""
    batch_of = lambda lm: collate_train([encode_train(lm.tokenizer, Example("Sort: 3, 1, 2", "1, 2, 3"), 64),
                                         encode_train(lm.tokenizer, Example("Say hi", "hello there"), 64)],
                                        lm.tokenizer.pad_token_id)
    cached = FederatedLM.build(str(gguf), LoraSettings(r=4, alpha=8), seed=0)
    monkeypatch.setattr("pflalign.model.base.load_dequantized", lambda path, dtype, root: model_cache.load_gguf(path, dtype))
    direct = FederatedLM.build(str(gguf), LoraSettings(r=4, alpha=8), seed=0)
    for lm in (cached, direct):
        lm.set_lora({n: t + 0.01 * torch.ones_like(t) for n, t in lm.get_lora().items()})
    loss_c, grads_c = cached.loss_and_grads(batch_of(cached))
    loss_d, grads_d = direct.loss_and_grads(batch_of(direct))
    assert loss_c == loss_d
    assert all(torch.equal(grads_c[n], grads_d[n]) for n in grads_d)


@pytest.mark.parametrize("damage", ["truncated", "other key", "no key file"])
def test_damaged_entry_is_rebuilt_not_used(gguf, damage):
    reference, reference_tok = model_cache.load_gguf(gguf, torch.float32)
    load_base_model(str(gguf))
    (entry,) = entries(cache_dir())
    if damage == "truncated":
        with open(entry / model_cache.WEIGHTS, "r+b") as f:
            f.truncate(1000)
    elif damage == "other key":
        saved = json.loads((entry / model_cache.KEY_FILE).read_text())
        saved["key"]["dtype"] = "torch.bfloat16"
        (entry / model_cache.KEY_FILE).write_text(json.dumps(saved))
    else:
        (entry / model_cache.KEY_FILE).unlink()
    model, tok = load_base_model(str(gguf))
    assert model_cache.differences(reference, reference_tok, model, tok) == []
    assert entries(cache_dir()) == [entry] and model_cache.is_valid(entry, model_cache.cache_key(gguf, torch.float32))


def test_half_written_copy_is_never_used(gguf, monkeypatch):
    """A build that fails while writing leaves no entry under the final name; the run uses the GGUF."""
    def crash(tmp, *a):
        (tmp / model_cache.WEIGHTS).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_cache, "_write_folder", crash)
    model, tok = load_base_model(str(gguf))
    assert entries(cache_dir()) == []
    direct, direct_tok = model_cache.load_gguf(gguf, torch.float32)
    assert model_cache.differences(direct, direct_tok, model, tok) == []


def test_dtype_and_file_content_are_in_the_key(gguf, tmp_path):
    load_base_model(str(gguf))
    load_base_model(str(gguf), torch.bfloat16)
    assert len(entries(cache_dir())) == 2
    (tmp_path / "other").mkdir()
    other = write_tiny_gguf(tmp_path / "other" / "tiny.gguf", seed=1)  # same name and size, other weights
    assert other.stat().st_size == gguf.stat().st_size
    model, _ = load_base_model(str(other))
    assert len(entries(cache_dir())) == 3
    direct, _ = model_cache.load_gguf(other, torch.float32)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, direct.model.layers[0].mlp.up_proj.weight)


def test_special_tokens_are_the_ggufs_own(gguf, monkeypatch):
    """BOS, EOS and padding as the GGUF's metadata names them, also where transformers' converter
    swaps BOS and EOS (5.0-5.17 do, for GPT-2-style tokenizers: simulated here; the CI's 5.24 reads
    them right), and in the cached copy that later loads read."""
    assert model_cache.gguf_special_tokens(gguf) == {"bos_token": 258, "eos_token": 259, "pad_token": 260}
    _, tok = model_cache.load_gguf(gguf, torch.float32)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<pad>")

    import transformers

    real = transformers.AutoTokenizer.from_pretrained.__func__

    def swapped(cls, *args, **kw):
        t = real(cls, *args, **kw)
        if kw.get("gguf_file"):  # the conversion from the GGUF: as transformers 5.17 does it
            t.bos_token, t.eos_token = t.eos_token, t.bos_token
        return t

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(swapped))
    _, bad = model_cache.load_gguf(gguf, torch.float32)  # the swap happens, and is undone
    assert (bad.bos_token, bad.eos_token, bad.eos_token_id) == ("<|im_start|>", "<|im_end|>", 259)
    _, cached = load_base_model(str(gguf))  # built with the swap, then read back from the folder
    assert (cached.bos_token, cached.eos_token, cached.pad_token) == ("<|im_start|>", "<|im_end|>", "<pad>")


def test_unwritable_cache_still_loads(gguf, monkeypatch, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("PFLALIGN_CACHE", str(blocked))
    model, tok = load_base_model(str(gguf))
    direct, direct_tok = model_cache.load_gguf(gguf, torch.float32)
    assert model_cache.differences(direct, direct_tok, model, tok) == []


@pytest.mark.parametrize("bars", [True, False])
def test_no_progress_silences_the_dequantization_bar(gguf, capfd, bars):
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    try:
        load_base_model(str(gguf))  # a cache miss: de-quantizes, then loads the copy
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
    err = capfd.readouterr().err
    assert ("de-quantizing" in err and "Loading weights" in err) == bars
    if not bars:
        assert "%|" not in err and "it/s" not in err


def test_smollm2_cached_copy_equals_its_gguf():
    """The real model: every tensor of the cached copy equals transformers' de-quantization of the
    Q4_1 GGUF, bit for bit, with the same config and tokenizer (skipped without the fetched model)."""
    path = embedded_model_path("smollm2-135m")
    if not path.is_file():
        pytest.skip(f"{path} not fetched (pflalign fetch-model smollm2-135m)")
    cached, cached_tok = load_base_model("smollm2-135m")  # from the cache (built now if missing)
    direct, direct_tok = model_cache.load_gguf(path, torch.float32)
    direct_tok.pad_token = direct_tok.pad_token or direct_tok.eos_token
    assert model_cache.differences(direct, direct_tok, cached, cached_tok) == []


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_cli_no_progress_shows_no_bar_at_all(gguf, capfd, tmp_path, command):
    """`--no-progress` on a cold cache (the GGUF de-quantized, then its copy loaded): not one bar,
    neither ours nor transformers' nor the de-quantization's."""
    from transformers.utils import logging as hf_logging

    from pflalign.cli import main
    from test_cli import TINY_SET

    sets = [s if not s.startswith("model=") else f"model={gguf}" for s in TINY_SET]
    try:
        if command == "run":
            assert main(["run", *sets, "--out", str(tmp_path / "run"), "--no-progress"]) == 0
        else:
            sweep = tmp_path / "sweep.toml"
            sweep.write_text('methods = ["fedavg"]\nseeds = [0]\n[[datasets]]\nname = "synthetic"\nconfig = "demo"\n')
            assert main(["sweep", "--config", str(sweep), *sets, "--out", str(tmp_path / "sweep"),
                         "--no-progress"]) == 0
    finally:
        hf_logging.enable_progress_bar()
    err = capfd.readouterr().err
    assert "%|" not in err and "it/s" not in err and "\r" not in err, err[-2000:]
