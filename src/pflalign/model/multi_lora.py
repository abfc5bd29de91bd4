"""Several clients' LoRA adapters over the one frozen base, in one forward (and backward).

In a federated round every client trains the same frozen base with its own adapter, so K
clients' minibatches can share one pass through the base: the rows of their batches are
concatenated, the base's matrix products run once over all of them, and each LoRA projection
adds, to each client's tokens, the low-rank update of that client's adapter only (multi-LoRA
training, m-LoRA; multi-LoRA serving, S-LoRA / punica: the adapters are never merged).

`Routing` says which tokens are whose: runs of (adapter index, token count) over the call's
tokens in their flattened order (rows of a packed batch, or whole padded rows). While a routing
is set (`routed`), every PEFT LoRA linear of the model computes

    y = W x + s · B_j A_j x   for the tokens x of adapter j,

one pair of small matrix products per run, with PEFT's own operation order
(``lora_B(lora_A(x)) * scaling``). The adapters are the clients' own tensors (leaves that
require gradients), so a backward leaves each client's gradient in its own tensors' ``.grad``:
with a loss that is the sum of the clients' own mean losses, exactly its own gradient, as if it
had run alone (up to the rounding of sums taken in another order; tested).

Generation routes the same way (`row_router`): each row of a decoding batch with its own
adapter, so several clients' models are scored in one loop (run/batched_scoring.py).

The fused SwiGLU MLP (lora_mlp.py) routes too: under a routing its three LoRA projections take
each run's adapter inside the one autograd function (`routing_of`), so a shared pass keeps the
fused path's activations and element-wise savings. Nothing changes while no routing is set:
the layers are switched the first time a model is routed (`install`), and their forward then
calls PEFT's own unless a routing is active.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..params import Params


@dataclass
class Routing:
    """Whose tokens are which in one call: `runs` of (j, n), in the call's flattened token order,
    say that the next n tokens take adapter `adapters[j]` (its tensors by the model's LoRA names).
    `rows` (decoding, `row_router`): each row's adapter index, the call's rows of equal width, and
    `stacks` a cache of every layer's stacked factors for the whole decoding loop, so that on a
    device in GATHER_DEVICES each projection takes all rows' updates in two batched products over
    the rows' gathered factors, however many runs the rows make (`row_index`: `rows` on that
    device, made at the call's first such projection)."""

    adapters: list[Params]
    runs: list[tuple[int, int]]
    rows: list[int] | None = None
    stacks: dict | None = None
    row_index: torch.Tensor | None = None


# where decoding with a per-row adapter gathers each row's factors (a few launches a projection) instead
# of a pair of products per run of rows: CUDA, where launches bound the decoding (benchmarks/results/
# gpu_eval_batch.json); not yet timed there (benchmarks/gpu.py's scoring section). The CPU keeps the
# loop over runs, timed in benchmarks/results/batched-scoring-cpu.json.
GATHER_DEVICES = {"cuda"}


class _Slot:
    """The routing now in force for one model's layers (None: every layer runs as PEFT's)."""

    def __init__(self):
        self.routing: Routing | None = None


def _lora_linears(model):
    from peft.tuners.lora import Linear as LoraLinear

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLinear)]


def install(model, names: set[str]) -> _Slot:
    """Switch `model`'s PEFT LoRA linears to routed forwards (once; later calls return the same
    slot). `names`: the adapter's tensor names, each layer's A and B among them (checked)."""
    slot = getattr(model, "_pflalign_routing_slot", None)
    if slot is not None:
        return slot
    slot = _Slot()
    for name, layer in _lora_linears(model):
        a_name, b_name = f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight"
        if a_name not in names or b_name not in names:
            raise ValueError(f"LoRA layer {name} has no 'default' adapter tensors among the model's adapter")
        layer._pflalign_slot = slot
        layer._pflalign_names = (a_name, b_name)
        layer._pflalign_unrouted_forward = layer.forward
        layer.forward = types.MethodType(_routed_forward, layer)
    model._pflalign_routing_slot = slot
    return slot


def routing_of(layer) -> Routing | None:
    """The routing `layer` (a PEFT LoRA linear) computes under now (None: PEFT's own forward)."""
    slot = getattr(layer, "_pflalign_slot", None)
    return None if slot is None else slot.routing


@contextlib.contextmanager
def routed(slot: _Slot, routing: Routing):
    """Inside: the layers of `slot`'s model add each run's own adapter (module docstring)."""
    if slot.routing is not None:
        raise RuntimeError("a routing is already in force")
    slot.routing = routing
    try:
        yield
    finally:
        slot.routing = None


