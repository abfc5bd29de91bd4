"""The clients' scoring in one decoding loop (`--batch clients`, and `--batch runs` across runs):
every scored client's personalized and global models over the client's test prompts, each row
generating with its own adapter, none merged into the base.

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

Runs in lockstep (`pflalign sweep --batch runs`, run/together.py) that finish together are
scored in one loop (`score_runs_together`): each run's global adapter and its clients'
personalized ones in one stack, and each run gets its own jobs' scores back. Such runs share the
model and must share `eval_key` (prompt template, max_seq_len, eval.batch_size and
eval.max_new_tokens); run/together.py scores runs of other eval settings in loops of their own.

What one loop holds is bounded: at most `LOOP_BYTES` (4 GiB) of adapters in its stack, so
`adapters_per_loop` = 4 GiB over one adapter's bytes (at SmolLM2-135M with LoRA r16 on every
projection, 19.56 MB in float32: 219 adapters, so the 33 runs of the paper's Dolly sweep, 4
clients each, 165 adapters, go in one loop). Beyond it the jobs are cut, in order, into several
loops of at most that many adapters (a run's global adapter counts once per loop it is in), each
loop loading its personalized adapters from the clients' files and dropping them after. A row's
prediction is its own adapter's whichever rows share its loop (the equality above), so the cut
changes no prediction (tests/test_batched_scoring.py).

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


LOOP_BYTES = 4 * 2**30  # the adapters one decoding loop holds at most (module docstring)


def adapters_per_loop(lm) -> int:
    """How many adapters one decoding loop stacks: `LOOP_BYTES` over one adapter's bytes, at least one."""
    size = sum(t.numel() * t.element_size() for t in lm.lora.values())
    return max(1, LOOP_BYTES // size)


def eval_key(cfg) -> tuple:
    """What runs scored in one loop must share (beside the model): the prompts' encoding (template,
    max_seq_len) and the decoding (eval.batch_size, eval.max_new_tokens)."""
    return cfg.data.template, cfg.max_seq_len, cfg.eval.batch_size, cfg.eval.max_new_tokens


def split_loops(keys: list, cap: int) -> list[list[int]]:
    """The jobs, by their adapters' keys in order, cut into consecutive loops of at most `cap`
    adapters each (jobs of one key share its adapter): [the jobs' indices of each loop]."""
    loops: list[list[int]] = []
    held: set = set()
    for i, key in enumerate(keys):
        if not loops or (key not in held and len(held) == cap):
            loops.append([])
            held = set()
        held.add(key)
        loops[-1].append(i)
    return loops


def score_jobs_together(side: ClientSide, jobs: list[ScoreJob], shared: dict, progress: bool = False) -> list[ScoreDone]:
    """One run's jobs (`score_runs_together`)."""
    return score_runs_together([(side, jobs, shared)], progress)[0]


def score_runs_together(runs: list[tuple[ClientSide, list[ScoreJob], dict]], progress: bool = False,
                        cap: int | None = None) -> list[list[ScoreDone]]:
    """The `ScoreDone` of each job of each run (its side, its jobs, what they share: its w^r), in
    order, as the sequential engine's runner returns them: the personalized and global jobs of all
    the runs in one decoding loop, or in several of at most `cap` adapters each (default:
    `adapters_per_loop`), each loop loading its adapters (module docstring); the base jobs one by
    one as there. A job's seconds: its loop's time shared by the jobs' numbers of prompts. The runs
    share one model and `eval_key`."""
    side = runs[0][0]
    if len({eval_key(s.cfg) for s, _, _ in runs}) > 1:
        raise ValueError("runs scored in one decoding loop share their eval settings (batched_scoring.eval_key)")
    cfg = side.cfg
    todo = [(g, i) for g, (_, jobs, _) in enumerate(runs) for i, job in enumerate(jobs) if job.model != "base"]
    keys = [(g, "global") if runs[g][1][i].model == "global" else (g, i) for g, i in todo]
    loops = split_loops(keys, adapters_per_loop(side.lm) if cap is None else cap)
    done: list[list[ScoreDone | None]] = [[None] * len(jobs) for _, jobs, _ in runs]
    for n, loop in enumerate(loops):
        sets = []  # this loop's adapters (the last loop's dropped)
        for g, i in (todo[j] for j in loop):
            own, job, shared = runs[g][0], runs[g][1][i], runs[g][2]
            adapter = (shared["global"] if job.model == "global"
                       else personalized_adapter(own, job.k, job.record, shared["global"]))
            # the prompts as `client.score_client` encodes them
            sets.append((adapter, [encode_prompt(side.lm.tokenizer, ex, cfg.max_seq_len, cfg.data.template)[0]
                                   for ex in job.test]))
        tic = time.perf_counter()
        try:
            outputs = generate_per_adapter(side.lm, sets, cfg.eval.max_new_tokens, cfg.eval.batch_size,
                                           desc=f"eval (models together, loop {n + 1} of {len(loops)})",
                                           progress=progress)
        except (torch.OutOfMemoryError, MemoryError):
            raise OutOfMemory(f"out of memory scoring {len(sets)} models together (--batch) with "
                              f"eval.batch_size={cfg.eval.batch_size}, eval.max_new_tokens={cfg.eval.max_new_tokens}, "
                              f"model {cfg.model}: lower eval.batch_size, or run without --batch") from None
        seconds = time.perf_counter() - tic
        prompts = sum(len(prompts) for _, prompts in sets) or 1
        for (g, i), (_, own_prompts), preds in zip((todo[j] for j in loop), sets, outputs):
            job = runs[g][1][i]
            done[g][i] = ScoreDone(job.k, rouge_l(preds, [ex.response for ex in job.test]), preds,
                                   seconds * len(own_prompts) / prompts)
    for g, (own, jobs, shared) in enumerate(runs):
        for i, job in enumerate(jobs):
            if job.model == "base":
                try:
                    done[g][i] = run_score_job(own, job, shared, progress)
                except (torch.OutOfMemoryError, MemoryError):
                    raise OutOfMemory(out_of_memory(own.cfg, job)) from None
    return done
