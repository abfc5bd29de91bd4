"""A run file read back as it is stored: the run folder's plain file, or the gzipped copy that
the runs committed under docs/results keep of metrics.jsonl and predictions.jsonl.
"""

from __future__ import annotations

import gzip
from pathlib import Path


def stored(path: Path) -> Path:
    """`path`, or `path` + ".gz" where only that exists: the copies of runs committed under
    docs/results keep metrics.jsonl and predictions.jsonl gzipped (about a sixth of the size; a run
    folder itself always writes them plain)."""
    path = Path(path)
    if not path.exists():
        gz = path.with_name(path.name + ".gz")
        if gz.exists():
            return gz
    return path


def open_stored(path: Path):
    """`stored(path)` opened for reading bytes, gunzipped where it is the .gz copy."""
    found = stored(path)
    return gzip.open(found, "rb") if found.name.endswith(".gz") else open(found, "rb")


def read_stored_text(path: Path) -> str:
    """The text of `stored(path)` (UTF-8). A gzipped copy cut short raises `OSError` or `EOFError`."""
    with open_stored(path) as f:
        return f.read().decode("utf-8")
