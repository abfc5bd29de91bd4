"""Which CPU-tuned training kernels run where (issue 39): `FederatedLM.fast_paths` says it, and
a training step on CPU takes exactly the kernels it names (counted), in float32 and bfloat16,
packed (CPU) and padded (what a GPU runs)."""

from __future__ import annotations

import pytest
import torch

from pflalign.model import attention, lora_mlp, rms_norm
from pflalign.model import federated_lm as model_mod  # where the loss calls the kernels
from pflalign.model import FederatedLM, LoraSettings

BATCH = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 0], [11, 12, 13, 14, 15, 16]]),
         "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]),
         "labels": torch.tensor([[-100, -100, 7, 8, 9, -100], [-100, -100, -100, 14, 15, 16]])}


def _counting(monkeypatch, owner, name, seen, key, when=lambda *a, **k: True):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if when(*args, **kwargs):
            seen[key] = seen.get(key, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def _observed(lm, monkeypatch, unpadded: bool) -> dict[str, bool]:
    seen: dict[str, int] = {}
    _counting(monkeypatch, model_mod, "pack_rows", seen, "packed_rows")
    _counting(monkeypatch, attention, "sdpa_attention_forward", seen, "segment_attention",
              when=lambda *a, **k: k.get("is_causal") is True)  # only the per-example call passes it
    _counting(monkeypatch, lora_mlp.LoraSwiGLU, "apply", seen, "fused_lora_mlp")
    _counting(monkeypatch, lora_mlp.LoraSwiGLU, "apply", seen, "mlp_recompute", when=lambda *a, **k: a[5] is True)  # apply(x, w_g, w_u, w_d, s, recompute, ...)
    _counting(monkeypatch, rms_norm.RMSNorm, "apply", seen, "fused_rms_norm")
    _counting(monkeypatch, model_mod, "head_cross_entropy_sum", seen, "head_loss")
    loss, grads = lm.loss_and_grads(BATCH, unpadded=unpadded, pack_tokens=16 if unpadded else 512)
    assert torch.isfinite(torch.tensor(loss)) and all(bool(torch.isfinite(g).all()) for g in grads.values())
    return {k: seen.get(k, 0) > 0 for k in lm.fast_paths()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-opt"])
def test_fast_paths_name_the_kernels_a_step_takes(family, dtype, monkeypatch):
    lm = FederatedLM.build(family, LoraSettings(r=4, alpha=8), seed=0, dtype=dtype)
    for module in lm.model.modules():  # recompute above 4 tokens, not PACK_TOKENS: our rows are short
        if getattr(module, "_pflalign_recompute_above", None) is not None:
            module._pflalign_recompute_above = 4
    with monkeypatch.context() as m:
        assert _observed(lm, m, unpadded=True) == lm.fast_paths()  # CPU: packed rows
    # a GPU's step: the padded batch in one call, no recomputation (build sets none off CPU);
    # asked for "cuda", fast_paths names that step
    for module in lm.model.modules():
        if hasattr(module, "_pflalign_recompute_above"):
            module._pflalign_recompute_above = None
    cuda = lm.fast_paths("cuda")
    with monkeypatch.context() as m:
        assert _observed(lm, m, unpadded=False) == cuda
    assert not cuda["packed_rows"] and not cuda["segment_attention"] and not cuda["mlp_recompute"]
    llama32 = family == "tiny-llama" and dtype == torch.float32
    assert cuda["fused_lora_mlp"] == cuda["fused_rms_norm"] == llama32
    assert cuda["head_loss"]


def test_fast_paths_on_cpu_float32_llama_are_all_on():
    lm = FederatedLM.build("tiny-llama", LoraSettings(r=4, alpha=8), seed=0)
    paths = lm.fast_paths()
    assert paths == {"packed_rows": True, "segment_attention": True, "fused_lora_mlp": True,
                     "mlp_recompute": True, "fused_rms_norm": True, "head_loss": True}
