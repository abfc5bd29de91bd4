"""`FederatedLM`: the one resident base model with one live LoRA adapter, which every client and
the server share (a client's model is only its LoRA tensors, copied in and out: `get_lora` /
`set_lora`), its loss and gradients (packed rows on a CPU, padded batches on a GPU), several
clients' adapters in one pass (`routed_loss_and_grads`, multi_lora.py), merging for generation.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import UserError
from .. import params as params_module
from ..params import Params, clone, copy_each, copy_into, flat_buffer, zeros_like
from ..prompts import IGNORE
from ..settings import LoraSettings
from . import multi_lora
from .attention import use_segment_attention
from .base import _first_line, load_base_model
from .head_loss import head_cross_entropy_sum
from .lora_mlp import use_fused_lora_mlp
from .rms_norm import use_fused_rms_norm


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
    # the training forward under torch.autocast(bfloat16) (`adapter_autocast`); None: on CUDA with a
    # bf16 base, as the HF Trainer's bf16=True runs it; True/False: always/never (tests, benchmarks)
    autocast: bool | None = None

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
        _one_buffer(params)
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
        copy_into({n: p.detach() for n, p in self.lora.items()}, params)  # on CUDA one copy (`_one_buffer`)

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
        _zero_grads(self.lora)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if unpadded is None:
            unpadded = self.device.type == "cpu"
        if not unpadded:
            with self._live_adapter_products(batch["input_ids"].numel()):
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
        _gather_grads(self.lora)
        grads = {n: p.grad for n, p in self.lora.items()}
        return value, grads

    def _live_adapter_products(self, tokens: int):
        """Inside: under the bf16 autocast, the live adapter's LoRA products of a pass of `tokens`
        tokens take bf16 views of one cast of the whole adapter (`_bf16_copy`; routed as one run,
        model/multi_lora.py: PEFT's products, the gradients back to the live float32 tensors),
        where autocast cast each tensor, and its gradient back, on its own at every step: 448
        operations a step at LLaMA-3.2-1B's 224 tensors become a handful. Else nothing changes.
        (Clients in one routed pass keep autocast's casts of their stacked factors: one-cast copies
        of 12 SmolLM2 clients' adapters counted 11% fewer operations but 25,000 more views, each
        host time with no launch; unmeasured on a GPU, so not taken: benchmarks/README.md.)"""
        if not self._autocast_on() or self.dtype != torch.float32:
            return contextlib.nullcontext()
        slot = multi_lora.install(self.model, set(self.lora))
        return multi_lora.routed(slot, multi_lora.Routing([_bf16_copy(self.lora)], [(0, tokens)]))

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
        with self.adapter_autocast():
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                              **extra).last_hidden_state
        keep = labels[:, 1:] != IGNORE
        return hidden[:, :-1][keep], labels[:, 1:][keep], keep

    def adapter_autocast(self):
        """The training forward's precision. With a bf16 base on CUDA (`autocast` None), under
        torch.autocast(bfloat16): the float32 adapters' matrix products run in bf16 on tensor cores,
        their float32 tensors staying the master weights (the gradients and every method's state
        float32), where PEFT alone would cast each LoRA branch's input up to float32 and back
        (issue 55: the casts led the profile; autocast was 1.24x on LLaMA-3.2-1B, 4 x 1024,
        benchmarks/results/gpu-after-server.json). Elsewhere (float32, the CPU) the forward as it
        is. The LM head's loss stays outside (its logits accumulated in float32, model/head_loss.py).

        Inside, PEFT's cast of each LoRA branch's bf16 input up to the adapter's float32 is switched
        off (`_bf16_products`): autocast cast it straight back to bf16 for the product, so that was
        two casts a projection in the forward and two in the backward for the same values (a bf16
        value's round trip through float32 is exact): bit for bit the same loss and gradients
        (tests/test_mixed_precision.py), 442 fewer operations a step at LLaMA-3.2-1B's 112
        projections; with a client's one-cast adapter (`_live_adapter_products`) its step takes
        25% fewer than plain autocast's (benchmarks/step_ops.py)."""
        if not self._autocast_on():
            return contextlib.nullcontext()
        return _bf16_products(self.device.type, self._lora_layers)

    def _autocast_on(self) -> bool:
        on = self.autocast
        if on is None:
            on = self.device.type == "cuda" and self.base_dtype == torch.bfloat16
        return bool(on)

    @property
    def _lora_layers(self) -> list:
        """The model's PEFT LoRA layers (found once, kept on the model)."""
        layers = getattr(self.model, "_pflalign_lora_layers", None)
        if layers is None:
            from peft.tuners.lora import LoraLayer

            layers = [m for m in self.model.modules() if isinstance(m, LoraLayer)]
            self.model._pflalign_lora_layers = layers
        return layers

    def _head_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Σ cross-entropy of the LM head's logits of `inputs` against `targets`. The inputs take the
        head's dtype first: under CUDA's autocast a LayerNorm's output is float32 beside a bf16 head
        (OPT's final norm; the CPU's autocast keeps it bf16), and the head's product then runs in
        bf16, as it would under autocast."""
        head = self.model.get_base_model().get_output_embeddings()
        inputs = inputs.to(head.weight.dtype)
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
        _zero_grads(*adapters)
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
            _gather_grads(*adapters)
            return values
        lengths = joined["attention_mask"].sum(dim=1).tolist()
        rows = pack_rows(joined, pack_tokens, self.dtype, segments=self.segment_attention)
        for row, group in zip(rows, pack_groups(lengths, pack_tokens)):
            token_owner = torch.cat([torch.full((lengths[i],), owners[i], device=self.device) for i in group])[None]
            self._routed_backward(row, token_owner, adapters, counts, values, slot)
        _gather_grads(*adapters)
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


def _one_buffer(lora: dict[str, torch.nn.Parameter]) -> None:
    """On a device of `params.FLAT_DEVICES` (CUDA), the adapter's parameters (which PEFT allocates
    one by one) re-pointed at views of one flat buffer, values kept, in place (the modules keep
    their Parameters): the one-client engine's updates, and Flower's clients', then run once over
    it as the lockstep's do (params.aligned), and `set_lora`/`get_lora` copy once. Elsewhere as
    PEFT made them (the CPU updates tensor by tensor)."""
    if not params_module.on_flat_device(lora):
        return
    flat = clone(lora)  # one buffer when the tensors share a dtype (they do: the adapter's)
    if flat_buffer(flat) is None or flat_buffer(lora) is not None:
        return
    for p, view in zip(lora.values(), flat.values()):
        p.data = view


def _zero_grads(*adapters: Params) -> None:
    """Each adapter's ``.grad`` buffers zeroed, in few launches (one `_foreach_zero_` for all);
    an adapter without them gets them as views of one flat zeroed buffer (params.empty_like), so
    that a step can update its tensors as one (params.flat_buffers). On a device of
    `params.FLAT_DEVICES` (CUDA) they are dropped instead (``.grad`` None): the backward then hands
    each tensor its gradient, where into a buffer it adds it, one kernel per LoRA tensor (420 a
    client step at SmolLM2); `_gather_grads` makes them one buffer after the backward."""
    held = []
    for adapter in adapters:
        if params_module.on_flat_device(adapter):
            for p in adapter.values():
                p.grad = None
        elif any(p.grad is None for p in adapter.values()):
            for p, g in zip(adapter.values(), zeros_like({n: p.detach() for n, p in adapter.items()}).values()):
                p.grad = g
        else:
            held.extend(p.grad for p in adapter.values())
    if held:
        torch._foreach_zero_(held)


def _gather_grads(*adapters: Params) -> None:
    """After a backward on a device of `params.FLAT_DEVICES`: each adapter's gradients copied into
    views of one flat buffer, set back as its ``.grad`` (zeros for a tensor the backward did not
    reach, as the zeroed buffers held), so that a step updates them as one. The buffer is the
    adapter's own, made at its first backward and overwritten by each (`_grad_views`), as the CPU's
    ``.grad`` buffers are: one multi-tensor copy a step, where a new concatenation made a view, a
    slice, a reshape and a detach per tensor each step (~900 host operations a step at LLaMA-3.2-1B's
    224 LoRA tensors). Elsewhere nothing: the buffers `_zero_grads` keeps are one already."""
    for adapter in adapters:
        if not params_module.on_flat_device(adapter):
            continue
        views = _grad_views(adapter)
        reached = [(v, p.grad) for v, p in zip(views.values(), adapter.values()) if p.grad is not None]
        missed = [v for v, p in zip(views.values(), adapter.values()) if p.grad is None]
        copy_each([v for v, _ in reached], [g for _, g in reached])
        if missed:
            torch._foreach_zero_(missed)
        for p, v in zip(adapter.values(), views.values()):
            p.grad = v


def _bf16_copy(adapter: Params) -> Params:
    """`adapter` as bf16 views of one cast of all its tensors, in autograd: the same values autocast
    gives each (a float32 → bf16 cast rounds each element alike), and the gradients come back to
    `adapter`'s tensors float32 through one cast and one split, where autocast cast each back."""
    tensors = list(adapter.values())
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(torch.bfloat16)
    pieces = flat.split([t.numel() for t in tensors])
    return {n: piece.view(t.shape) for (n, t), piece in zip(adapter.items(), pieces)}


@contextlib.contextmanager
def _bf16_products(device_type: str, lora_layers: list):
    """torch.autocast(bfloat16) with PEFT's input casts of `lora_layers` off (`adapter_autocast`),
    each layer's own setting back on exit."""
    saved = [getattr(layer, "cast_input_dtype_enabled", True) for layer in lora_layers]
    for layer in lora_layers:
        layer.cast_input_dtype_enabled = False
    try:
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            yield
    finally:
        for layer, before in zip(lora_layers, saved):
            layer.cast_input_dtype_enabled = before


def _grad_views(adapter: Params) -> Params:
    """The adapter's gradient buffer as views of one flat buffer in its order (`params.empty_like`),
    kept on its first tensor (an attribute: it lives as long as the adapter) and made anew only
    when the adapter's names, shapes, dtype or device are not those it was made for."""
    first = next(iter(adapter.values()))
    views = getattr(first, "_pflalign_grad_views", None)
    if (views is None or list(views) != list(adapter)
            or any(v.shape != p.shape or v.dtype != p.dtype or v.device != p.device
                   for v, p in zip(views.values(), adapter.values()))):
        views = params_module.empty_like({n: p.detach() for n, p in adapter.items()})
        first._pflalign_grad_views = views
    return views


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
