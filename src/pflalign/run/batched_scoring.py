"""The clients' scoring in one decoding loop (`--batch clients`): every scored client's
personalized and global models over the client's test prompts, each row generating with its own
adapter, none merged into the base.

The sequential engine scores a client's model in a job of its own (run/workers.py's
`run_score_job`): the adapter merged into the base, the client's prompts generated in batches.
Here all those jobs' prompts are one list; each prompt carries the index of its adapter in a
stack (the server's global adapter, each client's personalized one), and every LoRA projection
adds, to each row, its own adapter's update (model/multi_lora.py's routing, as the lockstep
training does). Batches are grouped by length over all clients, rows leave as they end and the
next join (evaluate.py's `greedy_ids`), so the few long answers of one client no longer take a
decode step each on their own. Greedy predictions equal the sequential path's word for word on
the tiny models and on SmolLM2 on CPU (tests/test_batched_scoring.py): an unmerged adapter
differs from a merged one only in the rounding of sums, which moves no argmax there.

The base model ("base" jobs) is not an adapter: it is scored as the sequential engine does,
from the cache of base generations (model/base_cache.py).
"""

from __future__ import annotations

import time

import torch

from ..errors import OutOfMemory
from ..evaluate import RowAdapters, generate, rouge_l
from ..model import multi_lora
from ..params import Params
from ..prompts import encode_prompt
from .jobs import ClientSide, ScoreDone, ScoreJob, out_of_memory, personalized_adapter, run_score_job


def generate_per_adapter(lm, sets: list[tuple[Params, list[list[int]]]], max_new_tokens: int, batch_size: int,
                         desc: str = "eval", progress: bool = False) -> list[list[str]]:
    """Greedy continuations of each set's prompts with the set's adapter, all sets in one decoding
    loop (`evaluate.generate` with a per-row adapter): [outputs of set i's prompts, in order].
    Sets that pass the same adapter object share its place in the stack."""
    stack: list[Params] = []
    place: dict[int, int] = {}  # id(adapter) → its index in the stack
    prompts, of = [], []
    for adapter, own in sets:
        j = place.setdefault(id(adapter), len(stack))
        if j == len(stack):
            stack.append(adapter)
        prompts.extend(own)
        of.extend([j] * len(own))
    route = multi_lora.row_router(lm.model, set(lm.lora), stack)
    outputs = generate(lm.model, lm.tokenizer, prompts, max_new_tokens, batch_size, desc=desc, progress=progress,
                       per_row=RowAdapters(of, route))
    split, start = [], 0
    for _, own in sets:
        split.append(outputs[start:start + len(own)])
        start += len(own)
    return split


def score_jobs_together(side: ClientSide, jobs: list[ScoreJob], shared: dict, progress: bool = False) -> list[ScoreDone]:
    """The `ScoreDone` of each job, in order, as the sequential engine's runner returns them: the
    personalized and global jobs in one decoding loop (module docstring), the base jobs one by one
    as there. A job's seconds: the loop's time shared by the jobs' numbers of prompts."""
    cfg = side.cfg
    together = [i for i, job in enumerate(jobs) if job.model != "base"]
    sets = []
    for i in together:
        job = jobs[i]
        adapter = (shared["global"] if job.model == "global"
                   else personalized_adapter(side, job.k, job.record, shared["global"]))
        # the prompts as `client.score_client` encodes them
        sets.append((adapter, [encode_prompt(side.lm.tokenizer, ex, cfg.max_seq_len, cfg.data.template)[0]
                               for ex in job.test]))
    tic = time.perf_counter()
    try:
        outputs = [] if not sets else generate_per_adapter(side.lm, sets, cfg.eval.max_new_tokens,
                                                           cfg.eval.batch_size, desc="eval (clients together)",
                                                           progress=progress)
    except (torch.OutOfMemoryError, MemoryError):
        raise OutOfMemory(f"out of memory scoring {len(sets)} models together (--batch clients) with "
                          f"eval.batch_size={cfg.eval.batch_size}, eval.max_new_tokens={cfg.eval.max_new_tokens}, "
                          f"model {cfg.model}: lower eval.batch_size, or run without --batch clients") from None
    seconds = time.perf_counter() - tic
    prompts = sum(len(own) for _, own in sets) or 1
    done: list[ScoreDone | None] = [None] * len(jobs)
    for i, (_, own), preds in zip(together, sets, outputs):
        job = jobs[i]
        done[i] = ScoreDone(job.k, rouge_l(preds, [ex.response for ex in job.test]), preds,
                            seconds * len(own) / prompts)
    for i, job in enumerate(jobs):
        if job.model == "base":
            try:
                done[i] = run_score_job(side, job, shared, progress)
            except (torch.OutOfMemoryError, MemoryError):
                raise OutOfMemory(out_of_memory(cfg, job)) from None
    return done
