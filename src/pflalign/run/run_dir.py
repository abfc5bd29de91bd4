"""The run folder's safety: what `--out` may be, one writer at a time, nothing lost on --overwrite.

* `check_out`: before anything loads, `--out` must be a folder we may write
  (or a path where one can be made) and either empty or a pflalign run folder;
  a Hugging Face model folder (its own config.json) or any other folder with
  files in it is refused, so its files are never overwritten.
* `RunLock`: an exclusive `fcntl.flock` on ``OUT/.pflalign.lock`` (holding the
  holder's PID) for as long as a run or a sweep writes there; a second one gets
  one line naming that PID. The lock file is removed on release; a killed
  holder's lock is released by the kernel.
* `Aside`: ``--overwrite`` moves the old run's files into ``OUT/.pflalign-replaced/``
  instead of deleting them. They are deleted once the new run has saved a
  checkpoint or finished, and put back if it fails before that (a bad model,
  bad data, a diverged or interrupted first round), also on the next start
  after a kill.
* `guarded`: all of the above around `engine.run`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import shutil
from pathlib import Path

from .. import checkpoint as ckpt
from ..errors import UserError

log = logging.getLogger(__name__)

LOCK = ".pflalign.lock"
ASIDE = ".pflalign-replaced"
# "clients": the in-process engine's per-client files (run/client_store.py), named by the checkpoints:
# set aside and restored with them
RUN_FILES = (ckpt.RESULTS, ckpt.METRICS, ckpt.PREDICTIONS, ckpt.CONFIG, ckpt.CHECKPOINT, ckpt.PREVIOUS,
             ckpt.MANIFEST, ckpt.SCORING, "clients")
CONFIG_KEYS = {"method", "method_args", "lora", "data", "rounds"}  # what makes a config.json pflalign's


# ---- what --out may be ----------------------------------------------------------------
def _is_pflalign_config(path: Path) -> bool:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and CONFIG_KEYS <= saved.keys()


def is_run_folder(folder: Path) -> bool:
    """An empty folder, one with a run's checkpoint or metrics, one whose config.json is a
    pflalign run config, or (a run killed before it wrote its config) one holding nothing but
    a run's files."""
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    if not entries or (folder / ASIDE).is_dir():  # a run being replaced by --overwrite
        return True
    if any((folder / n).exists() for n in (ckpt.CHECKPOINT, ckpt.PREVIOUS, ckpt.MANIFEST, ckpt.METRICS)):
        return True  # a run's own files (its config.json may be damaged: resume says so)
    if (folder / ckpt.CONFIG).exists():
        return _is_pflalign_config(folder / ckpt.CONFIG)
    return all(p.name in RUN_FILES for p in entries)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_out(out: Path, what: str = "--out", ours=is_run_folder, kind: str = "a pflalign run folder") -> None:
    """Refuse, before anything loads, an `out` that is a file, cannot be written, or is a
    folder with files that is not `kind` (`ours(folder)`: a pflalign run; an export's folder
    for ``pflalign export``, `export.is_export_folder`)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{what} {out} is a file, not a folder")
    existing = _nearest_existing(out)
    if not existing.is_dir():
        raise UserError(f"{what} {out}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{what} {out}: {existing} is not writable")
    if out.is_dir() and not ours(out):
        raise UserError(f"{what} {out} is a folder with other files in it, not {kind}; "
                        "refusing to write there: choose an empty or new folder")


# ---- one writer at a time ---------------------------------------------------------------
class RunLock:
    """An exclusive lock on a run (or sweep) folder; creates the folder when missing and,
    when released after a failure, removes the folders it created if they are still empty."""

    def __init__(self, folder: Path, what: str = "run"):
        self.folder, self.what = Path(folder), what
        self.fd: int | None = None
        self.created: list[Path] = []

    def acquire(self) -> "RunLock":
        missing = []
        p = self.folder.absolute()
        while not p.exists():
            missing.append(p)
            p = p.parent
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create {self.folder}: {exc.strerror or exc}") from None
        self.created = missing  # deepest first
        path = self.folder / LOCK
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                self.remove_created()
                raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                try:
                    holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                finally:
                    os.close(fd)
                raise UserError(f"{self.folder} is in use by another pflalign {self.what} (pid {holder}); "
                                "wait for it to end or choose another --out") from None
            try:  # the file we locked may have been unlinked by a holder releasing it meanwhile
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self, failed: bool = False) -> None:
        if self.fd is None:
            return
        try:
            (self.folder / LOCK).unlink(missing_ok=True)  # before the unlock: see acquire
        finally:
            os.close(self.fd)
            self.fd = None
        if failed:
            self.remove_created()

    def remove_created(self) -> None:
        for p in self.created:
            try:
                p.rmdir()  # only when empty
            except OSError:
                break
        self.created = []

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release(failed=exc_type is not None)


# ---- --overwrite: move aside, restore on failure ------------------------------------------
class Aside:
    """The files of the run an --overwrite replaces, kept in OUT/.pflalign-replaced/."""

    def __init__(self, out: Path):
        self.out, self.folder = out, out / ASIDE

    def exists(self) -> bool:
        return self.folder.is_dir()

    def move(self) -> None:
        if self.exists():  # left by an earlier attempt: settle it first
            self.settle()
        present = [n for n in RUN_FILES if (self.out / n).exists()]
        if not present:
            return
        self.folder.mkdir()
        for name in present:
            os.replace(self.out / name, self.folder / name)
        ckpt.remove_stale_temporaries(self.out)

    def new_run_saved(self) -> bool:
        return (self.out / ckpt.RESULTS).exists() or ckpt.has_run_checkpoint(self.out)

    def settle(self) -> None:
        """Drop the old run once the new one saved something; else put the old one back."""
        if not self.exists():
            return
        if self.new_run_saved():
            shutil.rmtree(self.folder)
            return
        for name in RUN_FILES:
            if (self.out / name).is_dir():
                shutil.rmtree(self.out / name)
            else:
                (self.out / name).unlink(missing_ok=True)
        ckpt.remove_stale_temporaries(self.out)
        for p in self.folder.iterdir():
            os.replace(p, self.out / p.name)
        self.folder.rmdir()
        log.warning("%s: the run replaced by --overwrite is restored: the new run saved nothing", self.out)


@contextlib.contextmanager
def guard(out: Path, resume: bool, overwrite: bool):
    """Check `out`, lock it, and on --overwrite set the old run aside (restored when the
    block fails before the new run saved a checkpoint)."""
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other: --resume continues the run in "
                        "--out, --overwrite replaces it")
    check_out(out)
    with RunLock(out):
        aside = Aside(out)
        aside.settle()  # an --overwrite killed before the new run saved anything
        if overwrite:
            aside.move()
        try:
            yield
        finally:
            aside.settle()


def guarded(run):
    """`engine.run(cfg, out, resume, overwrite, ...)` inside `guard`."""

    @functools.wraps(run)
    def wrapper(cfg, out, resume: bool = False, overwrite: bool = False, *args, **kwargs):
        with guard(Path(out), resume, overwrite):
            return run(cfg, Path(out), resume, overwrite, *args, **kwargs)

    return wrapper