def _routed_forward(layer, x, *args, **kwargs):
    routing = layer._pflalign_slot.routing
    if routing is None:
        return layer._pflalign_unrouted_forward(x, *args, **kwargs)
    if layer.merged or layer.disable_adapters or layer.lora_variant or list(layer.active_adapters) != ["default"]:
        raise RuntimeError("a routed forward needs the plain 'default' LoRA adapter (not merged, not disabled)")
    result = layer.get_base_layer()(x, *args, **kwargs)
    a_name, b_name = layer._pflalign_names
    dropped = layer.lora_dropout["default"](x)
    flat = dropped.reshape(-1, x.shape[-1])
    sizes = [n for _, n in routing.runs]
    if sum(sizes) != flat.shape[0]:
        raise ValueError(f"routing covers {sum(sizes)} tokens, the call has {flat.shape[0]}")
    if not torch.is_grad_enabled() and routing.rows is not None and x.device.type in GATHER_DEVICES:
        if a_name not in routing.stacks:  # once per decoding loop and layer
            routing.stacks[a_name] = (torch.stack([adapter[a_name] for adapter in routing.adapters]),
                                      torch.stack([adapter[b_name] for adapter in routing.adapters]))
        if routing.row_index is None:
            routing.row_index = torch.tensor(routing.rows, device=x.device)
        a_all, b_all = routing.stacks[a_name]
        # each row's factors: rows x r x d_in, rows x d_out x r; the update scaled, cast and added in
        # one operation (a decode step is bound by launches there: benchmarks/decode_ops.py)
        update = _per_row_update(flat, a_all[routing.row_index], b_all[routing.row_index])
        result.view(len(routing.rows), -1, result.shape[-1]).add_(update, alpha=layer.scaling["default"])
        return result
    if not torch.is_grad_enabled():  # generation: each run's update added in place (no full-size delta to copy)
        out, start = result.view(-1, result.shape[-1]), 0
        for (j, n), tokens in zip(routing.runs, flat.split(sizes)):
            a, b = routing.adapters[j][a_name], routing.adapters[j][b_name]
            out[start:start + n] += (F.linear(F.linear(tokens.to(a.dtype), a), b) * layer.scaling["default"]).to(out.dtype)
            start += n
        return result
    owners = [j for j, _ in routing.runs]
    if len(owners) > 1 and len(set(sizes)) == 1 and len(set(owners)) == len(owners):
        # runs of one size, each its own adapter (a GPU's padded lockstep pass of clients with
        # equal batches): all runs' products in two batched matrix products over the stacked
        # adapters, where the loop below launches two (and their casts) per run
        a = torch.stack([routing.adapters[j][a_name] for j in owners])  # K x r x d_in
        b = torch.stack([routing.adapters[j][b_name] for j in owners])  # K x d_out x r
        tokens = _for_products(flat.reshape(len(owners), -1, flat.shape[-1]), a)
        # taken as B_i (A_i xᵀ), so that the gradients of a and b come back in their own layout and
        # each client's slice is handed to its tensor as it is: a transposed one was copied (two
        # operations a tensor a client, 10,080 a step at SmolLM2's 420 tensors and 12 clients)
        update = torch.bmm(b, torch.bmm(a, tokens.transpose(1, 2))).transpose(1, 2) * layer.scaling["default"]
        return (result.view(len(owners), -1, result.shape[-1]) + update.to(result.dtype)).reshape(result.shape)
    else:
        parts = []
        for (j, _), tokens in zip(routing.runs, flat.split(sizes)):
            a, b = routing.adapters[j][a_name], routing.adapters[j][b_name]
            parts.append(F.linear(F.linear(_for_products(tokens, a), a), b))  # PEFT's lora_B(lora_A(x))
        delta = parts[0] if len(parts) == 1 else torch.cat(parts)  # one run (a client alone): no copy
    delta = delta * layer.scaling["default"]
    return result + delta.view(*result.shape[:-1], delta.shape[-1]).to(result.dtype)


def _per_row_update(flat: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B_i(A_i x) for the i-th of len(a) equal consecutive groups of `flat`'s tokens, in two batched
    products: a (groups, r, d_in), b (groups, d_out, r); (groups, tokens of a group, d_out)."""
    tokens = _for_products(flat.reshape(len(a), -1, flat.shape[-1]), a)
    return torch.bmm(torch.bmm(tokens, a.transpose(1, 2)), b.transpose(1, 2))


def _for_products(tokens: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """`tokens` in the adapter's dtype for its products, as PEFT casts a LoRA branch's input; under
    autocast as they are, since autocast casts both operands to bf16 anyway (a bf16 input's round
    trip through float32 is exact: two casts a projection, and two in the backward, for the same
    values; federated_lm.FederatedLM.adapter_autocast)."""
    return tokens if torch.is_autocast_enabled(tokens.device.type) else tokens.to(a.dtype)


def runs_of(owners: list[int], sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive pieces (owner, size) merged where the owner repeats."""
    runs: list[tuple[int, int]] = []
    for j, n in zip(owners, sizes):
        if runs and runs[-1][0] == j:
            runs[-1] = (j, runs[-1][1] + n)
        else:
            runs.append((j, n))
    return runs


def row_router(model, names: set[str], adapters: list[Params]):
    """For decoding with a per-row adapter (evaluate.py's `RowAdapters`): `route(owners, n)`, the
    context in which one forward of rows of n tokens each (a prefill of padded rows: n their
    width; a decode step: 1) computes row r with `adapters[owners[r]]`. The rows' tokens are
    contiguous in the flattened order, so a row is a run; neighbouring rows of one adapter join."""
    slot = install(model, names)
    stacks: dict = {}  # every layer's stacked factors, built at its first call (GATHER_DEVICES)

    def route(owners: list[int], n: int):
        return routed(slot, Routing(adapters, runs_of(owners, [n] * len(owners)), owners, stacks))

    return route
