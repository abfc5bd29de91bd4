"""The run checkpoint: two generations and a manifest.

A run's checkpoint is kept twice: ``checkpoint.pt`` (the newest) and
``checkpoint.prev.pt`` (the one before), with ``checkpoint.json``, a manifest
holding each one's sha256, size and rounds done. The manifest entry of a new
checkpoint is written before the checkpoint gets its final name, and entries
are matched by checksum, not by file name, so a crash between any two steps
leaves a checkpoint that the manifest vouches for. At resume a checkpoint that
is truncated, corrupt or unknown to the manifest is skipped with a warning and
the other one is used; if neither is good the run cannot be resumed. What the
checkpoint that loads is checked against besides is `resume_checks`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import threading
from pathlib import Path

import torch

from ..errors import UserError
from .atomic import DiskFull, _atomic_write, fsync_dir, remove_stale_temporaries, write_json
from .names import CHECKPOINT, MANIFEST, PREVIOUS
from .packing import load_checkpoint, pack_tensors
from .resume_checks import _verify_metrics, _verify_unvouched

log = logging.getLogger(__name__)

_deferring = False


@contextlib.contextmanager
def sigint_deferred():
    """Hold a Ctrl-C (SIGINT) until the block is done, then raise it: what the block
    writes is never left half-done by an interrupt. Re-entrant; a no-op off the main thread."""
    global _deferring
    if _deferring or threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


class _HashingWriter:
    """A file's `write`, hashing the bytes on their way to disk: a checkpoint just
    written is never read back to be checksummed."""

    def __init__(self, file):
        self._file, self.sha256, self.size = file, hashlib.sha256(), 0
        self.error: OSError | None = None  # torch's writer turns it into a RuntimeError: kept here

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._file.flush()


# Checksums of the checkpoints this process wrote, by (device, inode, size,
# mtime), so that a save does not re-read the previous round's checkpoint to
# decide which file to keep (a rename keeps all four). Only saving uses them:
# loading always hashes from disk, so a file damaged after it was written is
# never vouched for, even by a stale entry here.
# Only the newest few are kept: a save needs the previous round's file, and a
# sweep in one process writes into several run folders.
_written: dict[tuple[int, int, int, int], str] = {}
_WRITTEN_KEPT = 16


def _stat_key(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _digest(path: Path, reuse_written: bool = False) -> tuple[str, int]:
    key = _stat_key(path)
    if reuse_written and key in _written:
        return _written[key], key[2]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest(), key[2]


def _read_manifest(out: Path) -> list[dict] | None:
    try:
        entries = json.loads((out / MANIFEST).read_text())["checkpoints"]
        return [e for e in entries if isinstance(e, dict) and {"sha256", "size", "rounds_done"} <= e.keys()]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s cannot be read (%s); checkpoints are loaded unverified", out / MANIFEST, exc)
        return None


def _vouched(manifest: list[dict], path: Path, reuse_written: bool = False) -> dict | None:
    """The manifest entry whose checksum and size match the file at `path`, if any."""
    sha256, size = _digest(path, reuse_written)
    return next((e for e in manifest if (e["sha256"], e["size"]) == (sha256, size)), None)


def _newest_good(out: Path, reuse_written: bool = False) -> tuple[str, dict] | None:
    """The newest checkpoint file the manifest vouches for, with its entry (without a
    manifest, from an older pflalign: checkpoint.pt as it is)."""
    manifest = _read_manifest(out)
    for name in (CHECKPOINT, PREVIOUS):
        if (out / name).exists():
            if manifest is None:
                sha256, size = _digest(out / name, reuse_written)
                return name, {"sha256": sha256, "size": size, "rounds_done": None}
            entry = _vouched(manifest, out / name, reuse_written)
            if entry is not None:
                return name, entry
    return None


def save_run_checkpoint(out: Path, payload: dict) -> None:
    """Write `payload` (with its ``rounds_done``) as the run's newest checkpoint; the
    newest good one before it becomes checkpoint.prev.pt, anything else is deleted
    first: at most two checkpoints on disk, also while writing."""
    with sigint_deferred():
        remove_stale_temporaries(out)
        keep = _newest_good(out, reuse_written=True)
        for name in (CHECKPOINT, PREVIOUS):
            if keep is None or name != keep[0]:
                (out / name).unlink(missing_ok=True)

        written = {}

        def write(f) -> None:
            hashing = _HashingWriter(f)
            try:
                torch.save(pack_tensors(payload), hashing)
            except Exception:
                if hashing.error is not None:  # the disk's error, not torch's "unexpected pos"
                    raise hashing.error from None
                raise
            written.update(sha256=hashing.sha256.hexdigest(), size=hashing.size)

        def vouch_then_shift(tmp: Path) -> None:
            _written[_stat_key(tmp)] = written["sha256"]
            while len(_written) > _WRITTEN_KEPT:
                del _written[next(iter(_written))]  # the oldest entry (dicts keep insertion order)
            entries = [{"file": CHECKPOINT, **written, "rounds_done": payload["rounds_done"]}]
            if keep is not None:
                entries.append({**keep[1], "file": PREVIOUS})
            write_json(out / MANIFEST, {"checkpoints": entries})  # first: it vouches for the new file
            if keep is not None and keep[0] != PREVIOUS:
                os.replace(out / keep[0], out / PREVIOUS)

        try:
            _atomic_write(out / CHECKPOINT, write, before_rename=vouch_then_shift)
        except DiskFull as exc:
            kept = (f"the previous checkpoint{'' if keep[1]['rounds_done'] is None else ' (after round %d)' % keep[1]['rounds_done']}"
                    f" is intact; free some space, then continue with --resume (same --out)" if keep is not None
                    else "no round is saved yet; free some space and start again")
            raise DiskFull(f"{exc}; {kept}") from None
        fsync_dir(out)


def has_run_checkpoint(out: Path) -> bool:
    return (out / CHECKPOINT).exists() or (out / PREVIOUS).exists()


def rounds_checkpointed(out: Path) -> int | None:
    """The rounds done in the run's newest checkpoint as its manifest says (for a progress line:
    nothing is read or verified but the manifest); None without a readable manifest."""
    entries = _read_manifest(out) or []
    done = [e["rounds_done"] for e in entries if isinstance(e["rounds_done"], int) and (out / e.get("file", "")).is_file()]
    return max(done, default=None)


def newest_checkpoint_entry(out: Path) -> dict | None:
    """The manifest's entry of checkpoint.pt (its sha256, size and rounds_done), as the manifest
    says: nothing is read or verified but the manifest; None without one."""
    entries = _read_manifest(out) or []
    return next((e for e in entries if e.get("file") == CHECKPOINT), None)


def remove_run_checkpoints(out: Path) -> None:
    for name in (CHECKPOINT, PREVIOUS, MANIFEST):
        (out / name).unlink(missing_ok=True)
    remove_stale_temporaries(out)


def load_run_checkpoint(out: Path) -> dict:
    """The newest good checkpoint of the run in `out`: its checksum matches the manifest
    (when there is one) and it loads. Falling back to the previous one is said in a
    warning; with no good one left, a `UserError`."""
    manifest = _read_manifest(out)
    problems = []
    for name in (CHECKPOINT, PREVIOUS):
        path = out / name
        if not path.exists():
            if name == CHECKPOINT:
                problems.append(f"{name} is missing")
            continue
        if manifest is not None and _vouched(manifest, path) is None:
            problems.append(f"{name} does not match its checksum in {MANIFEST} (truncated or corrupt)")
            continue
        try:
            payload = load_checkpoint(path)
            rounds_done = payload["rounds_done"]
        except Exception as exc:  # anything torch.load raises on a damaged file
            problems.append(f"{name} cannot be read ({type(exc).__name__})")
            continue
        if problems:
            log.warning("%s: %s; resuming from %s (after round %d)", out, "; ".join(problems), name, rounds_done)
        if manifest is None:
            _verify_unvouched(out, name, payload)
        _verify_metrics(out, payload)
        return payload
    raise UserError(f"no usable checkpoint in {out}: {'; '.join(problems)}; start again with --overwrite")
