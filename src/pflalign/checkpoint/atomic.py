"""Files written so that nothing half-written ever has a final name.

Every file goes to a temporary name in the same folder, is fsync'ed, and is
renamed over the target: a crash leaves either the old file or the new one.
Out of space (or over a file-size limit) is a `DiskFull` naming the file; the
file it replaces is intact. A new file or folder gets the mode a plain write
gives under the user's umask (`umask_mode`).
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

from ..errors import UserError


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
