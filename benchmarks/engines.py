"""pflalign benchmark: the same run in-process, on Flower's Simulation Engine and on
Flower's Deployment Engine; wall time, bytes per round, and whether they agree.

    .venv/bin/python benchmarks/engines.py --data-dir ../shared/data --out benchmarks/results/engines.json

The run (one configuration, resolved once here and given to all three engines as
the same JSON file): the ``flan-paper`` preset (FLAN, the paper's 4 categories,
one client each) with ``model=smollm2-135m rounds=2 local_steps=5
data.max_test=4 eval.base_model=false eval.max_new_tokens=16`` (a tiny final
evaluation, so that the time is mostly training), then the ``--set`` items
given here; ``data.dir`` is ``<data-dir>/<data.name>`` unless set.

The engines, one after the other, each on its own ports and in its own folder
of a temporary directory (``FLWR_HOME`` there too: ``~/.flwr`` is untouched):

* ``inprocess``: ``python -m pflalign run --config CONFIG --out OUT --no-progress``
  (the CLI, a subprocess): the clients train one after the other in one process.
* ``simulation``: ``flower-superlink --simulation`` on 127.0.0.1, then
  ``flwr run`` with ``num-supernodes=N client-resources-num-cpus=1``: every
  client is a Ray actor that may use 1 CPU, so Ray runs as many clients at
  once as the machine has CPUs; the actors keep the model loaded.
* ``deployment``: ``flower-superlink`` and N ``flower-supernode`` processes on
  127.0.0.1 (insecure), one per client (``partition-id`` k), then ``flwr run``:
  every message to a client starts a new ClientApp process (Flower's
  ``--isolation subprocess``) that loads the model and its data again.
* ``deployment-fork``: the same, with the SuperLink and the SuperNodes in
  ``--isolation process`` beside a ``pflalign-superexec`` each
  (`pflalign.flower.superexec`): every ServerApp and ClientApp process is forked
  from one that has torch, transformers and Flower imported (it still loads the
  model and its data again).

Measured, per engine (wall clock, ``time.monotonic``):

* ``startup_s``: starting the SuperLink and the SuperNodes, until every one of
  them accepts connections on its port (0 for in-process; for the Simulation
  Engine only the SuperLink: Ray starts within the run);
* ``run_s``: from launching ``pflalign run`` / ``flwr run`` until ``results.json``
  exists in the run directory (polled every 0.1 s; it is written last, atomically).
  For Flower this includes the CLI building and sending the app, the SuperLink
  starting the ServerApp (its w^0), the ServerApp waiting for a SuperNode per
  client (polled every second), Ray's start (simulation), the rounds and the
  final evaluation;
* ``exit_s``: from the same launch until that process has exited;
* ``train_s`` / ``eval_s``: the run's own ``seconds_train_this_session`` and
  ``seconds_eval`` (results.json; all rounds, and the final evaluation);
  ``other_s`` = ``run_s`` - both: everything before the first round (imports,
  data, model, the app's start and connection, Ray) and the last writes;
  ``round_s``: each round's ``seconds`` (metrics.jsonl);
* ``bytes_to_clients`` / ``bytes_from_clients`` per round, read off the finished
  run: the ServerApp's count of the round's messages in ``metrics.jsonl`` (the
  tensor payload: array data and names, Flower's framing not counted). None
  in-process, where nothing is sent;
* ``wire_bytes_to_clients`` / ``wire_bytes_from_clients`` (Deployment Engine
  only): the bytes that crossed the SuperNodes' TCP connections to the
  SuperLink, the kernel's own counts (``ss -tinp``: ``bytes_received`` and
  ``bytes_acked`` of every connection of a SuperNode process to the SuperLink's
  port, polled every 0.5 s during the run): everything Flower sends between
  the machines of a real deployment (protobuf, gRPC and HTTP/2 framing,
  heartbeats, the app bundle), per round (from the launch, or the previous
  round's line in ``metrics.jsonl``, to this round's line) and for the final
  evaluation (``wire_bytes_eval``: to ``results.json``);
* ``machine_load``: the CPU seconds every process on the machine used during
  the engine's run (``/proc/stat``), those of this benchmark's own finished
  processes (``getrusage``), the rest (``other_cpu_s``: other work on the
  machine, and Flower's detached SuperExec), and the 1-minute load average
  before and after: how quiet the machine was;
* ``max_abs_diff``: the largest |difference| between the final global adapter
  (``checkpoint.pt``'s ``global``) and the first engine's (the in-process one by
  default); ``same`` when the names match and it is at most 1e-6 (the Flower
  tests' tolerance). A run that differs makes the exit status 1;
* ``cpu_by_process_kind`` (in ``machine_load``): the CPU seconds of the run's
  processes by kind (SuperLink, SuperNodes, SuperExecs, ClientApp and ServerApp
  processes, Ray's, the in-process run), read every second (`ProcessMeter`);
  on a shared machine these, not the wall seconds, compare the engines' work;
* ``identical``: whether that largest difference is exactly 0 (issue 23's target).

Every engine's processes (and those they start: SuperExec, app processes, Ray)
are stopped before the next starts, and at the end also on an error, Ctrl-C or
SIGTERM. Cores and threads: every engine gets the cores this benchmark may run
on (its CPU affinity: all of the machine's, or those ``taskset`` gives it), and
processes training at once × threads each = those cores where the engine allows
it (`engine_threads`, recorded per engine in the JSON as ``threads``). The
in-process run trains one client at a time with ``OMP_NUM_THREADS`` = cores; the
Simulation Engine gets ``init-args-num-cpus`` = cores (Ray counts every CPU of the
machine, even under ``taskset``) and ``client-resources-num-cpus`` = max(1, cores //
N), so Ray runs cores // that many ClientApps at once, each with that many threads;
the Deployment Engine's N ClientApps all train at once, with ``OMP_NUM_THREADS`` =
max(1, cores // N) each (4 SuperNodes on 2 cores: 4 processes of 1 thread, twice
the cores; with torch's default there, 4 ClientApps of 2 threads on 2 cores made
the first round take 386 s; with 1 thread each, 173 s). An ``OMP_NUM_THREADS``
set in this environment is overridden. The in-process run uses mimalloc (the
``pflalign`` command re-executes itself under it), Flower's processes the system
allocator (``allocator`` in ``threads``). The Flower processes import pflalign from
this environment (as the installed app does), not from the app bundle that ``flwr
run`` sends (`Processes` makes a relative ``PYTHONPATH`` absolute, since they run
in the run's folders). ``FLWR_LOG_LEVEL=DEBUG`` with ``--keep`` lets
``deployment_timeline.py`` split a Deployment run's messages into their steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import flwr
import psutil
import torch

from pflalign import checkpoint as ckpt
from pflalign.config import build_config, parse_set, to_dict
from pflalign.flower.cluster import Cluster, Processes
from pflalign.data.clients import client_names

REPO = Path(__file__).resolve().parents[1]  # the Flower app's project folder
ENGINES = ("inprocess", "simulation", "deployment", "deployment-fork")
PRESET = "flan-paper"
DEFAULT_SET = ["model=smollm2-135m", "rounds=2", "local_steps=5", "data.max_test=4", "eval.base_model=false",
               "eval.max_new_tokens=16"]
TOLERANCE = 1e-6


def resolve(data_dir: Path, items: list[str]) -> dict:
    overrides = parse_set(DEFAULT_SET + items)  # later items win
    cfg = build_config(PRESET, overrides)
    if "dir" not in overrides.get("data", {}) and cfg.data.name in ("flan", "dolly"):
        cfg.data.dir = str((data_dir / cfg.data.name).resolve())
    return to_dict(cfg)


class WireMeter:
    """The bytes on the TCP connections of some processes (the SuperNodes) to one port (the
    SuperLink's), from the kernel's per-socket counters (`ss -tinp`), snapshotted at round ends."""

    SOCKET = re.compile(r"^\S+\s+\S+\s+(\S+):(\d+)\s+(\S+):(\d+)\s+users:\(\(.*?pid=(\d+)")

    def __init__(self, pids: set[int], port: int):
        self.pids, self.port = pids, port
        self.seen: dict[tuple, tuple[int, int]] = {}  # socket -> (received, sent): its last counts
        self.marks: list[tuple[int, int]] = []
        self.last_poll = 0.0

    def poll(self) -> None:
        text = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True).stdout
        lines = text.splitlines()
        for head, info in zip(lines, lines[1:]):
            m = self.SOCKET.match(head)
            if not m or int(m.group(5)) not in self.pids or int(m.group(4)) != self.port:
                continue
            got = dict(re.findall(r"(bytes_received|bytes_acked):(\d+)", info))
            sock = (m.group(1), m.group(2), m.group(3), m.group(4), m.group(5))
            self.seen[sock] = (int(got.get("bytes_received", 0)), int(got.get("bytes_acked", 0)))
        self.last_poll = time.monotonic()

    def total(self) -> tuple[int, int]:
        return sum(r for r, _ in self.seen.values()), sum(s for _, s in self.seen.values())

    def mark(self) -> None:
        self.poll()
        self.marks.append(self.total())

    def tick(self) -> None:
        if time.monotonic() - self.last_poll >= 0.5:
            self.poll()

    def summary(self) -> dict:
        """Per round (marks 0..R: launch, round ends) and the evaluation (last mark: results.json)."""
        steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(self.marks, self.marks[1:])]
        return {"wire_bytes_to_clients": [r for r, _ in steps[:-1]], "wire_bytes_from_clients": [s for _, s in steps[:-1]],
                "wire_bytes_eval": {"to_clients": steps[-1][0], "from_clients": steps[-1][1]},
                "wire_source": "ss -tinp: bytes_received / bytes_acked of the SuperNode processes' TCP connections "
                               "to the SuperLink port; per round from the launch or the previous round's line"}


class ProcessMeter:
    """CPU seconds (user + system) of every process of a run, by kind (SuperLink, SuperNode,
    SuperExec, ClientApp, ServerApp, Ray, ...): the process trees of `procs` are walked every
    `every` seconds and each process's last reading is kept. A process that exits and is reaped
    between two readings loses at most `every` seconds; Flower's short-lived app processes stay
    zombies (readable) until their SuperExec starts the next one, so they are read to the end."""

    KINDS = ("flwr-clientapp", "flwr-serverapp", "flwr-simulation", "flower-superexec", "pflalign-superexec",
             "flower-supernode", "flower-superlink", "raylet", "gcs_server", "ray::", "ray", "pflalign")

    def __init__(self, procs: Processes, every: float = 1.0):
        self.procs, self.every = procs, every
        self.seen: dict[tuple[int, float], dict] = {}  # (pid, start time) -> kind, cpu, first/last seen
        self.last = 0.0

    @classmethod
    def kind(cls, cmdline: list[str], name: str) -> str:
        text = " ".join(cmdline[:3]) or name
        if "flwr" in text and " run " in f" {' '.join(cmdline[1:3])} ":
            return "flwr run"
        return next((k for k in cls.KINDS if k in text), "other")

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        for proc in list(self.procs.procs.values()):
            try:
                root = psutil.Process(proc.pid)
                family = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in family:
                try:
                    with p.oneshot():
                        key, cpu = (p.pid, p.create_time()), p.cpu_times()
                        entry = self.seen.get(key)
                        if entry is None:
                            kind = self.kind(p.cmdline(), p.name())
                            parent = p.parent()
                            if kind == "pflalign-superexec" and parent and self.kind(parent.cmdline(), "") == kind:
                                kind = "app forked by pflalign-superexec"  # a ServerApp's or ClientApp's task
                            entry = self.seen[key] = {"kind": kind, "first": now}
                        entry["cpu_s"], entry["last"] = cpu.user + cpu.system, now
                except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                    continue

    def summary(self) -> dict:
        """Per kind: how many processes, their CPU seconds in all, and the largest one's."""
        kinds: dict[str, dict] = {}
        for entry in self.seen.values():
            k = kinds.setdefault(entry["kind"], {"processes": 0, "cpu_s": 0.0, "max_cpu_s": 0.0})
            k["processes"] += 1
            k["cpu_s"] += entry["cpu_s"]
            k["max_cpu_s"] = max(k["max_cpu_s"], entry["cpu_s"])
        return {"cpu_by_process_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["cpu_s"])),
                "cpu_by_process_kind_source": f"psutil cpu_times of the run's process trees, read every "
                                              f"{self.every:g} s (a process reaped between two reads loses "
                                              f"at most that much)"}


def round_count(out: Path) -> int:
    try:
        return sum('"event": "round"' in line for line in (out / ckpt.METRICS).read_text().splitlines())
    except OSError:
        return 0


def wait_for_results(out: Path, procs: Processes, name: str, t0: float, timeout: float,
                     meter: WireMeter | None = None, cpu: ProcessMeter | None = None) -> tuple[float, float]:
    """Seconds from t0 until results.json exists, and until process `name` exits (`meter`: marked
    at each new round line and at results.json; `cpu`: read as it asks)."""
    proc, found, rounds = procs.procs[name], None, 0
    while found is None:
        if cpu is not None:
            cpu.tick()
        if meter is not None:
            meter.tick()
            if (now := round_count(out)) > rounds:
                rounds = now
                meter.mark()
        if (out / ckpt.RESULTS).exists():
            found = time.monotonic() - t0
            if meter is not None:
                meter.mark()
        elif proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} without results:\n{procs.log(name)[-4000:]}")
        elif time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{name}: no results after {timeout:.0f} s:\n{procs.log(name)[-4000:]}")
        else:
            time.sleep(0.1)
    procs.finish(name, timeout=max(60.0, timeout - found))
    return found, time.monotonic() - t0


