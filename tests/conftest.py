"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


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
