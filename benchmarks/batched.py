"""Clients in lockstep on the CPU (`--batch clients`): one pass for K clients against K passes.

    .venv/bin/python benchmarks/batched.py --out benchmarks/results/batched-cpu.json

SmolLM2-135M's architecture (gpu.py's ARCHS, random weights, float32 as on CPU runs) with LoRA
r16 α32 on every linear layer; K clients with adapters of their own and FLAN-shaped minibatches
(4 examples of 60 to 250 tokens, the last third the response). The same batches two ways, in
one process: one client after another (`set_lora` + `loss_and_grads`, the sequential engine's
step) and all K in one pass (`lockstep.shared_pass`, the lockstep engine's: `routed_loss_and_grads`,
or for K = 1 the client's own pass). Both pack rows of
at most 512 tokens and keep one row's activations at a time, so their memory is alike. Each
setting's fastest of `--repeats` timed passes (after one untimed; the two ways in turn), tokens/s,
the ratio, and the largest relative difference of a client's gradient between the two (a check, not a timing).
The machine may be shared (a background job at nice 19 on ours): figures are indicative.

`--part score` times the final evaluation both ways (run/batched_scoring.py): K clients of `--score-prompts`
FLAN-shaped prompts (60 to 250 tokens) each, every client scored with its personalized adapter and the
global one, `--max-new-tokens` greedy tokens at evaluation batch 64 (the default). One client's model
after another as the sequential engine does (`set_lora`, the adapter merged, `evaluate.generate`), against
all of them in one decoding loop, each row with its own adapter (`generate_per_adapter`). Tokens/s counts
the generated tokens; the predictions of the two must be equal (checked, not timed).

    .venv/bin/python benchmarks/batched.py --part score --layers 6 --clients 1,4,8 --repeats 2 \
        --out benchmarks/results/batched-scoring-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu import ARCHS  # noqa: E402

from pflalign.config import LoraSettings  # noqa: E402
from pflalign.model import FederatedLM  # noqa: E402
from pflalign.prompts import IGNORE  # noqa: E402
from pflalign.evaluate import generate  # noqa: E402
from pflalign.run.batched_scoring import generate_per_adapter  # noqa: E402
from pflalign.run.lockstep import PassSize, own_adapter, shared_pass  # noqa: E402


def build(arch: str, layers: int | None) -> FederatedLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(ARCHS[arch])
    if layers is not None:  # the architecture's layers, fewer of them (a quicker measurement)
        spec["num_hidden_layers"] = layers
    assert spec.pop("family") == "llama"
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**spec))
    return FederatedLM.from_base(base, None, LoraSettings(r=16, alpha=32), seed=0, device="cpu")


def flan_batch(g: torch.Generator, vocab: int, size: int = 4) -> dict:
    lengths = torch.randint(60, 251, (size,), generator=g).tolist()
    width = max(lengths)
    ids = torch.randint(3, vocab, (size, width), generator=g)
    mask = torch.zeros(size, width, dtype=torch.long)
    labels = torch.full((size, width), IGNORE)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        labels[i, 2 * n // 3:n] = ids[i, 2 * n // 3:n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def timed(fns, repeats: int) -> list[float]:
    """Each function's fastest of `repeats` calls after an untimed one, the functions' calls taken
    in turn (a, b, a, b, ...): on a shared machine the least disturbed of each, and a change of
    the machine's load falls on both alike."""
    for fn in fns:
        fn()  # untimed: first-call allocations
    seconds = [[] for _ in fns]
    for _ in range(repeats):
        for fn, own in zip(fns, seconds):
            tic = time.perf_counter()
            fn()
            own.append(time.perf_counter() - tic)
    return [min(own) for own in seconds]


