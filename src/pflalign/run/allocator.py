"""mimalloc under the `pflalign` command: glibc's heap fragments in LoRA training.

A training step frees thousands of 1–7 MB activations (a 1024-token Dolly row
allocates 5.9 GB in about 4,800 tensors for a 0.64 GB peak) in another order
than it allocated them, and glibc's main heap does not reuse that space well:
in two Dolly paper rounds (4 clients × 5 steps) the process's resident memory
reached 3.00–3.02 GB while glibc counted at most 1.90 GB in use. Handing every
tensor of 128 KB or more to mmap removes the waste but made steps 20–50%
slower: each allocation faults its pages in afresh, and page faults are dear
in this VM.

mimalloc reuses freed memory better. Its default, giving freed pages back to
the system 10 ms after they fall idle, still faulted 1.6 million pages in
those two rounds (glibc: 1.2–1.6 million) and ran up to 20% slower in the
second round; never giving them back (``MIMALLOC_PURGE_DELAY=-1``) faulted
one thousand and ran as fast as glibc or faster, but what one client's round
freed then stayed resident through the next clients' rounds, so each extra
client cost more (8 clients 1.28× the peak of 4). So: pages go back only
after 100 s idle (`PURGE_DELAY_MS`), and the engine hands back what a client's
round freed when the round ends (`release_free_memory`). Measured in the same
two Dolly rounds: peak 2.46 GB, 89 thousand page faults;
benchmarks/README.md has the benchmark's figures.

The allocator of a process is fixed when it starts, so the command line
re-executes itself once, before it loads torch, with the library of the
`cmeel-mimalloc` wheel in `LD_PRELOAD` (same pid, same arguments); the new
process gives `LD_PRELOAD` back its old value, so programs it starts (Flower's)
run as they would have. Nothing happens off Linux, without the wheel, when
`LD_PRELOAD` already names mimalloc, or with ``PFLALIGN_ALLOCATOR=system``. A
`MIMALLOC_PURGE_DELAY` (or any other mimalloc option) already set is kept. A
script that imports pflalign runs under whatever allocator its Python has;
`preload_env` gives the environment that starts one under mimalloc (the
benchmarks use it).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from importlib import metadata
from pathlib import Path

from ..errors import UserError

SETTING = "PFLALIGN_ALLOCATOR"  # "mimalloc" (the default) or "system"
_RESTORE = "_PFLALIGN_LD_PRELOAD"
PURGE_DELAY_MS = 100_000  # free memory goes back to the system after 100 s idle, or at release_free_memory  # set only in a re-executed process: the LD_PRELOAD to give back


def library() -> Path | None:
    """The shared library of the installed `cmeel-mimalloc` wheel, if any."""
    try:
        files = metadata.files("cmeel-mimalloc") or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith("libmimalloc.so"):
            path = Path(file.locate()).resolve()
            if path.is_file():
                return path
    return None


def preload_env(environ: dict | None = None) -> dict | None:
    """A copy of `environ` (default: this process's) that starts a program under
    mimalloc, or None when that is switched off, not possible or already so."""
    environ = dict(os.environ if environ is None else environ)
    setting = environ.get(SETTING, "mimalloc")
    if setting not in ("mimalloc", "system"):
        raise UserError(f"{SETTING} must be 'mimalloc' or 'system', got {setting!r}")
    preload = environ.get("LD_PRELOAD", "")
    if setting == "system" or not sys.platform.startswith("linux") or "mimalloc" in preload:
        return None
    lib = library()
    if lib is None:
        return None
    environ[_RESTORE] = preload
    environ.setdefault("MIMALLOC_PURGE_DELAY", str(PURGE_DELAY_MS))  # freed pages stay for reuse (above)
    environ["LD_PRELOAD"] = f"{lib}:{preload}" if preload else str(lib)
    return environ


def reexec_under_mimalloc() -> None:
    """At a program's start: replace this process (same pid, same command line,
    `sys.orig_argv`) by itself under mimalloc (see `preload_env`). In the process
    that replaced it: give `LD_PRELOAD` back its previous value and return."""
    if _RESTORE in os.environ:
        previous = os.environ.pop(_RESTORE)
        if previous:
            os.environ["LD_PRELOAD"] = previous
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    env = preload_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def release_free_memory() -> None:
    """Under mimalloc, give the memory it holds free back to the system now
    (`mi_collect(force)`); under another allocator, nothing. The engine calls it
    after each client's round: what that round freed (activations, gradient
    statistics) would otherwise stay resident until mimalloc's purge delay."""
    collect = _mi_collect()
    if collect is not None:
        collect(True)


@functools.cache
def _mi_collect():
    return getattr(ctypes.CDLL(None), "mi_collect", None)  # the preloaded library's symbols are global


def active() -> str:
    """"mimalloc" if this process runs it, else "system"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "mimalloc" if "libmimalloc" in maps else "system"
