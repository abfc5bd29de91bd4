"""Two builds of pflalign on the same real rounds, in turn: is a change's full-protocol run slower?

    .venv/bin/python benchmarks/rounds_ab.py --a ~/old/.venv/bin/pflalign --b .venv/bin/pflalign \
        --data-dir ../shared/data/flan --out benchmarks/results/flan-rounds-ab.json

Each arm is a `pflalign` executable (its own checkout and venv: an older commit's worktree against
this one) plus its own extra arguments (`--a-args`, `--b-args`, `--c`/`--c-args` for a third arm,
e.g. the same build with `--batch clients`). Every arm runs `pflalign run` on the preset (default
flan-paper: the paper's protocol) for `--rounds` rounds, `--repeats` times, the arms in turn (a, b,
a, b: a change of the shared machine's load falls on all of them). A round's seconds come from the
run's metrics.jsonl (the engine's own clock: training only, no start-up or scoring); the final
scoring is cut to `--max-test` examples a client and the base model is not scored. The JSON keeps
every round's seconds, each arm's mean and its ratio to arm a, and the largest relative difference
of a train-step loss from arm a's first repeat (0.0: the same numbers, bit for bit).
Pause background work first (SIGSTOP): the figures are only as quiet as the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_arm(pflalign: str, extra: list[str], args, out: Path) -> dict:
    """One `pflalign run` of the preset; its rounds' seconds and train-step losses."""
    cmd = [pflalign, "run", "--config", args.config, "--method", args.method, "--data-dir", args.data_dir,
           "--set", f"rounds={args.rounds}", "--set", "eval.base_model=false",
           "--set", f"data.max_test={args.max_test}", "--no-progress", "--out", str(out), "--overwrite", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"rounds_ab: {shlex.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"round_seconds": [e["seconds"] for e in events if e["event"] == "round"],
            "losses": [e["loss"] for e in events if e["event"] == "train_step"], "wall_seconds": wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="arm a's pflalign executable (the reference)")
    p.add_argument("--b", required=True, help="arm b's pflalign executable")
    p.add_argument("--c", help="a third arm's pflalign executable (optional)")
    for arm in "abc":
        p.add_argument(f"--{arm}-args", default="--workers 2", help=f"arm {arm}'s extra run arguments")
    p.add_argument("--config", default="flan-paper")
    p.add_argument("--method", default="fedavg")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-test", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    arms = {name: (exe, shlex.split(getattr(args, f"{name}_args"))) for name, exe in
            (("a", args.a), ("b", args.b), ("c", args.c)) if exe}
    results = {name: [] for name in arms}
    with tempfile.TemporaryDirectory(prefix="rounds-ab-") as tmp:
        for repeat in range(args.repeats):
            for name, (exe, extra) in arms.items():
                got = run_arm(exe, extra, args, Path(tmp) / f"{name}{repeat}")
                results[name].append(got)
                print(f"{name} #{repeat}: rounds {', '.join(f'{s:.1f}' for s in got['round_seconds'])} s", flush=True)
    reference = results["a"][0]["losses"]
    mean = {name: sum(s for r in runs for s in r["round_seconds"]) / sum(len(r["round_seconds"]) for r in runs)
            for name, runs in results.items()}
    report = {
        "what": f"{args.config} {args.method}, {args.rounds} rounds x {args.repeats} repeats per arm, in turn",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "arms": {name: {"pflalign": exe, "args": extra, "mean_round_seconds": mean[name],
                        "ratio_to_a": mean["a"] / mean[name],
                        "max_rel_loss_diff_vs_a": max(abs(x - y) / abs(y) for r in results[name]
                                                      for x, y in zip(r["losses"], reference)),
                        "runs": [{k: v for k, v in r.items() if k != "losses"} for r in results[name]]}
                 for name, (exe, extra) in arms.items()},
    }
    for name, arm in report["arms"].items():
        print(f"{name}: mean round {arm['mean_round_seconds']:.1f} s, a/{name} {arm['ratio_to_a']:.2f}x, "
              f"max rel loss diff vs a {arm['max_rel_loss_diff_vs_a']:.1e}")
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
