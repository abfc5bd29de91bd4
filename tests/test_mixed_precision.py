"""Mixed precision (issue 39): with dtype=bfloat16 the frozen base is stored in bf16, while the
LoRA adapter, every method's state, the aggregation and the loss stay float32 (PEFT's
autocast_adapter_dtype, as TRL and FlowerTune runs do). Tiny models only: bf16 is slow on CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pflalign import checkpoint as ckpt
from pflalign.run.client_store import client_records, tensors_in
from pflalign.config import build_config
from pflalign.run.engine import run
from pflalign.run.export import ADAPTERS
from pflalign.model import FederatedLM, LoraSettings

from test_engine import TINY

# bf16 keeps 8 mantissa bits: the tiny runs' train losses move by ~1e-4 relative and the final
# adapters by ~1e-2 (measured 2026-11-26); these bounds leave room and still catch a run that
# went another way (different data order or update rule: losses differ by > 10%)
LOSS_RTOL, ADAPTER_RTOL = 2e-3, 5e-2


def _config(method: str, dtype: str):
    return build_config(None, {**json.loads(json.dumps(TINY)), "method": method, "dtype": dtype})


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / ckpt.METRICS).read_text().splitlines()
            if json.loads(line).get("event") == "train_step"]


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-opt"])
def test_bf16_base_float32_adapter(family):
    lm = FederatedLM.build(family, LoraSettings(r=4, alpha=8), seed=0, dtype=torch.bfloat16)
    base = lm.model.get_base_model()
    frozen = {p.dtype for p in base.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert {p.dtype for p in lm.lora.values()} == {torch.float32} and lm.dtype == torch.float32
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]]), "attention_mask": torch.ones(1, 6, dtype=torch.long),
             "labels": torch.tensor([[-100, -100, -100, 8, 9, 10]])}
    loss = lm.loss(**batch)
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    value, grads = lm.loss_and_grads(batch)
    assert math.isfinite(value) and {g.dtype for g in grads.values()} == {torch.float32}


@pytest.mark.parametrize("method", ["pflalign", "fedavg", "scaffold", "fedadam"])  # fedadam: FedOpt's moments
def test_two_bf16_rounds_are_float32_state_finite_and_close_to_float32(method, tmp_path):
    run(_config(method, "float32"), tmp_path / "fp32", progress=False)
    run(_config(method, "bfloat16"), tmp_path / "bf16", progress=False)
    saved = ckpt.load_checkpoint(tmp_path / "bf16" / ckpt.CHECKPOINT)
    reference = ckpt.load_checkpoint(tmp_path / "fp32" / ckpt.CHECKPOINT)
    # the global adapter, the server's state and every client's state and personalized adapter
    clients = list(tensors_in(client_records(tmp_path / "bf16", saved)))
    assert clients  # read from the clients' files (a Sequence, not a list: once walked past unseen)
    held = list(tensors_in(saved["global"])) + list(tensors_in(saved["server_state"])) + clients
    floats = {t.dtype for t in held if t.is_floating_point()}
    assert floats <= {torch.float32, torch.float64} and torch.float32 in floats
    assert all(bool(torch.isfinite(t).all()) for t in held if t.is_floating_point())
    got, want = _losses(tmp_path / "bf16"), _losses(tmp_path / "fp32")
    assert len(got) == len(want) == 8 and all(math.isfinite(x) for x in got)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < LOSS_RTOL
    assert got != want  # the base really ran in bf16
    for n, w in reference["global"].items():
        assert float((saved["global"][n] - w).norm() / w.norm()) < ADAPTER_RTOL, n


def test_bf16_run_exports_float32_adapters_that_peft_loads(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from pflalign.model import load_base_model

    run(_config("fedavg", "bfloat16"), tmp_path / "run", progress=False)
    folder = tmp_path / "run" / ADAPTERS / "global"
    assert {t.dtype for t in load_file(str(folder / "adapter_model.safetensors")).values()} == {torch.float32}
    base, _ = load_base_model("tiny-llama", torch.bfloat16)
    model = PeftModel.from_pretrained(base, str(folder))
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and {p.dtype for p in lora.values()} == {torch.float32}  # PEFT's autocast_adapter_dtype
    saved = ckpt.load_checkpoint(tmp_path / "run" / ckpt.CHECKPOINT)["global"]
    for n, w in saved.items():
        assert torch.equal(lora[n], w), n


def test_bf16_adapter_products_under_autocast_only_on_cuda_with_a_bf16_base():
    """Issue 55: on CUDA with a bf16 base the training forward runs under torch.autocast(bfloat16);
    on the CPU, and in float32 anywhere, the forward is as it was (the pinned results hold)."""
    lm = FederatedLM.build("tiny-llama", LoraSettings(r=4, alpha=8), seed=0, dtype=torch.bfloat16)
    assert not torch.is_autocast_enabled("cpu")
    with lm.adapter_autocast():
        assert not torch.is_autocast_enabled("cpu")  # a CPU model: off
    lm.autocast = True
    with lm.adapter_autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_bf16_adapter_products_keep_float32_gradients_and_state_close_to_float32(tmp_path, monkeypatch):
    """The route a bf16 run takes on CUDA, forced on the CPU: every adapter matmul in bf16 under
    autocast; the adapters' gradients, the methods' state and the checkpoint stay float32, and a
    2-round pFLAlign run stays within the bf16 bounds of the float32 run (and differs from the bf16
    run without autocast: the adapter products really ran in bf16)."""
    lm = FederatedLM.build("tiny-llama", LoraSettings(r=4, alpha=8), seed=0, dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in lm.lora.items():  # B != 0, so that the adapter's products count
            p.add_(torch.randn_like(p) * 0.05)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]),
             "attention_mask": torch.ones(1, 8, dtype=torch.long),
             "labels": torch.tensor([[-100, -100, -100, 8, 9, 10, 11, 12]])}
    plain, plain_grads = lm.loss_and_grads(batch)
    plain_grads = {n: g.clone() for n, g in plain_grads.items()}
    lm.autocast = True
    cast, grads = lm.loss_and_grads(batch)
    assert {g.dtype for g in grads.values()} == {torch.float32}
    assert cast != plain and abs(cast - plain) / abs(plain) < LOSS_RTOL
    run(_config("pflalign", "float32"), tmp_path / "fp32", progress=False)
    monkeypatch.setattr(FederatedLM, "adapter_autocast", lambda self: torch.autocast("cpu", dtype=torch.bfloat16))
    run(_config("pflalign", "bfloat16"), tmp_path / "bf16", progress=False)
    saved = ckpt.load_checkpoint(tmp_path / "bf16" / ckpt.CHECKPOINT)
    reference = ckpt.load_checkpoint(tmp_path / "fp32" / ckpt.CHECKPOINT)
    held = list(tensors_in(saved["global"])) + list(tensors_in(saved["server_state"]))
    assert {t.dtype for t in held if t.is_floating_point()} <= {torch.float32, torch.float64}
    got, want = _losses(tmp_path / "bf16"), _losses(tmp_path / "fp32")
    assert len(got) == len(want) == 8
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < LOSS_RTOL
    for n, w in reference["global"].items():
        assert float((saved["global"][n] - w).norm() / w.norm()) < ADAPTER_RTOL, n


def test_the_head_loss_takes_float32_hidden_states_beside_a_bf16_head():
    """Under CUDA's autocast a LayerNorm returns float32 (the CPU's returns bf16), so OPT's last
    hidden states reach its bf16 head as float32 (OPT-1.3B failed so on an H200, 2026-11-28): the
    loss casts them to the head's dtype, as autocast would, and their gradient comes back float32."""
    lm = FederatedLM.build("tiny-opt", LoraSettings(r=4, alpha=8), seed=0, dtype=torch.bfloat16)
    hidden = torch.randn(5, lm.model.get_base_model().config.hidden_size)
    targets = torch.tensor([1, 2, 3, 4, 5])
    wide = hidden.clone().requires_grad_(True)
    narrow = hidden.to(torch.bfloat16).requires_grad_(True)
    loss = lm._head_loss_sum(wide, targets)
    loss.backward()
    lm._head_loss_sum(narrow, targets).backward()
    assert torch.equal(loss, lm._head_loss_sum(narrow.detach(), targets))  # the same bf16 product
    assert wide.grad.dtype == torch.float32 and torch.equal(wide.grad, narrow.grad.float())


