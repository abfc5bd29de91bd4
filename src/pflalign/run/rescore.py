"""`pflalign rescore`: a finished run's models scored again under other evaluation settings.

The models are the run's last checkpoint and client files, read and never written; only
``eval.*`` keys and the method's evaluation arguments (`Method.evaluation_args`) may change, so
the new run folder's training lines are the source's and its scores are the new settings'.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from . import allocator, export, run_dir
from .. import checkpoint as ckpt
from ..config import RunConfig, to_dict
from ..errors import UserError
from ..evaluate import add_exact_match
from ..settings import flat, merge
from .engine import Federation
from .lifecycle import Recorder, saved_config


def source_global_scores(source: Path, fed: "Federation") -> dict:
    """{"global": (scores, outputs)} of the scored clients as the finished run `source` wrote them
    (results.json, predictions.jsonl), for a rescore that changes only the method's evaluation
    arguments: they pick the personalized model, the global one is the same tensors under the same
    eval settings, so its generations are the source's. {} where the files do not hold them all,
    prompt for prompt."""
    try:
        rows = {c["id"]: c.get("rouge_l_global") for c in json.loads((source / ckpt.RESULTS).read_text())["clients"]}
        written: dict = {}
        for p in ckpt.metrics_rows(source / ckpt.PREDICTIONS):
            written.setdefault(p["client"], []).append((p["prompt"], p["global"]))
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    scores, outs = [], []
    for k in fed.eval_ids:
        c = fed.clients[k]
        mine = written.get(c.id, [])
        if rows.get(c.id) is None or [prompt for prompt, _ in mine] != [ex.prompt for ex in c.data.test]:
            return {}
        scores.append(rows[c.id])
        outs.append([output for _, output in mine])
    return {"global": (scores, outs)}


def rescored_config(source: Path, overrides: dict) -> RunConfig:
    """A finished run's config with `overrides` that change only what is evaluated: ``eval.*`` keys
    and the method's evaluation arguments (`Method.evaluation_args`, e.g. which model is the
    personalized one); anything that would have changed the training is refused."""
    from ..config import build_config
    from ..methods import method_class

    saved = to_dict(saved_config(source))
    cfg = build_config(None, merge(saved, overrides))
    allowed = {f"method_args.{a}" for a in method_class(cfg.method).evaluation_args}
    before, after = flat(saved, empty_tables=False), flat(to_dict(cfg), empty_tables=False)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    training = [k for k in changed if not (k.startswith("eval.") or k in allowed)]
    if training:
        extra = f"; {cfg.method}'s evaluation arguments: {', '.join(sorted(allowed))}" if allowed else ""
        raise UserError(f"rescore changes only what is evaluated (eval.* keys{extra}); {training[0]} would "
                        f"change the training: start a run with it instead")
    if not changed:
        raise UserError("rescore needs --set with an evaluation setting that differs from the run's")
    return cfg


def rescore(source: Path | str, out: Path | str, overrides: dict, overwrite: bool = False,
            progress: bool = True, workers: int = 1) -> dict:
    """Score the models of the finished run `source` again under other evaluation settings
    (`rescored_config`), into a new run folder `out`: its config, the source's training metrics
    lines, the new scores (results.json, predictions.jsonl, the final line) and adapters. The
    source's final checkpoint and client files are read, never written; the models are the same
    tensors, so scores that the change does not touch (the global model's) come out equal."""
    source, out = Path(source), Path(out)
    if not (source / ckpt.RESULTS).exists() or not ckpt.has_run_checkpoint(source):
        raise UserError(f"{source} is not a finished run with its checkpoint (rescore reads the models "
                        f"of the last round; committed copies without checkpoint.pt cannot be rescored)")
    if out.resolve() == source.resolve():
        raise UserError("rescore writes a new run folder: --out must differ from the run it reads")
    cfg = rescored_config(source, overrides)
    payload = ckpt.load_run_checkpoint(source)
    if payload["rounds_done"] != cfg.rounds:
        raise UserError(f"{source}'s checkpoint is after round {payload['rounds_done']} of {cfg.rounds}")
    with run_dir.guard(out, False, overwrite):
        rec = Recorder(out, False, overwrite)
        fed = Federation(cfg, progress=progress, out=source, workers=workers)
        try:
            fed.restore(payload)
            rec.open(cfg)
            for row in ckpt.metrics_rows(source / ckpt.METRICS):
                if row.get("event") != "eval":  # the training's lines are the source's; the scores are new
                    rec.metrics.write(**row)
            tic = time.perf_counter()
            same_eval = dataclasses.asdict(cfg.eval) == dataclasses.asdict(saved_config(source).eval)
            results, predictions = fed.evaluate(source_global_scores(source, fed) if same_eval else None)
            add_exact_match(results, predictions)
            export.write_run_adapters(rec.out, cfg, fed.adapters_as_evaluated())
            return rec.finish(results, 0.0, time.perf_counter() - tic, predictions, rescored_from=str(source.resolve()),
                              memory_allocator=allocator.active(), workers=fed.workers,
                              threads_per_worker=fed.runner.threads())
        finally:
            fed.close()
            rec.close()
