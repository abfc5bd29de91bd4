"""A GGUF model de-quantized once, kept as a safetensors folder in the model cache.

Loading SmolLM2-135M from its Q4_1 GGUF takes about 30 s of one core: gguf-py
de-quantizes every tensor in NumPy. The Flower Deployment Engine starts a
fresh ClientApp process for every message, so that cost was paid once per
client per round. Here it is paid once per host: the first load writes the
de-quantized weights (in the run's dtype) with the model's config and
tokenizer to ``$PFLALIGN_CACHE/dequantized/<name>-<key>/`` (``~/.cache/pflalign``),
and every later load reads that folder with ``from_pretrained``, about 1 s.
safetensors memory-maps the file, so the frozen weights of every process on
a host are the same page-cache pages (a process that writes a weight, e.g.
`FederatedLM.merged` for generation, gets its own copy of that page).

Exactness: a new folder is loaded back and compared with the model loaded
from the GGUF, tensor by tensor (bytes, dtypes, names), with its config and
tokenizer, before it gets its final name; if anything differs it is not
kept and the GGUF model is used (with a warning). So a cached model is the
GGUF-dequantized one, bit for bit.

Safety: the key is the GGUF's SHA-256 and size, the dtype, the versions of
torch, transformers and gguf (the de-quantization code) and `FORMAT`. It
names the folder and is stored in it (``key.json``), and is compared on every
load together with the weight file's size. A folder is written under a
temporary name and renamed into place only when complete (fsync'ed), so a
crash leaves no half-written entry under the final name; one that fails the
check (edited, truncated) is replaced. Bit rot inside a complete file is not
detected (hashing 540 MB would cost 0.3 s of every start); deleting the
folder rebuilds it. A lock file serialises the build, so
that processes starting together on a cold cache de-quantize once, not
each. A cache that cannot be written (read-only, full) costs time, never
the run: the GGUF model is used.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .. import checkpoint as ckpt

log = logging.getLogger(__name__)

FORMAT = 2  # the folder's layout and content; bump to invalidate every entry (2: special tokens from the GGUF)
WEIGHTS = "model.safetensors"
KEY_FILE = "key.json"  # written last inside the folder; the folder is renamed into place after it


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(functools.partial(f.read, 1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def cache_key(gguf: Path, dtype: torch.dtype) -> dict:
    """Everything the de-quantized tensors depend on (about 0.1 s: the GGUF's hash)."""
    import gguf as gguf_lib
    import transformers
    from importlib.metadata import version

    try:
        gguf_version = version("gguf")
    except Exception:  # an unpackaged gguf-py: its file's location stands in
        gguf_version = str(getattr(gguf_lib, "__file__", "unknown"))
    return {"format": FORMAT, "gguf_sha256": file_sha256(gguf), "gguf_size": gguf.stat().st_size,
            "dtype": str(dtype), "torch": torch.__version__, "transformers": transformers.__version__,
            "gguf": gguf_version}


def folder_for(root: Path, gguf: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return root / f"{gguf.stem}-{digest}"


def is_valid(folder: Path, key: dict) -> bool:
    """Whether `folder` is a complete entry for `key` (its key.json equal, its weight file of the size recorded)."""
    try:
        saved = json.loads((folder / KEY_FILE).read_text())
        return saved.get("key") == key and (folder / WEIGHTS).stat().st_size == saved.get("weights_bytes")
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def gguf_progress_bar(enabled: bool):
    """transformers' GGUF de-quantization bar ("Converting and de-quantizing GGUF tensors...")
    is a plain `tqdm`, which `transformers.utils.logging.disable_progress_bar()` does not reach;
    with `enabled` False it is switched off for the duration."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if enabled or original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def progress_enabled() -> bool:
    """transformers' own switch (`pflalign run --no-progress` and the Flower apps turn it off)."""
    from transformers.utils import logging as hf_logging

    return hf_logging.is_progress_bar_enabled()


def gguf_special_tokens(path: Path) -> dict[str, int]:
    """The GGUF's own special-token ids: {"bos_token": id, "eos_token": id, "pad_token": id}, those it names."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    out = {}
    for attr, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            out[attr] = int(field.contents())
    return out


def set_special_tokens(tok, ids: dict[str, int], source: str) -> None:
    """Give `tok` the special tokens `ids` names (the GGUF's), where it has others. transformers 5.0-5.17
    swap BOS and EOS when they convert a GPT-2-style GGUF tokenizer (integrations/ggml.py; fixed in
    5.18): SmolLM2's EOS became <|im_start|>, so every training answer ended in the wrong token and
    greedy answers came out empty (seen on a GPU image with 5.17: ROUGE-L 16 where 5.24 gives 50)."""
    for attr, token_id in ids.items():
        token = tok.convert_ids_to_tokens(token_id)
        if getattr(tok, attr) != token:
            log.info("%s: %s set to %r (id %d), the GGUF's own, not %r", source, attr, token, token_id,
                     getattr(tok, attr))
            setattr(tok, attr, token)


def load_gguf(path: Path, dtype: torch.dtype):
    """(model, tokenizer) from the GGUF file itself: the slow path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=path.name)
    tok = AutoTokenizer.from_pretrained(path.parent, **kw)
    set_special_tokens(tok, gguf_special_tokens(path), path.name)
    with gguf_progress_bar(progress_enabled()):
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype, **kw)
    return model, tok


def load_folder(folder: Path, dtype: torch.dtype):
    """(model, tokenizer) from a cache folder: weights memory-mapped by safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, tok


def _tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)  # bytes: NaN equals NaN, -0.0 differs from 0.0


def differences(a, a_tok, b, b_tok) -> list[str]:
    """What differs between two loaded (model, tokenizer) pairs: tensor names, dtypes and
    bytes (tied weights as tied), config (its GGUF quantization note and name aside), tokenizer."""
    out = []
    ta, tb = _tensors(a), _tensors(b)
    if ta.keys() != tb.keys():
        out.append(f"tensor names differ: {sorted(ta.keys() ^ tb.keys())[:3]}")
    for n in sorted(ta.keys() & tb.keys()):
        x, y = ta[n], tb[n]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bytes(x), _bytes(y)):
            out.append(f"tensor {n} differs")
    ties_a = {n for n, p in a.named_parameters(remove_duplicate=True)}
    ties_b = {n for n, p in b.named_parameters(remove_duplicate=True)}
    if ties_a != ties_b:
        out.append("tied weights differ")

    def config(m):
        c = m.config.to_dict()
        for k in ("quantization_config", "_name_or_path"):
            c.pop(k, None)
        return c

    if config(a) != config(b):
        ca, cb = config(a), config(b)
        out.append(f"config differs: {sorted(k for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k))}")
    if type(a_tok) is not type(b_tok) or a_tok.backend_tokenizer.to_str() != b_tok.backend_tokenizer.to_str() \
            or a_tok.chat_template != b_tok.chat_template or a_tok.special_tokens_map != b_tok.special_tokens_map:
        out.append("tokenizer differs")
    return out


def _write_folder(tmp: Path, model, tok, key: dict) -> None:
    """The weights (a tied tensor once), config (without GGUF's quantization note) and tokenizer, fsync'ed;
    key.json last."""
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:  # tied (lm_head = embed_tokens): from_pretrained ties it again from the config
            continue
        seen.add(t.data_ptr())
        tensors[name] = t.detach().contiguous()
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    type(model.config).from_dict(config).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / KEY_FILE).write_text(json.dumps({"key": key, "weights_bytes": (tmp / WEIGHTS).stat().st_size}, indent=1))
    for path in tmp.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def load_dequantized(gguf: Path, dtype: torch.dtype, root: Path):
    """(model, tokenizer) of the GGUF file `gguf` in `dtype`: from its cached de-quantized copy
    under `root`, which is built first if it is missing or invalid (see the module docstring)."""
    key = cache_key(gguf, dtype)
    folder = folder_for(root, gguf, key)
    if is_valid(folder, key):
        try:
            return load_folder(folder, dtype)
        except Exception as exc:  # damaged after all (e.g. a bad header): build it again
            log.warning("de-quantized model cache %s unreadable (%s); rebuilding it", folder, exc)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / ".lock", "a+")  # one for every build under root: builds are rare
    except OSError as exc:
        log.warning("cannot write the model cache in %s (%s); loading %s directly", root, exc, gguf.name)
        return load_gguf(gguf, dtype)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if is_valid(folder, key):  # another process built it while this one waited for the lock
            return load_folder(folder, dtype)
        return _build(gguf, dtype, root, folder, key)


def _build(gguf: Path, dtype: torch.dtype, root: Path, folder: Path, key: dict):
    """Load the GGUF, write its copy under a temporary name, load that back, compare, rename into place."""
    model, tok = load_gguf(gguf, dtype)
    log.info("de-quantizing %s once into %s", gguf.name, folder)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
        _write_folder(tmp, model, tok, key)
        ckpt.follow_umask(tmp)  # mkdtemp and safetensors make 0700/0600: as the user's umask says
        cached, cached_tok = load_folder(tmp, dtype)
        diff = differences(model, tok, cached, cached_tok)
        if diff:
            log.warning("the de-quantized copy of %s differs from the GGUF model (%s); not cached",
                        gguf.name, "; ".join(diff[:3]))
            return model, tok
        if folder.exists():  # invalid (checked before): set aside, then replaced
            aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.bad.", dir=root))
            os.replace(folder, aside / "old")
            shutil.rmtree(aside, ignore_errors=True)
        os.rename(tmp, folder)
        tmp = None
        ckpt.fsync_dir(root)
        return cached, cached_tok
    except Exception as exc:  # the cache is an optimisation: the model as loaded is still right
        log.warning("cannot write the model cache in %s (%s); using %s as loaded", root, exc, gguf.name)
        return model, tok
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def cached_folder(gguf: Path, dtype: torch.dtype, root: Path) -> Path | None:
    """The cache folder of `gguf` in `dtype` (built first when missing), a model folder that
    ``AutoModelForCausalLM.from_pretrained`` loads alone: what exported adapters name as their
    base (`pflalign.run.adapter_folder.base_model`); None when the cache cannot be written. It gets a
    README.md saying that its weights are the GGUF's de-quantized (not part of the key)."""
    key = cache_key(gguf, dtype)
    folder = folder_for(root, gguf, key)
    if not is_valid(folder, key):
        load_dequantized(gguf, dtype, root)
        if not is_valid(folder, key):
            return None
    note = folder / "README.md"
    if not note.exists():
        try:
            note.write_text(f"# {gguf.stem}, de-quantized\n\nThe weights of the GGUF file {gguf.name} (SHA-256 "
                            f"{key['gguf_sha256']}), de-quantized to {dtype} by transformers' GGUF loader: not the "
                            "original release's weights. Written by pflalign's model cache; "
                            "`AutoModelForCausalLM.from_pretrained` loads this folder.\n")
        except OSError:  # a read-only cache: the folder loads all the same
            pass
    return folder
