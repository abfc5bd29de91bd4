"""What a resumed run checks in the checkpoint it loads, beyond its checksum: a checkpoint that
no manifest vouches for holds no NaN or Inf, and metrics.jsonl holds the rounds it says are done.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..errors import UserError
from .names import MANIFEST, METRICS

log = logging.getLogger(__name__)


def _all_finite(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return all(_all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_all_finite(v) for v in obj)
    return True


def _verify_unvouched(out: Path, name: str, payload: dict) -> None:
    """No manifest (deleted, or a run of an older pflalign): the checkpoint's checksum cannot be
    checked. Say so, and refuse one holding NaN or Inf (what a damaged float usually becomes)."""
    log.warning("%s: %s is missing, so %s is loaded unverified (its checksum cannot be checked)",
                out, MANIFEST, name)
    if not _all_finite(payload):
        raise UserError(f"{out / name} holds NaN or Inf and {MANIFEST} is missing to vouch for it: "
                        "the checkpoint is damaged; start again with --overwrite")


def _verify_metrics(out: Path, payload: dict) -> None:
    """metrics.jsonl must hold the rounds the checkpoint says are done (its last line up to the
    checkpoint's offset is a line of round `rounds_done`); a resumed run would otherwise finish
    with records that disagree with it (half its rounds missing)."""
    offset, rounds = payload.get("metrics_offset") or 0, payload.get("rounds_done") or 0
    path = out / METRICS
    if offset <= 0 or rounds <= 0:
        return
    if not path.exists():
        raise UserError(f"{path} is missing, but the checkpoint (after round {rounds}) records {offset} bytes of it: "
                        "a resumed run would finish without the metrics of its first rounds; "
                        "restore the file or start again with --overwrite")
    with open(path, "rb") as f:
        f.seek(max(0, offset - 65536))
        head = f.read(offset - max(0, offset - 65536))
    last = head.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        row = json.loads(last)
        ok = head.endswith(b"\n") and isinstance(row, dict) and row.get("round") == rounds - 1
    except ValueError:
        ok = False
    if not ok and path.stat().st_size >= offset:
        raise UserError(f"{path} does not match the checkpoint (after round {rounds}): its line at byte {offset} "
                        "is not a line of that round; the file was changed; restore it or start again with --overwrite")
