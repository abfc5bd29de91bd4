"""The model wrapper: both paper families, LoRA placement, adapter swapping, the loss."""

import pytest
import torch

from pflalign.data import Example
from pflalign.errors import UserError
from pflalign.model import FederatedLM, LoraSettings, load_base_model
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
    with pytest.raises(UserError, match="cannot load model"):
        load_base_model(str(tmp_path))  # an empty directory
