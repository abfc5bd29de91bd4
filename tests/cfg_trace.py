"""Where a run's configuration travels before (and while) it trains: issue 59's measure.

A tiny in-process run (`pflalign.run.engine.run`) under `sys.setprofile`: every call of a
pflalign function that receives the run's config or a part of it (an argument that is one of
settings/run_config.py's dataclasses: `RunConfig`, its `data`, `lora`, `eval`, ...) from a caller that held
it too is a *stop*; the stops in the order they are first reached (each
function counted once) form the trace. A module the trace *re-enters* is one it had already
left: with the trace's modules in order, every return to a module seen before counts once.

    .venv/bin/python tests/cfg_trace.py [synthetic|dolly]   # prints the trace and its counts
"""

from __future__ import annotations

import inspect
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path


def trace(cfg, out: Path) -> list[tuple[str, str]]:
    """(module, function) of every stop, in the order first reached."""
    import dataclasses

    from pflalign import settings
    from pflalign.run.engine import run

    kinds = tuple(v for v in vars(settings).values() if isinstance(v, type) and dataclasses.is_dataclass(v))

    holders: set[int] = set()  # the frames (ids) that hold the config: calls from them pass it on
    stops: list[tuple[str, str]] = []
    seen: set = set()

    def holds(frame) -> bool:
        info = inspect.getargvalues(frame)
        return any(isinstance(info.locals.get(name), kinds) for name in info.args)

    def profile(frame, event, arg):
        if event != "call":
            if event == "return":
                holders.discard(id(frame))
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("pflalign") or not holds(frame):
            return
        caller = frame.f_back
        if caller is not None and id(caller) not in holders and stops:
            return  # not passed on from the trace (the config reached here some other way)
        holders.add(id(frame))
        key = (module, frame.f_code.co_qualname)
        if key not in seen:
            seen.add(key)
            stops.append(key)

    sys.setprofile(profile)
    try:
        run(cfg, out, progress=False)
    finally:
        sys.setprofile(None)
    return stops


def measure(stops: list[tuple[str, str]]) -> dict:
    """The trace's counts: stops, modules, re-entries in all and the most entries of one module."""
    entries: Counter = Counter()
    last = None
    for module, _ in stops:
        if module != last:
            entries[module] += 1
        last = module
    return {"stops": len(stops), "modules": len(entries), "re_entries": sum(n - 1 for n in entries.values()),
            "most_entries": max(entries.values(), default=0),
            "entries": dict(entries.most_common())}


def tiny_dolly(folder: Path) -> Path:
    """A Dolly file of 12 records in each of the paper's 4 categories (the paper's data path)."""
    path = folder / "dolly.jsonl"
    with path.open("w") as f:
        for category in ("classification", "closed_qa", "information_extraction", "summarization"):
            for i in range(12):
                f.write(json.dumps({"instruction": f"{category} question {i}?", "context": "",
                                    "response": f"answer {i}", "category": category}) + "\n")
    return path


def tiny_config(dolly: Path | None = None):
    """A one-round run of the tiny random Llama: on the synthetic tasks, or on the Dolly file
    `dolly` with the paper's Dolly preset (its 4 clients by category)."""
    from pflalign.config import build_config

    small = {"model": "tiny-llama", "lora": {"r": 4, "alpha": 8}, "rounds": 1, "local_steps": 1,
             "batch_size": 2, "max_seq_len": 64,
             "eval": {"max_new_tokens": 2, "batch_size": 4, "base_model": False}}
    if dolly is None:
        return build_config(None, {**small, "data": {"name": "synthetic", "clients": ["arithmetic", "sorting"],
                                                     "max_train": 4, "max_test": 2}})
    return build_config("dolly-paper", {**small, "data": {"dir": str(dolly), "max_train": 4, "max_test": 2}})


def measured(data: str) -> tuple[list[tuple[str, str]], dict]:
    """The trace and its counts for a run on `data` ("synthetic" or "dolly")."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_config(tiny_dolly(Path(tmp)) if data == "dolly" else None)
        stops = trace(cfg, Path(tmp) / "run")
    return stops, measure(stops)


if __name__ == "__main__":
    for data in sys.argv[1:] or ["synthetic", "dolly"]:
        stops, counts = measured(data)
        print(f"== {data}")
        for module, function in stops:
            print(f"{module}:{function}")
        print(json.dumps(counts, indent=1))