class _Ops(TorchDispatchMode):
    """Counts the operations dispatched (views apart: metadata only, no kernel on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-opt"])
@pytest.mark.parametrize("routed", [False, True], ids=["one client", "two clients in one pass"])
def test_bf16_products_leave_out_the_casts_autocast_repeats_bit_for_bit(routed, family, monkeypatch):
    """Issue 55: under the bf16 autocast (CUDA's with a bf16 base, forced here) a LoRA branch's bf16
    input is no longer cast up to the adapter's float32 (by PEFT, or by the routed pass of clients
    in lockstep) only for autocast to cast it back, and a client alone takes its float32 adapter
    as bf16 views of one cast of it all, where autocast cast every tensor, and its gradient back,
    on its own: the step's loss and float32 gradients are bit for bit those of the plain autocast
    step, in fewer operations; outside autocast PEFT casts again."""
    import contextlib

    from peft.tuners.lora import LoraLayer

    from pflalign.model import multi_lora

    lm = FederatedLM.build(family, LoraSettings(r=4, alpha=8), seed=0, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in lm.lora.values():  # B != 0, so that every product counts
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [7, 8, 9, 10, 11, 12, 13, 14]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.where(torch.arange(8) < 3, -100, ids)}
    other = {k: v.flip(0) for k, v in batch.items()}
    adapters = [{n: p.detach().clone().requires_grad_(True) for n, p in lm.lora.items()} for _ in range(2)]
    lm.autocast = True

    def step():
        counted = _Ops()
        with counted:
            if routed:
                losses = lm.routed_loss_and_grads([batch, other], adapters, unpadded=False)
                grads = [{n: p.grad.clone() for n, p in adapter.items()} for adapter in adapters]
            else:
                losses, grads = lm.loss_and_grads(batch, unpadded=False)
                grads = [{n: g.clone() for n, g in grads.items()}]
        return losses, grads, counted.ops

    step()  # the first step allocates the gradients' buffers: count the second
    losses, grads, ops = step()
    with monkeypatch.context() as m:  # the plain autocast step: PEFT's casts, every tensor cast alone
        m.setattr(FederatedLM, "adapter_autocast", lambda self: torch.autocast("cpu", dtype=torch.bfloat16))
        m.setattr(FederatedLM, "_live_adapter_products", lambda self, tokens: contextlib.nullcontext())
        m.setattr(multi_lora, "_for_products", lambda tokens, a: tokens.to(a.dtype))
        step()
        cast_losses, cast_grads, cast_ops = step()
    assert losses == cast_losses
    for mine, theirs in zip(grads, cast_grads):
        assert all(g.dtype == torch.float32 and torch.equal(g, theirs[n]) for n, g in mine.items())
    projections = len([m for m in lm.model.modules() if isinstance(m, LoraLayer)])
    # measured 2026-11-29 at 14: 119 fewer alone (input and weight casts), 50 in the routed pass (input casts)
    assert cast_ops - ops >= (6 if not routed else 3) * projections, (cast_ops, ops, projections)
    assert all(getattr(m, "cast_input_dtype_enabled", True) for m in lm.model.modules() if isinstance(m, LoraLayer))
