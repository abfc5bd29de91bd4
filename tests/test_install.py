"""Issue 42: the install. pyproject.toml gives torch a range (a GPU user's CUDA build is kept);
the exact version that reproducibility needs is pinned where `make setup` installs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _torch(lines) -> Requirement:
    reqs = [Requirement(line) for line in lines]
    return next(r for r in reqs if r.name == "torch")


def test_pyproject_takes_a_torch_range_and_make_setup_pins_the_tested_one():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = _torch(deps).specifier
    assert not any(s.operator in ("==", "===") for s in wanted), wanted  # a range, not a pin
    assert all(v in wanted for v in ("2.11.0+cu130", "2.13.0", "2.13.0+cu128", "2.14.1+cu126")), wanted
    pinned = _torch(line for line in (ROOT / "constraints.txt").read_text().splitlines()
                    if line.strip() and not line.startswith("#")).specifier
    assert [s.operator for s in pinned] == ["=="] and next(iter(pinned)).version in wanted
    install = [line for line in (ROOT / "Makefile").read_text().splitlines() if "pip install" in line and "-e" in line]
    assert install and all(re.search(r"(-c|--constraint) constraints\.txt", line) for line in install), install