class _Ids:
    """What `evaluate.generate` needs of a tokenizer, for a model without one: a pad id, no EOS of its
    own (the model's generation config may have one), and the answer's ids as its text."""

    pad_token_id, eos_token_id = 0, None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def scoring_rows(lm: FederatedLM, vocab: int, clients: list[int], prompts: int, max_new_tokens: int,
                 repeats: int, batch_size: int = 64) -> list[dict]:
    """The final evaluation of K clients (personalized and global) one model after another and in one
    loop (module docstring), for each K of `clients`."""
    lm.tokenizer = _Ids()
    rows = []
    for k in clients:
        g = torch.Generator().manual_seed(100 + k)
        adapters = []
        for _ in range(k + 1):  # each client's, then the global one
            adapter = lm.get_lora()
            for t in adapter.values():
                t.add_(torch.randn(t.shape, generator=g) * 0.01)
            adapters.append(adapter)
        own = [[torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(60, 251, (prompts,), generator=g)]
               for _ in range(k)]
        sets = [(adapters[i], own[i]) for i in range(k)] + [(adapters[k], own[i]) for i in range(k)]
        outputs = {}

        def one_model_at_a_time():
            outputs["sequential"] = []
            for adapter, texts in sets:
                lm.set_lora(adapter)
                with lm.merged():
                    outputs["sequential"].append(generate(lm.model, lm.tokenizer, texts, max_new_tokens, batch_size,
                                                          progress=False))

        def one_loop():
            outputs["together"] = generate_per_adapter(lm, sets, max_new_tokens, batch_size)

        sequential_s, together_s = timed([one_model_at_a_time, one_loop], repeats)
        tokens = sum(len(answer.split()) for answers in outputs["sequential"] for answer in answers)
        row = {"clients": k, "models": len(sets), "prompts": sum(len(t) for _, t in sets), "tokens": tokens,
               "sequential_s": sequential_s, "together_s": together_s, "sequential_tok_s": tokens / sequential_s,
               "together_tok_s": tokens / together_s, "together_over_sequential": sequential_s / together_s,
               "predictions_equal": outputs["sequential"] == outputs["together"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="smollm2-135m")
    parser.add_argument("--part", choices=["train", "score"], default="train",
                        help="train: clients in lockstep (default); score: the final evaluation in one loop")
    parser.add_argument("--clients", default="1,4,12", help="K values, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, help="build the architecture with this many layers (default: all)")
    parser.add_argument("--score-prompts", type=int, default=8, help="--part score: test prompts per client")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="--part score: greedy tokens per answer")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lm = build(args.arch, args.layers)
    vocab = ARCHS[args.arch]["vocab_size"]
    if args.part == "score":
        rows = scoring_rows(lm, vocab, [int(x) for x in args.clients.split(",")], args.score_prompts,
                            args.max_new_tokens, args.repeats)
        result = {"arch": args.arch, "layers": args.layers or ARCHS[args.arch]["num_hidden_layers"],
                  "command": "benchmarks/batched.py " + " ".join(sys.argv[1:]), "timing": f"fastest of {args.repeats}, taken in turn",
                  "dtype": "float32", "lora": "r16 alpha32 all-linear", "eval_batch_size": 64,
                  "prompts": f"{args.score_prompts} per client, 60 to 250 random tokens",
                  "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                  "cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
                  "torch": torch.__version__, "note": "shared machine: indicative figures", "rows": rows}
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        return
    rows = []
    for k in [int(x) for x in args.clients.split(",")]:
        g = torch.Generator().manual_seed(k)
        batches = [flan_batch(g, vocab) for _ in range(k)]
        adapters = []
        for _ in range(k):
            live = own_adapter(lm.lora)
            with torch.no_grad():
                for t in live.values():
                    t.add_(torch.randn(t.shape, generator=g) * 0.01)
            adapters.append(live)
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        alone_grads = []

        def one_at_a_time():
            alone_grads.clear()
            for b, adapter in zip(batches, adapters):
                lm.set_lora(adapter)
                _, grads = lm.loss_and_grads(b)
                alone_grads.append({n: t.clone() for n, t in grads.items()})

        def lockstep():  # the engine's pass (one client: its own pass, `lockstep.alone`)
            shared_pass(lm, batches, adapters, PassSize())

        sequential_s, lockstep_s = timed([one_at_a_time, lockstep], args.repeats)
        diff = max(float((a.grad - alone[n]).norm() / alone[n].norm().clamp_min(1e-30))
                   for adapter, alone in zip(adapters, alone_grads) for n, a in adapter.items())
        row = {"clients": k, "tokens": tokens, "sequential_s": sequential_s, "lockstep_s": lockstep_s,
               "sequential_tok_s": tokens / sequential_s, "lockstep_tok_s": tokens / lockstep_s,
               "lockstep_over_sequential": sequential_s / lockstep_s, "max_grad_rel_diff": diff}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"arch": args.arch, "layers": args.layers or ARCHS[args.arch]["num_hidden_layers"],
              "command": "benchmarks/batched.py " + " ".join(sys.argv[1:]), "timing": f"fastest of {args.repeats}, taken in turn", "dtype": "float32", "lora": "r16 alpha32 all-linear", "batch": "4 FLAN-shaped examples",
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
              "note": "shared machine (a background job at nice 19): indicative figures", "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
