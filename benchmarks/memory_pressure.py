"""Training steps under memory pressure: pflalign's step against a plain HF + PEFT loop.

    sudo .venv/bin/python benchmarks/memory_pressure.py --data-dir ../shared/data --data flan --steps 2 \
        --headroom-mb 32 --out benchmarks/results/memory_pressure.json

Why: issue 42 saw pflalign's step collapse (8-10 tok/s) where a plain HF + PEFT loop
only slowed (17-29 tok/s) while other jobs had filled the machine's memory. The
candidate cause: pflalign's frozen base weights are memory-mapped from the model
cache's safetensors file, and clean file pages are what the kernel reclaims first
(with no swap, the only thing it can reclaim), so each step reads the weights back
from disk; a model whose weights sit in ordinary (anonymous) memory keeps them.

How, bounded: every setting runs in a fresh process inside its own memory cgroup
(cgroup v1, made under this process's own; root needed), never by filling the
machine's memory. The process first runs the steps unlimited ("quiet"); the cgroup's
peak charge that is not page cache (anonymous memory, kernel memory) during them is
measured, then the limit is set to that peak plus `--headroom-mb` and the same
steps run again ("pressured"): the process keeps all its anonymous memory and has
`headroom` MB of page cache, as when other processes' memory fills the rest of a
machine. The weights are read from a private copy of the model cache (`--cache`;
its pages are dropped before each setting with posix_fadvise), so its page cache is
charged to the benchmark's cgroup, not shared with other processes on the host.

Settings, each on the same batches (SmolLM2-135M, fp32, LoRA r=8 on all linear
layers, the project's prompt encoding; an SGD update after each step):
* pflalign_mapped: `FederatedLM.build` as before (weights memory-mapped), `loss_and_grads`;
* pflalign_in_memory: the same with `in_memory=True` (`pflalign.model.hold_in_memory`);
* hf_peft_mapped / hf_peft_in_memory: `AutoModelForCausalLM.from_pretrained` of the same
  folder (``disable_mmap`` False/True) + `peft.get_peft_model`, the padded batch's
  ``model(**batch).loss.backward()`` and `torch.optim.SGD`.
Per pass: tokens per second (non-pad), seconds per step, the process's CPU seconds, major
page faults and bytes read from disk (/proc/self/io), the cgroup's page cache and the
machine's load average (on a shared machine the timings move with it; the faults and
the bytes read do not).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from pflalign.run import allocator

CHILD = r"""
import json, os, resource, sys, threading, time
from pathlib import Path
import torch
args = json.loads(sys.argv[1])
cg = Path(args["cgroup"])

def stat():
    return {k: int(v) for k, v in (l.split() for l in (cg / "memory.stat").read_text().splitlines())}

def not_cache():  # the cgroup's charge other than page cache: anonymous memory, kernel memory
    return int((cg / "memory.usage_in_bytes").read_text()) - stat()["cache"]

def read_bytes():
    return int(dict(l.split(": ") for l in Path("/proc/self/io").read_text().splitlines())["read_bytes"])

from pflalign.data.federate import FederationOptions, federation
from pflalign.model import FederatedLM, LoraSettings, mapped_files
from pflalign.prompts import batch_indices, collate_train, encode_train
settings = LoraSettings()
if args["loop"] == "pflalign":
    lm = FederatedLM.build("smollm2-135m", settings, seed=0, in_memory=args["in_memory"])
    model, tok, lora = lm.model, lm.tokenizer, list(lm.lora.values())
    def step(batch):
        loss, grads = lm.loss_and_grads(batch)
        with torch.no_grad():
            for p in lora:
                p -= args["lr"] * p.grad
        return loss
else:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args["folder"])
    base = AutoModelForCausalLM.from_pretrained(args["folder"], dtype=torch.float32, disable_mmap=args["in_memory"])
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                                            target_modules="all-linear", bias="none", task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args["lr"])
    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
if tok.pad_token_id is None:
    tok.pad_token = tok.eos_token
mapped = sorted(mapped_files(model))
source = args["source"]
clients = federation(args["data"], source, None, 42, None, 64 if args["data"] == "flan" else None, FederationOptions())[0]
encoded = [[encode_train(tok, ex, 1024) for ex in c.train] for c in clients]
batches = []
for s in range(args["steps"] + 1):
    k = s % len(clients)
    idx = batch_indices(len(encoded[k]), args["batch_size"], s, seed=k)
    batches.append(collate_train([encoded[k][i] for i in idx], tok.pad_token_id))
step(batches[0])  # warm-up: first-call costs

peak = {"not_cache": not_cache()}
stop = threading.Event()
def sample():  # the pass's peak charge outside the page cache (every 20 ms)
    while not stop.wait(0.02):
        peak["not_cache"] = max(peak["not_cache"], not_cache())

def run_pass():
    faults, disk, tic = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, read_bytes(), time.perf_counter()
    cpu, load = time.process_time(), os.getloadavg()[0]
    seconds, tokens = [], 0
    for batch in batches[1:]:
        t = time.perf_counter()
        step(batch)
        seconds.append(time.perf_counter() - t)
        tokens += int(batch["attention_mask"].sum())
    total = time.perf_counter() - tic
    s = stat()
    return {"step_seconds": seconds, "tokens_per_s": tokens / total, "tokens": tokens,
            "cpu_seconds": time.process_time() - cpu, "load_average_1min": [load, os.getloadavg()[0]],
            "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults,
            "disk_read_mb": (read_bytes() - disk) / 1e6, "cgroup_cache_mb": s["cache"] / 1e6,
            "cgroup_mapped_file_mb": s["mapped_file"] / 1e6, "cgroup_anon_mb": s["rss"] / 1e6}

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
quiet = run_pass()
stop.set()
sampler.join()
out = {"weights_mapped_from": mapped, "quiet": quiet, "peak_not_cache_mb": peak["not_cache"] / 1e6}
if args["headroom_mb"] is not None:
    limit = peak["not_cache"] + args["headroom_mb"] * 2**20
    (cg / "memory.limit_in_bytes").write_text(str(limit))
    out["limit_mb"] = limit / 1e6
    out["pressured"] = run_pass()
    out["failcnt"] = int((cg / "memory.failcnt").read_text())
