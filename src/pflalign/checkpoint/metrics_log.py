"""metrics.jsonl: written append-only, round by round, by `MetricsLog` (a resume cuts away the
lines of the round that was interrupted), and read back by `metrics_rows`.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from ..errors import UserError
from .atomic import NO_ROOM, DiskFull, _no_room
from .stored import open_stored


def metrics_rows(path: Path):
    """The JSON objects of a `metrics.jsonl` (or its gzipped copy, `stored`), one line at a time; a
    torn or undecodable line is skipped (the rest is still good), and so is the end of a gzipped
    copy cut short."""
    with open_stored(path) as f:
        try:
            for line in f:
                try:
                    row = json.loads(line.decode("utf-8", errors="replace"))
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict):
                    yield row
        except (EOFError, gzip.BadGzipFile):
            return


class MetricsLog:
    """Append-only `metrics.jsonl`. The byte offset after each finished round
    is stored in the checkpoint, so a resumed run first cuts away the lines of
    the round that was interrupted and the file never holds a round twice."""

    def __init__(self, path: Path, resume_offset: int | None = None):
        self.path = path
        if resume_offset is not None and path.exists():
            size = path.stat().st_size
            if size < resume_offset:
                raise UserError(f"{path} has {size} bytes, fewer than the {resume_offset} its checkpoint "
                                "records: the run directory was changed; start again with --overwrite")
            with open(path, "r+b") as f:
                f.truncate(resume_offset)
        self._file = open(path, "ab")

    def write(self, **row) -> None:
        try:
            self._file.write((json.dumps(row) + "\n").encode())
        except OSError as exc:
            raise self._no_room(exc)

    def commit(self) -> int:
        """Flush to disk; returns the offset to store in the checkpoint."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise self._no_room(exc)
        return self._file.tell()

    def _no_room(self, exc: OSError) -> OSError:
        if exc.errno not in NO_ROOM:
            return exc
        return DiskFull(f"{_no_room(exc, self.path)}; the last checkpoint is intact (its lines are kept); "
                        "free some space, then continue with --resume (same --out)")

    def rollback(self, offset: int) -> None:
        """Drop everything after `offset` (the lines of a round that will not finish)."""
        self._file.flush()
        self._file.truncate(offset)
        os.fsync(self._file.fileno())

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as exc:  # a full disk: what did not reach it is cut at resume anyway
            if exc.errno not in NO_ROOM:
                raise
