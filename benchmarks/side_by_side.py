"""Clients side by side (`--workers`): FLAN rounds in one process against N one-thread workers.

    .venv/bin/python benchmarks/side_by_side.py --data-dir ../shared/data/flan --out benchmarks/results/side_by_side.json

Runs the same rounds of the paper's FLAN federation (SmolLM2-135M, 4 clients x 5
steps, batch 4, pFLAlign) three ways, each in a fresh process and run folder: one
process with torch's default threads (the engine's default), one process with one
thread, and `--workers N` (default: the cores). Per setting: seconds of each round
after the first (the first pays the workers' start and the first checkpoints), their
mean, and the setting's CPU seconds; the ratios of the means; whether the final global
adapter of the workers equals the one-thread process's bit for bit (it must) and the
default's (it need not: thread counts split the floating-point sums differently). The
machine's fp32 matmul peak (bench.py's) is measured before and after, so runs of other
days can be read against it. Run it on a quiet machine: every core is in use.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import matmul_peak  # noqa: E402

from pflalign.run import allocator  # noqa: E402

ROUND_CODE = """
import hashlib, json, resource, sys, time
import torch
from pathlib import Path
from pflalign.config import build_config
from pflalign.run.engine import Federation
from pflalign.run.lifecycle import Recorder
args = json.loads(sys.argv[1])
if args["threads"]:
    torch.set_num_threads(args["threads"])
cfg = build_config("flan-paper", {"method": args["method"], "rounds": args["rounds"], "data": {"dir": args["data_dir"]}})
out = Path(args["out"])
fed = Federation(cfg, progress=False, out=out, workers=args["workers"])
rec = Recorder(out, resume=False, overwrite=False)
rec.open(cfg)
seconds = []
for r in range(cfg.rounds):
    tic = time.perf_counter()
    fed.train(rec, r, r + 1)
    seconds.append(time.perf_counter() - tic)
threads = fed.runner.threads()  # per worker, or this process's
h = hashlib.sha256()
for name in sorted(fed.global_params):
    h.update(fed.global_params[name].contiguous().view(torch.uint8).numpy().tobytes())
fed.close()
rec.close()
own = resource.getrusage(resource.RUSAGE_SELF)
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
print(json.dumps({"round_seconds": seconds, "cpu_seconds": cpu, "global_sha256": h.hexdigest(),
                  "threads_per_worker": threads, "workers": args["workers"]}))
"""


def run_setting(data_dir: str, method: str, rounds: int, workers: int, threads: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        arg = json.dumps({"data_dir": data_dir, "method": method, "rounds": rounds, "workers": workers,
                          "threads": threads, "out": tmp})
        done = subprocess.run([sys.executable, "-c", ROUND_CODE, arg], capture_output=True, text=True,
                              env=allocator.preload_env())
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    timed = result["round_seconds"][1:]
    result["mean_round_seconds"] = sum(timed) / len(timed)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="the FedDPA FLAN folder")
    parser.add_argument("--out", default="benchmarks/results/side_by_side.json")
    parser.add_argument("--method", default="pflalign")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per setting (the first is not timed)")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args()
    allocator.reexec_under_mimalloc()
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "memory_allocator": allocator.active()},
              "setting": {"method": args.method, "rounds": args.rounds, "timed_rounds": args.rounds - 1,
                          "model": "smollm2-135m", "data": "FLAN, the paper's 4 clients x 5 steps, batch 4"},
              "matmul_peak_gflops_before": matmul_peak()}
    settings = {"one_process_default_threads": (1, None), "one_process_one_thread": (1, 1),
                f"workers_{args.workers}": (args.workers, None)}
    for name, (workers, threads) in settings.items():
        tic = time.perf_counter()
        report[name] = run_setting(args.data_dir, args.method, args.rounds, workers, threads)
        report[name]["wall_seconds"] = time.perf_counter() - tic
        print(f"{name}: {report[name]['mean_round_seconds']:.1f} s per round "
              f"({', '.join(f'{s:.1f}' for s in report[name]['round_seconds'])}), "
              f"{report[name]['cpu_seconds']:.0f} CPU s, {report[name]['workers']} x {report[name]['threads_per_worker']} threads")
    report["matmul_peak_gflops_after"] = matmul_peak()
    default, one, workers = (report[name] for name in settings)
    report["speedup_workers_vs_default"] = default["mean_round_seconds"] / workers["mean_round_seconds"]
    report["speedup_workers_vs_one_thread"] = one["mean_round_seconds"] / workers["mean_round_seconds"]
    report["workers_equal_one_thread_bit_for_bit"] = workers["global_sha256"] == one["global_sha256"]
    report["workers_equal_default_bit_for_bit"] = workers["global_sha256"] == default["global_sha256"]
    print(f"workers vs default: {report['speedup_workers_vs_default']:.2f}x; vs one thread: "
          f"{report['speedup_workers_vs_one_thread']:.2f}x; equal to one thread: "
          f"{report['workers_equal_one_thread_bit_for_bit']}; to the default: {report['workers_equal_default_bit_for_bit']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
