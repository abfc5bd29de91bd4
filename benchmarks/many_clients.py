"""pflalign benchmark: many clients (issue 21). Peak RSS and seconds per round of an in-process
run with many clients and partial participation, against the paper's 4-client run.

    python benchmarks/many_clients.py --data-dir ../shared/data --only smollm2 --out benchmarks/results/many_clients_smollm2.json
    python benchmarks/many_clients.py --data-dir ../shared/data --only tiny --out benchmarks/results/many_clients_tiny.json
    python benchmarks/many_clients.py --data-dir ../shared/data --only flower --out benchmarks/results/many_clients_flower.json

Sections (``--only``):

* ``smollm2``: SmolLM2-135M pFLAlign on FLAN, 3 rounds × 5 local steps, evaluation on 2 test
  examples per client (``data.max_test=2``, 16 new tokens, no base model: the runs measure
  training). ``four``: the paper's 4 clients (one per category), participation 1.0. ``hundred``:
  the training rows of all 8 FLAN tasks split Dirichlet α = 0.5 over ``category`` into 100
  clients of at least 5 rows (24 on average), participation 0.1 (10 clients a round), final
  evaluation on a seeded sample of 10 clients (``eval.clients``).
  Issue 21's targets: peak RSS ≤ 1.3× and seconds per round ≤ 2.8× the 4-client run's.
* ``tiny``: the tiny random Llama on Dolly split IID into 1000 clients, participation 0.01
  (10 a round), 40 rounds: the RSS at the end of every round, to show it stays flat while ever
  more clients have trained (each has a file in clients/).
* ``flower``: the same 4-against-100 comparison on Flower's Simulation Engine with the tiny
  random Llama (``FLOWER_TINY``: LoRA r 4, 3 rounds × 2 local steps of 2 examples,
  ``max_seq_len`` 96): ``four``, the training rows of all 8 FLAN tasks split Dirichlet α = 0.5
  over ``category`` into 4 clients, participation 1.0; ``hundred``, the same rows into 100
  clients of at least 5 rows, participation 0.1 (10 a round), ``eval.clients=10``. One
  Ray actor (``client-resources-num-cpus=1 init-args-num-cpus=1``: one core), a fresh data
  cache per run.

Each in-process run is ``python -m pflalign run`` in a subprocess (the CLI, as a user runs
it). Measured: peak RSS from ``os.wait4`` (the child's ``ru_maxrss``), RSS at each round's end
(``VmRSS`` of the child, read when the round's line appears in metrics.jsonl, polled every 50
ms), seconds per round from metrics.jsonl's ``round`` lines, the size of the run folder's
checkpoint and client files. A Flower run is a SuperLink with ``--simulation`` and ``flwr
run`` (`pflalign.flower.cluster`); its peak RSS is the largest sum, over one poll every 0.5 s,
of the RSS of every process of the run's tree (polled every 0.25 s; SuperLink, SuperExec, ServerApp, the simulation
process, Ray's processes and actors; pages shared between processes count once per process),
seconds per round again from metrics.jsonl, the tree's CPU seconds (user + system, every
process, polled every 0.25 s) between round lines from round 2 on, and the bytes of a training message's
configuration record (what the ServerApp sends besides the tensors) at each size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMMON = {"method": "pflalign", "rounds": 3, "local_steps": 5,
          "eval": {"max_new_tokens": 16, "base_model": False}}


# all 8 FLAN tasks (2400 training rows): the paper's 4 (1200 rows) cannot be split Dirichlet α = 0.5
# into 100 clients of at least 5 rows (flwr-datasets gives up after 10 draws), nor all 8 with 10
FLAN_ALL = ["coreference", "entailment", "linguistic_acceptability", "paraphrase", "question_classification",
            "structure_to_text", "text_formatting", "word_disambiguation"]


def smollm2_configs(data_dir: Path) -> dict[str, dict]:
    flan = {"name": "flan", "dir": str(data_dir / "flan"), "max_test": 2}
    return {
        "four": {**COMMON, "model": "smollm2-135m", "data": flan},
        "hundred": {**COMMON, "model": "smollm2-135m", "participation": 0.1,
                    "data": {**flan, "clients": FLAN_ALL, "partition": "dirichlet", "num_clients": 100,
                             "alpha": 0.5, "partition_by": "category", "min_partition_size": 5},
                    "eval": {**COMMON["eval"], "clients": 10}},
    }


def tiny_configs(data_dir: Path) -> dict[str, dict]:
    return {"thousand": {
        "method": "pflalign", "model": "tiny-llama", "lora": {"r": 4, "alpha": 8}, "rounds": 40,
        "local_steps": 2, "batch_size": 2, "max_seq_len": 96, "participation": 0.01,
        "data": {"name": "dolly", "dir": str(data_dir / "dolly"), "partition": "iid", "num_clients": 1000,
                 "max_test": 2},
        "eval": {"max_new_tokens": 4, "batch_size": 4, "base_model": False, "clients": 20},
    }}


FLOWER_TINY = {"method": "pflalign", "model": "tiny-llama", "lora": {"r": 4, "alpha": 8}, "rounds": 3,
               "local_steps": 2, "batch_size": 2, "max_seq_len": 96,
               "eval": {"max_new_tokens": 4, "batch_size": 4, "base_model": False}}


def flower_configs(data_dir: Path) -> dict[str, dict]:
    data = {"name": "flan", "dir": str(data_dir / "flan"), "max_test": 2, "clients": FLAN_ALL,
            "partition": "dirichlet", "alpha": 0.5, "partition_by": "category", "min_partition_size": 5}
    return {
        "four": {**FLOWER_TINY, "data": {**data, "num_clients": 4}},
        "hundred": {**FLOWER_TINY, "participation": 0.1, "data": {**data, "num_clients": 100},
                    "eval": {**FLOWER_TINY["eval"], "clients": 10}},
    }


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of the process (all its threads) so far: what a round costs, apart from
    how busy the machine is (wall time on a shared machine measures the other processes too)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def measure(name: str, config: dict, work: Path) -> dict:
    """One run of the CLI on `config`: peak RSS, RSS at each round's end, seconds per round."""
    cfg_path, out = work / f"{name}.json", work / name
    cfg_path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    tic = time.monotonic()
    log = open(work / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pflalign", "run", "--config", str(cfg_path), "--out", str(out),
                             "--no-progress"], env=env, stdout=log, stderr=subprocess.STDOUT)
    metrics, seen, round_rss, ckpt_sizes, usage = out / "metrics.jsonl", 0, [], [], None
    round_cpu, last_cpu = [], None
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)  # reaped here: ru is this child's own rusage
        if pid:
            usage, proc.returncode = ru, os.waitstatus_to_exitcode(status)
            break
        if metrics.exists():
            # metrics.jsonl is flushed with each round's checkpoint: the first round's start is not
            # seen, so CPU time is measured from the end of round 1 on (rounds 2, 3, ...)
            rounds = metrics.read_text().count('"event": "round"')
            if rounds > seen:
                now = cpu_seconds(proc.pid)
                if now is not None and last_cpu is not None:
                    round_cpu.append((now - last_cpu) / (rounds - seen))
                last_cpu = now
                rss = rss_kb(proc.pid)
                round_rss += [rss] * (rounds - seen)
                seen = rounds
                ckpt_sizes.append((out / "checkpoint.pt").stat().st_size if (out / "checkpoint.pt").exists() else None)
        time.sleep(0.05)
    wall = time.monotonic() - tic
    log.close()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{(work / f'{name}.log').read_text()[-3000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    seconds = [r["seconds"] for r in rows if r["event"] == "round"]
    results = json.loads((out / "results.json").read_text())
    return {
        "config": config, "wall_s": wall, "peak_rss_gb": usage.ru_maxrss / 1e6,
        "round_seconds": seconds, "seconds_per_round": sum(seconds) / len(seconds),
        "seconds_per_round_rounds_2_on": mean(seconds[1:]),  # round 1 also loads the model in the actor
        # CPU seconds between round lines from round 2 on (each includes the previous round's
        # checkpoint save); polled every 50 ms
        "round_cpu_seconds": round_cpu, "cpu_seconds_per_round": sum(round_cpu) / len(round_cpu) if round_cpu else None,
        "cpu_seconds_total": (usage.ru_utime + usage.ru_stime),
        "participants_per_round": [len(r["clients"]) for r in rows if r["event"] == "round"],
        "rss_at_round_end_gb": [None if x is None else x / 1e6 for x in round_rss],
        "checkpoint_bytes_at_round_end": ckpt_sizes,
        "client_files": len(list((out / "clients").glob("*.safetensors"))),
        "client_files_bytes": folder_bytes(out / "clients"),
        "seconds_eval": results.get("seconds_eval"), "clients_scored": len(results["clients"]),
        "avg_rouge_l_personalized": results["avg_rouge_l_personalized"],
        "distribution": results.get("distribution"),
    }


def tree_rss(procs, cpu: dict[int, float] | None = None) -> dict[str, int]:
    """RSS in bytes of every live process of a `Processes` tree (those it started and theirs), by
    "name pid"; `cpu`: updated with each live process's CPU seconds (user + system) so far."""
    import psutil

    procs.track()
    for p in list(procs.seen.values()):  # detached ones (SuperExec, Ray's) are no longer children of ours
        try:
            for child in p.children(recursive=True):
                procs.seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass
    rss = {}
    for p in procs.seen.values():
        try:
            rss[f"{p.name()} {p.pid}"] = p.memory_info().rss
            if cpu is not None:
                times = p.cpu_times()
                cpu[p.pid] = times.user + times.system
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return rss


def message_config_bytes(config: dict) -> int:
    """The bytes of the ConfigRecord of a training message of this run (`MethodStrategy._config`)."""
    from pflalign.config import build_config, make_method
    from pflalign.flower.strategy import MethodStrategy
    from pflalign.model import build_model

    cfg = build_config(None, config)
    strategy = MethodStrategy(make_method(cfg), cfg, build_model(cfg).get_lora(), experiment="0" * 12)
    return strategy._config(cfg.data.num_clients - 1, round=cfg.rounds - 1).count_bytes()


def measure_flower(name: str, config: dict, work: Path) -> dict:
    """One Simulation Engine run of `config`: the process tree's peak RSS, seconds per round."""
    from pflalign.flower.cluster import Cluster

    root, n = work / name, config["data"]["num_clients"]
    cluster = Cluster(root, REPO, clients=n, simulation=True, client_cpus=1, runtime_cpus=1,
                      env={"PFLALIGN_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1",
                           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])})
    out, peak, peak_at, processes = root / "out", 0, {}, set()
    cpu, seen, round_end_cpu = {}, 0, []  # pid → CPU seconds (a process's last reading once it is gone)
    metrics = out / "metrics.jsonl"
    try:
        tic = time.monotonic()
        cluster.start_link()
        cluster.flwr_run({"set": json.dumps(config), "out": str(out), "client-dir": str(root / "clients")}, "run")
        while cluster.procs["run"].poll() is None:
            rss = tree_rss(cluster, cpu)
            processes.update(rss)
            if sum(rss.values()) > peak:
                peak, peak_at = sum(rss.values()), rss
            rounds = metrics.read_text().count('"event": "round"') if metrics.exists() else 0
            if rounds > seen:  # the tree's CPU seconds when a round's line appears (written after its checkpoint)
                round_end_cpu += [sum(cpu.values())] * (rounds - seen)
                seen = rounds
            time.sleep(0.25)
        wall = time.monotonic() - tic
        log = cluster.finish("run")
    finally:
        cluster.close()
    if not (out / "results.json").exists():
        raise SystemExit(f"{name} failed:\n{log[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rows if r["event"] == "round"]
    seconds = [r["seconds"] for r in rounds]
    results = json.loads((out / "results.json").read_text())
    return {
        "config": config, "engine": "simulation", "wall_s": wall, "peak_tree_rss_gb": peak / 1e9,
        "peak_tree_rss_by_process_mb": {k: round(v / 1e6, 1) for k, v in sorted(peak_at.items(), key=lambda kv: -kv[1])},
        "processes_seen": len(processes),
        "round_seconds": seconds, "seconds_per_round": sum(seconds) / len(seconds),
        "seconds_per_round_rounds_2_on": mean(seconds[1:]),  # round 1 also loads the model in the actor
        # CPU seconds of the whole tree between round lines, rounds 2 on (polled every 0.25 s):
        # what a round costs, apart from how busy the shared machine is
        "round_cpu_seconds_from_round_2": [b - a for a, b in zip(round_end_cpu, round_end_cpu[1:])],
        "cpu_seconds_total": sum(cpu.values()),
        "participants_per_round": [len(r["clients"]) for r in rounds],
        "missing_per_round": [r.get("missing", []) for r in rounds],
        "tensor_bytes_per_message_down": [r["bytes_to_clients"] // len(r["clients"]) for r in rounds],
        "config_bytes_per_message": message_config_bytes(config),
        "seconds_eval": results.get("seconds_eval"), "clients_scored": len(results["clients"]),
        "clients_in_federation": results.get("clients_in_federation", len(results["clients"])),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--only", choices=["smollm2", "tiny", "flower"], required=True)
    ap.add_argument("--runs", nargs="*", help="only these runs of the section (e.g. four), to start them apart")
    ap.add_argument("--combine", nargs="*", type=Path, help="merge these outputs of --runs into --out instead")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.combine:
        parts = [json.loads(p.read_text()) for p in args.combine]
        report = {**parts[0], "parts": [{k: v for k, v in p.items() if k != "runs"} for p in parts], "runs": {}}
        for p in parts:
            report["runs"].update(p["runs"])
        finish(report, args.out)
        return
    configs = {"smollm2": smollm2_configs, "tiny": tiny_configs, "flower": flower_configs}[args.only](args.data_dir)
    if args.runs:
        configs = {k: v for k, v in configs.items() if k in args.runs}
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    report = {"section": args.only, "commit": commit, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "machine": {"cpu": platform.processor() or platform.machine(), "cpus_allowed": len(os.sched_getaffinity(0)),
                          "cpu_affinity": sorted(os.sched_getaffinity(0)), "niceness": os.nice(0),
                          "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="pflalign-many-") as tmp:
        for name, config in configs.items():
            print(f"{name} ...", flush=True)
            flower = args.only == "flower"
            report["runs"][name] = (measure_flower if flower else measure)(name, config, Path(tmp))
            r = report["runs"][name]
            print(f"{name}: peak RSS {r['peak_tree_rss_gb' if flower else 'peak_rss_gb']:.2f} GB, "
                  f"{r['seconds_per_round']:.1f} s/round, wall {r['wall_s']:.0f} s", flush=True)
    finish(report, args.out)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def cpu_from_round_2(run: dict) -> float:
    later = run["round_cpu_seconds"][-(len(run["round_seconds"]) - 1):]
    return sum(later) / len(later)


def finish(report: dict, out: Path) -> None:
    """The ratios against the targets, the flatness of memory, and the JSON file."""
    runs = report["runs"]
    if report.get("section") == "flower" and "four" in runs and "hundred" in runs:
        report["ratios"] = {
            "peak_tree_rss_hundred_over_four": runs["hundred"]["peak_tree_rss_gb"] / runs["four"]["peak_tree_rss_gb"],
            "seconds_per_round_hundred_over_four": runs["hundred"]["seconds_per_round"] / runs["four"]["seconds_per_round"],
            "seconds_per_round_rounds_2_on_hundred_over_four":
                runs["hundred"]["seconds_per_round_rounds_2_on"] / runs["four"]["seconds_per_round_rounds_2_on"],
            "cpu_seconds_per_round_rounds_2_on_hundred_over_four":
                mean(runs["hundred"]["round_cpu_seconds_from_round_2"]) / mean(runs["four"]["round_cpu_seconds_from_round_2"]),
            "config_bytes_per_message_hundred_minus_four": runs["hundred"]["config_bytes_per_message"]
            - runs["four"]["config_bytes_per_message"],
        }
    elif "four" in runs and "hundred" in runs:
        report["ratios"] = {
            "peak_rss_hundred_over_four": runs["hundred"]["peak_rss_gb"] / runs["four"]["peak_rss_gb"],
            "seconds_per_round_hundred_over_four": runs["hundred"]["seconds_per_round"] / runs["four"]["seconds_per_round"],
            # rounds 2 on: the last R - 1 entries (the first version of this script also recorded
            # a first entry, about 0, for round 1, whose start it could not see)
            "cpu_seconds_per_round_rounds_2_on": {name: cpu_from_round_2(runs[name]) for name in ("four", "hundred")},
            "cpu_seconds_per_round_hundred_over_four": cpu_from_round_2(runs["hundred"]) / cpu_from_round_2(runs["four"]),
            "targets": {"peak_rss": 1.3, "seconds_per_round": 2.8},
        }
    if "thousand" in runs:
        rss = [x for x in runs["thousand"]["rss_at_round_end_gb"] if x is not None]
        tenth = max(1, len(rss) // 10)
        report["flat_memory"] = {"rss_first_rounds_gb": sum(rss[:tenth]) / tenth,
                                 "rss_last_rounds_gb": sum(rss[-tenth:]) / tenth,
                                 "clients_with_files_at_end": runs["thousand"]["client_files"]}
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report.get(k) for k in ("ratios", "flat_memory")}, indent=1))


if __name__ == "__main__":
    main()