def engine_threads(engine: str, clients: int, cores: int) -> dict:
    """How an engine spreads over `cores`: the processes that train at once and the torch
    threads of each (their product is `cores` where the engine allows it)."""
    if engine == "inprocess":  # one client at a time
        return {"processes": 1, "threads": cores, "allocator": "mimalloc (the pflalign command)"}
    if engine == "simulation":  # Ray: runtime_cpus // client_cpus actors
        client_cpus = max(1, cores // clients)
        return {"processes": min(clients, cores // client_cpus), "threads": client_cpus, "runtime_cpus": cores,
                "client_cpus": client_cpus, "allocator": "system"}
    return {"processes": clients, "threads": max(1, cores // clients), "allocator": "system"}  # every ClientApp at once


def machine_cpu_seconds() -> float:
    """CPU seconds every process on the machine has used since boot (all cores; /proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4))  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and its finished descendants (the runs' processes, once reaped)."""
    import resource

    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def run_engine(engine: str, root: Path, config: Path, clients: int, timeout: float, threads: dict) -> dict:
    out = root / "out"
    busy0, own0, load0 = machine_cpu_seconds(), own_cpu_seconds(), os.getloadavg()[0]
    env = {"OMP_NUM_THREADS": str(threads["threads"])}
    if engine == "inprocess":
        procs = Processes(root, env)
    else:
        procs = Cluster(root, REPO, clients, simulation=engine == "simulation",
                        client_cpus=threads.get("client_cpus", 1), env=env, runtime_cpus=threads.get("runtime_cpus"),
                        fork_apps=engine == "deployment-fork")
    try:
        startup = 0.0  # in-process: nothing to start
        if isinstance(procs, Cluster):
            tic = time.monotonic()
            procs.start_link()
            if not procs.simulation:
                for k in range(clients):
                    procs.start_node(k)
            startup = time.monotonic() - tic
        meter = None
        if engine.startswith("deployment"):
            meter = WireMeter({procs.procs[f"node{k}"].pid for k in range(clients)}, procs.link_port)
            meter.mark()
        t0 = time.monotonic()
        if engine == "inprocess":
            procs.start("run", [sys.executable, "-m", "pflalign", "run", "--config", str(config), "--out", str(out),
                                "--no-progress"])
        else:
            procs.flwr_run({"config": str(config), "out": str(out), "client-dir": str(root / "clients")}, "run")
        cpu = ProcessMeter(procs)
        run_s, exit_s = wait_for_results(out, procs, "run", t0, timeout, meter, cpu)
        cpu.tick(force=True)
    finally:
        procs.close()
    left = procs.leftovers()
    if left:
        print(f"warning: {engine}: still running after close: {left}", file=sys.stderr)
    busy, own = machine_cpu_seconds() - busy0, own_cpu_seconds() - own0
    # how busy the machine was with other work meanwhile (Flower's detached processes, e.g. the
    # SuperExec, count as other work: their CPU is not reaped by this process)
    machine = {"machine_cpu_s": busy, "own_cpu_s": own, "other_cpu_s": busy - own,
               "loadavg_1min_before_after": [load0, os.getloadavg()[0]]}
    return {"startup_s": startup, "run_s": run_s, "exit_s": exit_s, "out": out,
            "machine": {**machine, **cpu.summary()}, "wire": meter.summary() if meter is not None else {}}


def round_lines(out: Path) -> list[dict]:
    return [row for row in map(json.loads, (out / ckpt.METRICS).read_text().splitlines()) if row["event"] == "round"]


def summarize(engine: str, measured: dict) -> dict:
    out = measured["out"]
    results = json.loads((out / ckpt.RESULTS).read_text())
    rounds = round_lines(out)
    if engine == "inprocess":  # one process: no message is sent
        down = up = None
        source = "in-process: no messages"
    else:
        down, up = [row["bytes_to_clients"] for row in rounds], [row["bytes_from_clients"] for row in rounds]
        source = "metrics.jsonl: the ServerApp's count of the round's messages (ArrayRecord bytes: data and names)"
    return {
        "startup_s": measured["startup_s"], "run_s": measured["run_s"], "exit_s": measured["exit_s"],
        "machine_load": measured["machine"],
        "train_s": results["seconds_train_this_session"], "eval_s": results["seconds_eval"],
        "other_s": measured["run_s"] - results["seconds_train_this_session"] - results["seconds_eval"],
        "round_s": [row["seconds"] for row in rounds],
        "bytes_to_clients": down, "bytes_from_clients": up, "bytes_source": source,
        **measured.get("wire", {}),
        "avg_rouge_l_personalized": results["avg_rouge_l_personalized"],
        "avg_rouge_l_global": results["avg_rouge_l_global"],
    }


def compare(reference: dict, other: dict) -> dict:
    if reference.keys() != other.keys():
        return {"same": False, "identical": False, "max_abs_diff": None, "why": "different tensor names"}
    diff = max(float((reference[n].double() - other[n].double()).abs().max()) for n in reference)
    return {"same": diff <= TOLERANCE, "identical": diff == 0, "max_abs_diff": diff}


def megabytes(values: list[int] | None) -> str:
    if values is None:
        return "-"
    shown = sorted({f"{v / 1e6:.3f}" for v in values})
    return "/".join(shown) + " MB"


def print_table(report: dict) -> None:
    ref = report["reference"]
    head = ("engine", "processes x threads", "startup s", "run s", "train s", "eval s", "other s", "exit s",
            "to clients/round", "from clients/round", "TCP to/from clients/round", f"max|Δw| vs {ref}")
    rows = [head]
    for engine, r in report["engines"].items():
        diff = "-" if engine == ref else ("n/a" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.2e}")
        rows.append((engine, f"{r['threads']['processes']} x {r['threads']['threads']}", f"{r['startup_s']:.1f}",
                     f"{r['run_s']:.1f}", f"{r['train_s']:.1f}", f"{r['eval_s']:.1f}", f"{r['other_s']:.1f}",
                     f"{r['exit_s']:.1f}", megabytes(r["bytes_to_clients"]),
                     megabytes(r["bytes_from_clients"]),
                     f"{megabytes(r['wire_bytes_to_clients'])} / {megabytes(r['wire_bytes_from_clients'])}"
                     if "wire_bytes_to_clients" in r else "-", diff))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    print("\n".join(lines))


def git_commit() -> str | None:
    """The measured code's commit, with "+dirty" when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "HEAD")
    return (head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) or None


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="folder with flan/ and dolly/ (e.g. ../shared/data)")
    parser.add_argument("--out", default="benchmarks/results/engines.json", help="the JSON report")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="config overrides after the defaults (see above), e.g. model=tiny-llama data.max_test=2")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, in this order (default: all)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run (default 3600)")
    parser.add_argument("--keep", metavar="DIR", help="keep the run folders and logs in DIR (default: a temporary one)")
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        parser.error(f"unknown engine(s) {unknown}; valid: {', '.join(ENGINES)}")
    signal.signal(signal.SIGTERM, _sigterm)  # stop our processes on SIGTERM too (the finally blocks)

    config = resolve(Path(args.data_dir), args.set)
    clients = len(client_names(build_config(None, config)))
    cores = len(os.sched_getaffinity(0))  # what every engine may use (taskset: fewer than the machine's)
    threads = {engine: engine_threads(engine, clients, cores) for engine in engines}
    report = {
        "command": sys.argv,
        "commit": git_commit(),
        "config": config,
        "clients": clients,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "cpu_affinity": sorted(os.sched_getaffinity(0)),  # taskset: the cores every engine ran on
                    "cores": cores, "python": platform.python_version(),
                    "torch": torch.__version__, "flwr": flwr.__version__,
                    "OMP_NUM_THREADS_here": os.environ.get("OMP_NUM_THREADS")},  # overridden per engine (threads)
        "reference": engines[0],
        "engines": {},
    }
    with tempfile.TemporaryDirectory(prefix="pflalign-engines-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        config_file = work / "config.json"
        config_file.write_text(json.dumps(config, indent=2) + "\n")
        finals = {}
        for engine in engines:
            print(f"{engine}: running ...", flush=True)
            measured = run_engine(engine, work / engine, config_file, clients, args.timeout, threads[engine])
            report["engines"][engine] = {"threads": threads[engine], **summarize(engine, measured)}
            finals[engine] = ckpt.load_checkpoint(measured["out"] / ckpt.CHECKPOINT)["global"]
            report["engines"][engine].update(compare(finals[engines[0]], finals[engine]))
            r = report["engines"][engine]
            load = r["machine_load"]
            ours = sum(k["cpu_s"] for k in load["cpu_by_process_kind"].values())
            print(f"{engine}: startup {r['startup_s']:.1f} s, run {r['run_s']:.1f} s (CPU: machine "
                  f"{load['machine_cpu_s']:.0f} s, the run's processes {ours:.0f} s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print()
    print_table(report)
    print(f"\n{clients} clients; run s: launch until results.json; bytes: tensor payload per round "
          f"(the ServerApp's count; TCP: the SuperNodes' connections, see the JSON); wrote {args.out}")
    differ = [e for e, r in report["engines"].items() if not r["same"]]
    if differ:
        print(f"error: the final global adapter of {', '.join(differ)} differs from {engines[0]}'s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the runs' processes were stopped on the way out (run_engine's finally)
        print("interrupted; every process of the runs is stopped", file=sys.stderr)
        sys.exit(130)
