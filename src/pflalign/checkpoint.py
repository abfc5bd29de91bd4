"""Run-directory files written so that nothing half-written ever has a final name.

Every file goes to a temporary name in the same folder, is fsync'ed, and is
renamed over the target: a crash leaves either the old file or the new one.

A run's checkpoint is kept twice: ``checkpoint.pt`` (the newest) and
``checkpoint.prev.pt`` (the one before), with ``checkpoint.json``, a manifest
holding each one's sha256, size and rounds done. The manifest entry of a new
checkpoint is written before the checkpoint gets its final name, and entries
are matched by checksum, not by file name, so a crash between any two steps
leaves a checkpoint that the manifest vouches for. At resume a checkpoint that
is truncated, corrupt or unknown to the manifest is skipped with a warning and
the other one is used; if neither is good the run cannot be resumed.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import json
import logging
import math
import os
import signal
import tempfile
import threading
from pathlib import Path

import torch

from .errors import UserError

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
MANIFEST = "checkpoint.json"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"
PREDICTIONS = "predictions.jsonl"


class DiskFull(UserError):
    """A write failed for want of space or a file-size limit; the file it replaces is intact."""


NO_ROOM = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}  # Python ignores SIGXFSZ: a size limit is EFBIG


def _no_room(exc: OSError, path: Path) -> DiskFull:
    return DiskFull(f"cannot write {path}: {exc.strerror or exc}")


# ---- file modes ------------------------------------------------------------------------
def umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status;
    changing it, even for a moment, would race with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def umask_mode(is_dir: bool = False) -> int:
    """The mode `open()` and `mkdir()` give a new file or folder under the user's umask (0644 and
    0755 under the usual 022; 0600 and 0700 under 077). Files made by `mkstemp`/`mkdtemp` (0600,
    0700) or by writers that pick their own mode get this one: never wider than the user allows
    (adapters trained on private data stay private), never narrower than a plain write."""
    return (0o777 if is_dir else 0o666) & ~umask()


def follow_umask(folder: Path) -> None:
    """`folder` and everything under it to `umask_mode`."""
    for path in [Path(folder), *Path(folder).rglob("*")]:
        os.chmod(path, umask_mode(path.is_dir()))


def _atomic_write(path: Path, write, before_rename=None) -> None:
    """`write(f)` to a temporary file beside `path`, fsync, rename it to `path`;
    `before_rename(tmp)` runs once the bytes are on disk, before they get the name.
    Out of space (or over a file-size limit) is a `DiskFull` naming `path`."""
    try:
        _atomic_write_unchecked(path, write, before_rename)
    except OSError as exc:
        if exc.errno in NO_ROOM:
            raise _no_room(exc, path) from None
        raise


def _atomic_write_unchecked(path: Path, write, before_rename=None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, umask_mode())  # mkstemp makes 0600: as a plain write would, under the user's umask
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj, indent: int | None = 2) -> None:
    _atomic_write(path, lambda f: f.write((json.dumps(obj, indent=indent) + "\n").encode()))


def write_jsonl(path: Path, rows) -> None:
    _atomic_write(path, lambda f: f.writelines((json.dumps(r) + "\n").encode() for r in rows))


# ---- one record per adapter-shaped dict ---------------------------------------------
# A run checkpoint holds ~17 dicts of 420 LoRA tensors each (global, client
# states, personalized adapters). Pickled tensor by tensor that is ~7,000
# records and ~36,000 small writes: 2.1 s of a FLAN round. Each such dict is
# stored as one flat tensor with its names and shapes instead, and rebuilt
# as views of it at load.
PACKED = "__pflalign_packed__"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _packable(d: dict, shared: set[int]) -> bool:
    """All values plain tensors of one dtype and device, none sharing memory with another
    tensor of the payload or of this dict (sharing would not survive the copy)."""
    values = list(d.values())
    if len(values) < 2 or not all(type(t) is torch.Tensor and not t.requires_grad and t.numel() > 0
                                  and t.layout == torch.strided for t in values):
        return False
    if len({(t.dtype, t.device) for t in values}) != 1 or any(_storage(t) in shared for t in values):
        return False
    spans = sorted((_storage(t), t.storage_offset() * t.element_size(),
                    t.storage_offset() * t.element_size() + t.numel() * t.element_size(), t.is_contiguous())
                   for t in values)
    return all(contiguous for *_, contiguous in spans) and all(
        a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))


def _is_tensor_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _collect(obj, groups: list, loose: list) -> None:
    """The payload's dicts of tensors (`groups`) and its other tensors (`loose`)."""
    if isinstance(obj, torch.Tensor):
        loose.append(obj)
    elif _is_tensor_dict(obj):
        groups.append(obj)
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            _collect(v, groups, loose)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors one after the other as one 1-D tensor: their own buffer when they are
    already its consecutive views and fill it (params.empty_like), else a copy.
    (A copy of every adapter of 8 clients at once was +0.6 GB at the save.)"""
    first, offset = tensors[0], 0
    for t in tensors:
        if _storage(t) != _storage(first) or t.storage_offset() != offset:
            break
        offset += t.numel()
    else:
        if offset * first.element_size() == first.untyped_storage().nbytes():
            return first.as_strided((offset,), (1,), 0)
    return torch.cat([t.reshape(-1) for t in tensors])


def pack_tensors(payload):
    """`payload` with each packable dict of tensors replaced by one flat tensor plus its names and shapes."""
    groups: list[dict] = []
    loose: list[torch.Tensor] = []
    _collect(payload, groups, loose)
    seen, shared = set(), set()
    for storages in [{_storage(t) for t in g.values()} for g in groups] + [{_storage(t)} for t in loose]:
        shared |= storages & seen
        seen |= storages
    packed = {id(g) for g in groups if _packable(g, shared)}

    def walk(obj):
        if isinstance(obj, dict):
            if id(obj) in packed:
                return {PACKED: _flat(list(obj.values())),
                        "names": list(obj), "shapes": [list(t.shape) for t in obj.values()]}
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj
    return walk(payload)


def unpack_tensors(obj):
    """The inverse of `pack_tensors`: each packed dict becomes views of its flat tensor."""
    if isinstance(obj, dict):
        if PACKED in obj:
            flat, out, offset = obj[PACKED], {}, 0
            for name, shape in zip(obj["names"], obj["shapes"]):
                n = math.prod(shape)
                out[name] = flat[offset:offset + n].view(shape)
                offset += n
            return out
        return {k: unpack_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(unpack_tensors(v) for v in obj)
    return obj


def save_checkpoint(path: Path, payload: dict) -> None:
    _atomic_write(path, lambda f: torch.save(pack_tensors(payload), f))


def load_checkpoint(path: Path) -> dict:
    """A file of `save_checkpoint` or `save_run_checkpoint`, its tensor dicts unpacked."""
    return unpack_tensors(torch.load(path, map_location="cpu", weights_only=True))


# ---- the run checkpoint: two generations and a manifest -----------------------------
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


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(out: Path) -> None:
    """Temporary files a killed process left behind (never read: only renamed files count)."""
    for tmp in out.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


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
