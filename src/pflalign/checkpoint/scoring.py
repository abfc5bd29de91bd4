"""The final scoring's finished jobs, kept as each comes back, so that a run stopped while it
scores (Ctrl-C, a kill, a machine taken back) scores only the jobs left when it resumes.

A run's final scoring is long: on Dolly about 30 minutes of two CPU cores after about two hours
of training, and at the 1B scale on a GPU most of a run's time. Without this a resume scored every
client again. ``scoring.partial.jsonl`` holds one line per finished job (client, model, ROUGE-L,
predictions, seconds), appended and fsync'ed as it finishes; its first line is the key of what the
jobs were scored from (`ScoringLog.open`'s `key`: the engine's, over the checkpoint the models
come from, the config and the code that generates). A file with another key is started afresh;
a line cut short by a kill is skipped (its job is scored again). It is deleted once results.json is
written (`remove`), so a finished run folder holds what it held before.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .atomic import fsync_dir

log = logging.getLogger(__name__)

SCORING = "scoring.partial.jsonl"


class ScoringLog:
    """The finished jobs of one final scoring, by (client, model), and the file they are kept in."""

    def __init__(self, path: Path, key: str, done: dict[tuple[int, str], dict]):
        self.path = path
        self.key = key
        self.done = done  # (client, model) → {"score", "predictions", "seconds"}
        self._file = None

    @classmethod
    def open(cls, out: Path, key: str) -> "ScoringLog":
        """The jobs kept in `out` under `key` (none when the file is missing, damaged or another key's)."""
        path = Path(out) / SCORING
        header, done = _read(path)
        if header is None:
            return cls(path, key, {})
        if header.get("key") != key:
            log.info("%s was scored from another checkpoint, config or code: its jobs are scored again", path)
            path.unlink()
            return cls(path, key, {})
        return cls(path, key, done)

    def get(self, k: int, model: str) -> dict | None:
        return self.done.get((k, model))

    def add(self, k: int, model: str, score: float, predictions: list[str], seconds: float) -> None:
        """Keep one finished job: its line on disk (fsync'ed) before this returns."""
        if self._file is None:
            fresh = not self.path.exists()
            self._file = open(self.path, "a")
            if fresh:
                self._file.write(json.dumps({"key": self.key}) + "\n")
            elif self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
                self._file.write("\n")  # after a line a kill cut short: it stays unreadable, and skipped
        self._file.write(json.dumps({"client": k, "model": model, "score": score, "predictions": predictions,
                                     "seconds": seconds}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done[(k, model)] = {"score": score, "predictions": predictions, "seconds": seconds}

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        """The scoring is in results.json: the file goes."""
        self.close()
        self.path.unlink(missing_ok=True)
        fsync_dir(self.path.parent)


def kept_jobs(out: Path) -> int:
    """How many finished jobs `out`'s file holds (for a message: its key is not checked)."""
    return len(_read(Path(out) / SCORING)[1])


def _read(path: Path) -> tuple[dict | None, dict[tuple[int, str], dict]]:
    """The file's first line ({} when it is not a JSON object; None without a file) and its jobs,
    a line that is not one (a line a kill cut short, "" after the last newline) skipped."""
    try:
        lines = path.read_text().split("\n")
    except (FileNotFoundError, NotADirectoryError):
        return None, {}
    try:
        header = json.loads(lines[0])
    except ValueError:
        header = None
    done: dict[tuple[int, str], dict] = {}
    for line in lines[1:]:
        try:
            row = json.loads(line)
            done[(int(row["client"]), str(row["model"]))] = {
                "score": float(row["score"]), "predictions": list(row["predictions"]),
                "seconds": float(row["seconds"])}
        except (ValueError, KeyError, TypeError):
            continue
    return header if isinstance(header, dict) else {}, done