print(json.dumps(out))
"""


def own_memory_cgroup() -> Path:
    """This process's cgroup-v1 memory cgroup folder (the benchmark's cgroups go under it)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (folder / "memory.limit_in_bytes").exists():
                return folder
    sys.exit("memory_pressure.py needs a cgroup-v1 memory controller (/sys/fs/cgroup/memory); none found")


def drop_pages(path: Path) -> None:
    """Drop `path`'s page-cache pages (a private copy: no other process maps it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def private_cache(cache: Path) -> Path:
    """A copy of the host's SmolLM2 files under `cache` (the .gguf and its de-quantized folder,
    built when missing); returns the folder that every setting loads."""
    host = Path(os.environ.get("PFLALIGN_CACHE", Path.home() / ".cache" / "pflalign"))
    for part in ("models", "dequantized"):
        if (host / part).is_dir() and not (cache / part).exists():
            shutil.copytree(host / part, cache / part)
    code = ("import torch; from pflalign.model import fetch_embedded_model, cache_dir; "
            "from pflalign.model.model_cache import cached_folder; "
            "print(cached_folder(fetch_embedded_model('smollm2-135m'), torch.float32, cache_dir() / 'dequantized'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PFLALIGN_CACHE": str(cache)})
    return Path(done.stdout.strip().splitlines()[-1])


def run_setting(parent_cg: Path, folder: Path, cache: Path, arg: dict, timeout: float) -> dict:
    cg = parent_cg / f"pflalign-memory-pressure-{os.getpid()}"
    cg.mkdir()
    try:
        drop_pages(folder / "model.safetensors")
        tic = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps({**arg, "cgroup": str(cg), "folder": str(folder)})],
            capture_output=True, text=True, timeout=timeout,
            env={**allocator.preload_env(), "PFLALIGN_CACHE": str(cache)},
            preexec_fn=lambda: (cg / "cgroup.procs").write_text(str(os.getpid())))  # the child only
        wall = time.perf_counter() - tic
    finally:
        cg.rmdir()
    if done.returncode != 0:
        return {"failed": f"exit {done.returncode}: {done.stderr.strip()[-1500:]}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="folder with flan/ and dolly/ (e.g. ../shared/data)")
    parser.add_argument("--data", choices=("dolly", "flan"), default="dolly")
    parser.add_argument("--out", default="benchmarks/results/memory_pressure.json")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per pass (after one warm-up step)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--headroom-mb", type=int, default=32,
                        help="page cache left to the process under pressure, above its peak anonymous memory")
    parser.add_argument("--cache", default="/tmp/pflalign-memory-pressure-cache",
                        help="where the private copy of the model cache goes (kept for the next run)")
    parser.add_argument("--settings", default="pflalign_mapped,hf_peft_in_memory,pflalign_in_memory,hf_peft_mapped")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per setting")
    args = parser.parse_args()
    allocator.reexec_under_mimalloc()  # as the pflalign command runs (its children too: preload_env)
    parent_cg = own_memory_cgroup()
    cache = Path(args.cache)
    folder = private_cache(cache)
    data = Path(args.data_dir)
    source = str(data / "flan") if args.data == "flan" else str(data / "dolly" / "databricks-dolly-15k.jsonl")
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "memory_allocator": allocator.active(),
                          "memory_total_gb": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9},
              "setting": {"model": "smollm2-135m (float32)", "data": args.data, "batch_size": args.batch_size,
                          "steps": args.steps, "headroom_mb": args.headroom_mb,
                          "weights_file_mb": (folder / "model.safetensors").stat().st_size / 1e6}}
    for name in args.settings.split(","):
        loop = name.removesuffix("_in_memory").removesuffix("_mapped")
        if loop not in ("pflalign", "hf_peft") or not name.endswith(("_in_memory", "_mapped")):
            parser.error(f"unknown setting {name!r}")
        arg = {"loop": loop, "in_memory": name.endswith("_in_memory"), "data": args.data, "source": source,
               "steps": args.steps, "batch_size": args.batch_size, "headroom_mb": args.headroom_mb, "lr": 1e-3}
        r = report[name] = run_setting(parent_cg, folder, cache, arg, args.timeout)
        if "failed" in r:
            print(f"{name}: {r['failed']}")
            continue
        line = f"{name}: quiet {r['quiet']['tokens_per_s']:.0f} tok/s"
        if "pressured" in r:
            p = r["pressured"]
            r["pressured_over_quiet"] = p["tokens_per_s"] / r["quiet"]["tokens_per_s"]
            line += (f", pressured {p['tokens_per_s']:.0f} tok/s ({r['pressured_over_quiet']:.2f}x; "
                     f"{p['major_faults']} major faults, {p['disk_read_mb']:.0f} MB read from disk, "
                     f"limit {r['limit_mb']:.0f} MB)")
        print(line + f"; weights mapped from: {r['weights_mapped_from'] or 'nothing'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
