"""The `pflalign` command runs under mimalloc (run/allocator.py): when, how, and what its children see."""

import json
import os
import subprocess
import sys

import pytest

from pflalign.run import allocator
from pflalign.errors import UserError

from test_cli import TINY_SET

linux_with_wheel = pytest.mark.skipif(not sys.platform.startswith("linux") or allocator.library() is None,
                                      reason="mimalloc is used on Linux, from the cmeel-mimalloc wheel")


@linux_with_wheel
def test_preload_env_puts_mimalloc_first_and_remembers_the_old_preload():
    env = allocator.preload_env({"PATH": "/bin", "LD_PRELOAD": "/opt/libother.so"})
    assert env["LD_PRELOAD"] == f"{allocator.library()}:/opt/libother.so"
    assert env[allocator._RESTORE] == "/opt/libother.so" and env["PATH"] == "/bin"
    assert allocator.preload_env({})["LD_PRELOAD"] == str(allocator.library())
    assert env["MIMALLOC_PURGE_DELAY"] == str(allocator.PURGE_DELAY_MS)
    assert allocator.preload_env({"MIMALLOC_PURGE_DELAY": "10"})["MIMALLOC_PURGE_DELAY"] == "10"  # the user's stays


@pytest.mark.parametrize("environ", [{"PFLALIGN_ALLOCATOR": "system"}, {"LD_PRELOAD": "/usr/lib/libmimalloc.so.2"}])
def test_preload_env_is_none_when_switched_off_or_already_preloaded(environ):
    assert allocator.preload_env(environ) is None


def test_preload_env_is_none_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert allocator.preload_env({}) is None


def test_unknown_allocator_setting_is_a_user_error():
    with pytest.raises(UserError, match="PFLALIGN_ALLOCATOR must be 'mimalloc' or 'system', got 'jemalloc'"):
        allocator.preload_env({"PFLALIGN_ALLOCATOR": "jemalloc"})


@pytest.mark.parametrize("previous", ["", "/opt/libother.so"])
def test_the_reexecuted_process_gives_ld_preload_back(monkeypatch, previous):
    monkeypatch.setenv("LD_PRELOAD", "/x/libmimalloc.so.3" + (f":{previous}" if previous else ""))
    monkeypatch.setenv(allocator._RESTORE, previous)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("re-executed twice"))
    allocator.reexec_under_mimalloc()
    assert os.environ.get("LD_PRELOAD") == (previous or None) and allocator._RESTORE not in os.environ


@linux_with_wheel
@pytest.mark.parametrize("setting, expected", [(None, "mimalloc"), ("system", "system")])
def test_pflalign_command_runs_under_mimalloc_unless_told_not_to(tmp_path, setting, expected):
    """`python -m pflalign run` (what the console script runs) re-executes itself under
    mimalloc, and the run records which allocator it had."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.SETTING)}
    if setting:
        env[allocator.SETTING] = setting
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "pflalign", "run", "--config", "demo", *TINY_SET, "--out", str(out),
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "results.json").read_text())["memory_allocator"] == expected


@linux_with_wheel
def test_release_free_memory_gives_freed_pages_back_under_mimalloc():
    """Freed pages stay resident (the purge delay) until the engine's call hands them back."""
    code = ("import torch; from pflalign.run import allocator\n"
            "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096 / 1e6\n"
            "for n in (1_000_000, 2_000_000, 4_000_000): x = torch.ones(n); del x  # activation-sized\n"
            "before = rss(); allocator.release_free_memory(); print(allocator.active(), before, rss())")
    env = allocator.preload_env({k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.SETTING)})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    active, before, after = out.stdout.split()
    assert active == "mimalloc" and float(before) - float(after) > 20  # MB: the 28 MB freed above
