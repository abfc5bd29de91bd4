"""The model wrapper: both paper families, LoRA placement, adapter swapping, the loss."""

import pytest
import torch

from pflalign.data import Example
from pflalign.errors import UserError
from pflalign.model import FederatedLM, LoraSettings, load_base_model, pack_rows
from pflalign.prompts import collate_train, encode_train


def _batch(lm):
    examples = [Example("Sort: 3, 1, 2", "1, 2, 3"), Example("Upper: abc def", "ABC DEF")]
    return collate_train([encode_train(lm.tokenizer, e, 128) for e in examples], lm.tokenizer.pad_token_id)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_opt"])
def test_response_only_loss_equals_full_masked_loss(family, request):
    lm = request.getfixturevalue(family)
    batch = _batch(lm)
    with torch.no_grad():
        ours = lm.loss(**batch)
        reference = lm.model(**batch).loss  # HF: full-vocabulary logits at every position, masked mean
    assert ours.item() == pytest.approx(reference.item(), abs=1e-6)


@pytest.mark.parametrize("segments", [True, False])  # per-example attention (model/attention.py) or a block-diagonal mask
@pytest.mark.parametrize("pack_tokens", [1, 80, 512])  # one example per row, rows of 1-2, all in one row
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_opt"])
def test_unpadded_step_equals_padded_batch_step(family, pack_tokens, segments, request):
    """The CPU path (no pad tokens; examples packed into rows that attend per example)
    gives the padded batch's loss and gradients."""
    lm = request.getfixturevalue(family)
    assert lm.segment_attention  # both tiny models run SDPA, so they get the segment-aware version
    saved = lm.get_lora()
    lm.segment_attention = segments
    try:
        lm.set_lora({n: t + 0.05 * torch.randn_like(t) for n, t in saved.items()})  # B != 0: every grad nonzero
        examples = [Example("Sort: 3, 1, 2", "1, 2, 3"), Example("Upper: abc def ghi jkl", "ABC DEF GHI JKL"),
                    Example("Say hi", "hello there, how are you?")]
        batch = collate_train([encode_train(lm.tokenizer, e, 128) for e in examples], lm.tokenizer.pad_token_id)
        assert len(set(batch["attention_mask"].sum(1).tolist())) == 3  # three lengths: padding is real
        assert len(pack_rows(batch, 512)) == 1 and len(pack_rows(batch, 1)) == 3
        packed = pack_rows(batch, 512, segments=segments)[0]
        assert (packed["attention_mask"] is None) == segments and ("segment_lengths" in packed) == segments
        loss_p, grads_p = lm.loss_and_grads(batch, unpadded=False)
        grads_p = {n: g.clone() for n, g in grads_p.items()}
        loss_u, grads_u = lm.loss_and_grads(batch, unpadded=True, pack_tokens=pack_tokens)
        assert loss_u == pytest.approx(loss_p, abs=1e-6)
        for n in grads_p:
            torch.testing.assert_close(grads_u[n], grads_p[n], rtol=1e-4, atol=1e-7)
    finally:
        lm.set_lora(saved)
        lm.segment_attention = True


@pytest.mark.parametrize("family,modules", [
    ("tiny_llama", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    ("tiny_opt", {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}),
])
def test_lora_on_every_attention_and_mlp_projection_only(family, modules, request):
    lm = request.getfixturevalue(family)
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in lm.lora}
    assert adapted == modules
    assert all("lora_A" in n or "lora_B" in n for n in lm.lora)
    frozen = [n for n, p in lm.model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert frozen == []


def test_lora_init_is_seeded_and_B_starts_at_zero():
    a = FederatedLM.build("tiny-llama", LoraSettings(r=4, alpha=8), seed=3).get_lora()
    b = FederatedLM.build("tiny-llama", LoraSettings(r=4, alpha=8), seed=3).get_lora()
    c = FederatedLM.build("tiny-llama", LoraSettings(r=4, alpha=8), seed=4).get_lora()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a if "lora_A" in n)
    assert all(t.abs().sum() == 0 for n, t in a.items() if "lora_B" in n)


def test_adapter_swap_roundtrip_and_gradients_only_on_lora(tiny_llama):
    lm = tiny_llama
    saved = lm.get_lora()
    try:
        other = {n: torch.randn_like(t) for n, t in saved.items()}
        lm.set_lora(other)
        assert all(torch.equal(lm.get_lora()[n], other[n]) for n in other)
        loss, grads = lm.loss_and_grads(_batch(lm))
        assert grads.keys() == lm.lora.keys()
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        with pytest.raises(ValueError, match="keys differ"):
            lm.set_lora({"nope": torch.zeros(1)})
    finally:
        lm.set_lora(saved)


def test_missing_model_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_base_model(str(tmp_path / "absent.gguf"))
    not_a_model = tmp_path / "weights.bin"
    not_a_model.write_text("x")
    with pytest.raises(UserError):
        load_base_model(str(not_a_model))
    with pytest.raises(UserError, match="has no config.json: a Hugging Face model folder holds"):
        load_base_model(str(tmp_path))  # a directory that holds no model
