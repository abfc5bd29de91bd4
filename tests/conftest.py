"""Shared pytest fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The cache folders a test run may share with the user's cache: the default model's GGUF and its
# dequantized copy (hundreds of MB, slow to make, keyed by file and dtype). Everything else a test
# caches (tiny models' base generations, tokenized data, saved random bases) goes to a folder of
# this session's, so that a test run leaves nothing among the entries of the user's runs.
SHARED_CACHE_PARTS = ("models", "dequantized")


def pytest_configure(config):
    from pflalign.model.base import cache_dir

    user_cache = cache_dir()  # $PFLALIGN_CACHE or ~/.cache/pflalign, before it is pointed elsewhere
    session_cache = Path(tempfile.mkdtemp(prefix="pflalign-test-cache-"))
    for part in SHARED_CACHE_PARTS:
        try:
            (user_cache / part).mkdir(parents=True, exist_ok=True)
            (session_cache / part).symlink_to(user_cache / part, target_is_directory=True)
        except OSError:  # an unwritable user cache: the session's own folder serves
            pass
    config._pflalign_cache = session_cache
    os.environ["PFLALIGN_CACHE"] = str(session_cache)


def pytest_unconfigure(config):
    session_cache = getattr(config, "_pflalign_cache", None)
    if session_cache is not None:
        shutil.rmtree(session_cache, ignore_errors=True)  # the links only, not what they point to


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The offline copy of the real datasets (Dolly, FLAN) used by tests and CI.

    `$PFLALIGN_SHARED_DATA` if set, else `<repo root>/../shared/data`. Missing data
    fails the run under CI (env `CI` set) and skips the test elsewhere.
    """
    override = os.environ.get("PFLALIGN_SHARED_DATA")
    repo_root = Path(__file__).resolve().parents[1]
    path = Path(override) if override else repo_root.parent / "shared" / "data"
    if not path.is_dir():
        message = f"shared data folder not found: {path} (set PFLALIGN_SHARED_DATA)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def tiny_llama():
    """A tiny random Llama with LoRA (r=4): the model path of the paper's Llama family."""
    from pflalign.model import FederatedLM, LoraSettings

    return FederatedLM.build("tiny-llama", LoraSettings(r=4, alpha=8), seed=0)


@pytest.fixture(scope="session")
def tiny_opt():
    """A tiny random OPT with LoRA (r=4): the model path of the paper's OPT family."""
    from pflalign.model import FederatedLM, LoraSettings

    return FederatedLM.build("tiny-opt", LoraSettings(r=4, alpha=8), seed=0)
