"""Where a lockstep round's operations go outside the forward/backward pass (issue 55), counted on
the CPU: each aten operation dispatched but a view is one kernel launch or more on a GPU, where a
round's work outside the pass is bound by launches, not arithmetic (views, metadata only, are
counted apart).

    .venv/bin/python benchmarks/round_ops.py --out benchmarks/results/round-ops.json

A 30-layer Llama of toy widths (SmolLM2-135M's 30 layers and its 420 LoRA tensors at r16 on every
linear layer, hidden 64: the count of tensors, not their size, sets the count of operations) on the
synthetic federation's 4 clients, 2 rounds x 5 local steps, `--batch clients` (CUDA's default), per
method, with the updates tensor by tensor (the CPU's) and over flat buffers (CUDA's,
params.FLAT_DEVICES forced here). Each operation is counted in the innermost phase running it
(`PHASES`: the pass, the GSNR sums, the non-finite checks, the method's step, a client round's start
and end, the client files, aggregation, checkpoint); the final scoring is left out. Per round:
operations per phase, and their sum outside the pass against the pass's own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pflalign import params as P  # noqa: E402
from pflalign.config import build_config  # noqa: E402
from pflalign.methods.base import Aggregation  # noqa: E402
from pflalign.model.federated_lm import FederatedLM  # noqa: E402
from pflalign.run import client as client_mod  # noqa: E402
from pflalign.run import engine as engine_mod  # noqa: E402
from pflalign.run.client_store import ClientStore  # noqa: E402
from pflalign.run.lifecycle import Recorder  # noqa: E402
from pflalign.run.server import Server  # noqa: E402

ROUNDS, LOCAL_STEPS = 2, 5
METHODS = ("pflalign", "fedavg", "fedprox", "fedsam", "scaffold", "feddyn", "fedyogi", "fedgloss", "ffa-lora", "fedsa-lora",
           "fedsvd")  # Table 1's eleven

# (owner, attribute, phase): every call of owner.attribute counts its operations under phase
PHASES = [
    (FederatedLM, "routed_loss_and_grads", "pass"),
    (FederatedLM, "loss_and_grads", "pass"),
    (client_mod.GradientStats, "add", "gsnr sums"),
    (client_mod, "_non_finite", "non-finite checks"),
    (client_mod.LocalRound, "__init__", "client start"),
    (client_mod.LocalRound, "finish", "client end (norms, GSNR, metrics, message)"),
    (ClientStore, "save", "client files"),
    (ClientStore, "load", "client files"),
    (Aggregation, "add", "aggregation"),
    (Server, "finish_round", "aggregation"),
    (Recorder, "save", "checkpoint"),
    (engine_mod.Federation, "_score", "final scoring (left out)"),
]


class Counting(TorchDispatchMode):
    """Counts each dispatched operation under the innermost phase on `stack`: views (metadata only,
    no kernel: `views`) apart from the rest (`ops`: a kernel launch or more each on a GPU)."""

    def __init__(self):
        super().__init__()
        self.stack, self.ops, self.views = ["other"], Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.views if func.is_view else self.ops)[self.stack[-1]] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def phases(counting: Counting, method_class):
    """Every `PHASES` callable (and the method's local_step) wrapped to label its operations."""
    saved = []

    def wrap(owner, name, phase):
        original = getattr(owner, name)

        def labelled(*args, **kwargs):
            counting.stack.append(phase)
            try:
                return original(*args, **kwargs)
            finally:
                counting.stack.pop()
        saved.append((owner, name, original))
        setattr(owner, name, labelled)

    for owner, name, phase in [*PHASES, (method_class, "local_step", "method step")]:
        wrap(owner, name, phase)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def model_folder(where: Path) -> str:
    """A 30-layer toy Llama (the tiny model's tokenizer, hidden 64) saved as a model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pflalign.model.base import _tiny_tokenizer

    tok = _tiny_tokenizer(chat=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=30,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(where)
    tok.save_pretrained(where)
    return str(where)


def count(method: str, flat: bool, model: str, root: Path) -> dict:
    from pflalign.methods import method_class

    cfg = build_config(None, {
        "model": model, "method": method, "lora": {"r": 16, "alpha": 32}, "rounds": ROUNDS,
        "local_steps": LOCAL_STEPS, "batch_size": 2, "max_seq_len": 96, "defaults": "paper",
        "data": {"name": "synthetic", "max_train": 20, "max_test": 2},
        "eval": {"max_new_tokens": 2, "base_model": False}})
    saved = P.FLAT_DEVICES
    P.FLAT_DEVICES = {"cpu", "cuda"} if flat else set()
    counting = Counting()
    tic = time.perf_counter()
    try:
        with phases(counting, method_class(method)), counting:
            engine_mod.run(cfg, root / f"{method}-{'flat' if flat else 'tensors'}", progress=False, batch="clients")
    finally:
        P.FLAT_DEVICES = saved
    def per_round(counter: Counter) -> dict:
        rows = {phase: n / ROUNDS for phase, n in counter.items() if phase != "final scoring (left out)"}
        return dict(sorted(rows.items(), key=lambda kv: -kv[1]))

    ops = per_round(counting.ops)
    outside = sum(n for phase, n in ops.items() if phase != "pass")
    return {"seconds": time.perf_counter() - tic, "per_round": ops, "views_per_round": per_round(counting.views),
            "outside_pass_per_round": outside, "pass_per_round": ops.get("pass", 0),
            "outside_over_pass": outside / max(ops.get("pass", 1), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "round-ops.json"))
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args(argv)
    report = {"doc": __doc__, "rounds": ROUNDS, "local_steps": LOCAL_STEPS, "clients": 4, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = model_folder(root / "model")
        report["lora_tensors"] = 30 * 7 * 2
        for method in args.methods.split(","):
            for flat in (False, True):
                row = count(method, flat, model, root)
                report.setdefault(method, {})["flat" if flat else "tensor_by_tensor"] = row
                print(f"{method:10s} {'flat' if flat else 'tensors':8s} outside the pass {row['outside_pass_per_round']:>9,.0f}"
                      f" a round, the pass {row['pass_per_round']:>9,.0f}", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
