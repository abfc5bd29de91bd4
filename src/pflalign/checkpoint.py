"""Run-directory files written so that nothing half-written ever has a final name.

Every file goes to a temporary name in the same folder, is fsync'ed, and is
renamed over the target: a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

CHECKPOINT = "checkpoint.pt"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"
PREDICTIONS = "predictions.jsonl"


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; results are meant to be shared
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj) -> None:
    _atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def write_jsonl(path: Path, rows) -> None:
    _atomic_write(path, lambda f: f.writelines((json.dumps(r) + "\n").encode() for r in rows))


def save_checkpoint(path: Path, payload: dict) -> None:
    _atomic_write(path, lambda f: torch.save(payload, f))


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


class MetricsLog:
    """Append-only `metrics.jsonl`. The byte offset after each finished round
    is stored in the checkpoint, so a resumed run first cuts away the lines of
    the round that was interrupted and the file never holds a round twice."""

    def __init__(self, path: Path, resume_offset: int | None = None):
        self.path = path
        if resume_offset is not None and path.exists():
            with open(path, "r+b") as f:
                f.truncate(resume_offset)
        self._file = open(path, "ab")

    def write(self, **row) -> None:
        self._file.write((json.dumps(row) + "\n").encode())

    def commit(self) -> int:
        """Flush to disk; returns the offset to store in the checkpoint."""
        self._file.flush()
        os.fsync(self._file.fileno())
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
