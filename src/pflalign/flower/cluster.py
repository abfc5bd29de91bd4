"""A Flower federation on this machine, for the tests and the benchmarks: a
SuperLink (Deployment Engine, or Simulation Engine with ``simulation=True``)
and SuperNodes as real processes on 127.0.0.1 (insecure, or with TLS and
SuperNode authentication), `flwr run` of this repository's app, and a clean stop.

Every process is started in its own session and tracked together with the
processes it starts (SuperExec, the ServerApp and ClientApp processes, Ray),
so that `Processes.close` stops them all, the detached ones too, and
`Processes.leftovers` can check that nothing is left running or listening.
``FLWR_HOME`` is a folder under ``root`` whose ``config.toml`` names the
SuperLink ``cluster``: ``~/.flwr`` is neither read nor written. Ports are
free ones picked at start. Each process logs to ``root/<name>.log``.

    cluster = Cluster(root, app=REPO, clients=4)
    try:
        cluster.start_link()
        for k in range(4):
            cluster.start_node(k)
        cluster.flwr_run({"config": "flan-paper", "out": "/abs/out"}, "run")
        log = cluster.finish("run")
    finally:
        cluster.close()

(or ``with Cluster(...) as cluster:``, which closes it however the block ends).

Flower's own ``local`` connection (``flwr run . local``, docs/distributed.md) starts a
simulation SuperLink on 127.0.0.1 that outlives the run; one command stops it, with
what it started:

    python -m pflalign.flower.cluster stop-local     # $FLWR_HOME, else ~/.flwr
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import psutil

LOCAL_LOG = ("local-superlink", "superlink.log")  # where `flwr` points its managed SuperLink's --log-file

BIN = Path(sys.executable).parent  # flwr, flower-superlink, flower-supernode, flower-superexec
ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",  # nothing leaves the machine
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # the app runs from this environment
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray (Simulation Engine) on 127.0.0.1 only
    "TOKENIZERS_PARALLELISM": "false",
}
CONNECTION = "cluster"  # the SuperLink's name in FLWR_HOME/config.toml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def fab_folder(app: Path, dest: Path) -> Path:
    """A folder holding only what the FAB of `app` holds: its pyproject.toml and the files its
    ``fab-include`` patterns match (`app` itself when it declares none). `flwr run` walks every
    file under the app folder before it filters (Flower 1.42's `collect_files`); in a checkout
    with its .venv (50,000 files) that took 3.8 CPU s a run, in this copy 0.01. The FAB is the
    same bytes, so its hash too (tests/test_flower.py)."""
    app = Path(app)
    config = tomllib.loads((app / "pyproject.toml").read_text())
    patterns = config.get("tool", {}).get("flwr", {}).get("app", {}).get("fab-include")
    if not patterns:
        return app
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(app / "pyproject.toml", dest / "pyproject.toml")
    for pattern in patterns:
        for path in app.glob(pattern):
            if path.is_file():
                (dest / path.relative_to(app)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest / path.relative_to(app))
    return dest


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Processes:
    """Processes started in their own sessions (logs in `root`), stopped together by `close`."""

    def __init__(self, root: Path, env: dict | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **ENV, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
        if self.env.get("PYTHONPATH"):  # the processes run in `root`: `PYTHONPATH=src` would name root/src there
            self.env["PYTHONPATH"] = os.pathsep.join(str(Path(entry).absolute()) if entry else entry
                                                     for entry in self.env["PYTHONPATH"].split(os.pathsep))
        self.procs: dict[str, subprocess.Popen] = {}
        self.seen: dict[int, psutil.Process] = {}  # every process started, with the ones they started
        self.ports: list[int] = []

    def start(self, name: str, args: list[str], port: int | None = None) -> subprocess.Popen:
        """Start `args` as `name`; with `port`, wait until it listens there."""
        log = open(self.root / f"{name}.log", "ab")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        self.track()
        if port is not None:
            self.ports.append(port)
            wait_listening(port, proc)
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def finish(self, name: str, timeout: float | None = None) -> str:
        """Wait for process `name` to end; its output."""
        try:
            self.procs[name].wait(timeout=timeout)
        finally:
            self.track()
        return self.log(name)

    def track(self) -> None:
        for proc in self.procs.values():
            try:
                parent = psutil.Process(proc.pid)
                for p in [parent, *parent.children(recursive=True)]:
                    self.seen.setdefault(p.pid, p)
            except psutil.NoSuchProcess:
                pass

    def close(self) -> None:
        """SIGTERM to every process group, then SIGKILL to whatever of them (or of theirs) is left."""
        self.track()
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.seen.values():  # whatever is left, with the detached ones (SuperExec, app processes)
            if alive(p):
                p.kill()
        for proc in self.procs.values():
            proc.wait(timeout=30)
        psutil.wait_procs([p for p in self.seen.values() if alive(p)], timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def leftovers(self) -> list[str]:
        """Processes of ours still running, and our ports still listening (after `close`: none)."""
        left = [f"process {p.pid} {p.name()}" for p in self.seen.values() if alive(p)]
        return left + [f"port {c.laddr.port} still listening" for c in psutil.net_connections(kind="inet")
                       if c.status == psutil.CONN_LISTEN and c.laddr.port in self.ports]


class Cluster(Processes):
    """A SuperLink (simulation or not), SuperNodes (one per client) and `flwr run` of the app in `app`
    (the folder whose pyproject.toml declares it), all on 127.0.0.1.

    `clients`: the run's number of clients (the SuperNodes' ``num-partitions``; with
    `simulation`, ``num-supernodes``); `client_cpus`: the Simulation Engine's
    ``client-resources-num-cpus``; `runtime_cpus`: its ``init-args-num-cpus``, the CPUs
    Ray may use, so it runs that many // `client_cpus` ClientApps at once (None: Ray's
    own count, every CPU of the machine, even in a process confined to fewer by ``taskset``).

    `tls`: a folder with ``ca.crt``, ``server.pem`` and ``server.key`` (a server
    certificate for 127.0.0.1 signed by that CA): the SuperLink serves TLS, the
    SuperNodes and `flwr` trust the CA; with `node_auth` too, the SuperLink runs with
    ``--enable-supernode-auth`` and a SuperNode connects with its private key
    (`start_node`'s `key`), once its public key is registered (`register`).

    `fork_apps` (Deployment Engine, no TLS): the SuperLink and each SuperNode run with
    ``--isolation process`` beside a ``pflalign-superexec`` (`pflalign.flower.superexec`), which
    forks every ServerApp and ClientApp process from one that has torch, transformers and Flower
    imported; False: Flower's own SuperExecs, a new ``flwr-serverapp`` process per run and
    ``flwr-clientapp`` process per message (Flower's default). Either way the SuperExecs look
    for tasks every 0.1 s (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``; Flower's default is 1 s)."""

    def __init__(self, root: Path, app: Path, clients: int, simulation: bool = False, client_cpus: int = 1,
                 env: dict | None = None, tls: Path | None = None, node_auth: bool = False,
                 runtime_cpus: int | None = None, fork_apps: bool = False):
        home = Path(root) / "flwr-home"
        super().__init__(root, {"FLWR_HOME": str(home), "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1", **(env or {})})
        self.app = fab_folder(Path(app), self.root / "app")  # what `flwr run` bundles, not a whole checkout
        self.clients, self.simulation, self.client_cpus = clients, simulation, client_cpus
        self.runtime_cpus = runtime_cpus
        self.fork_apps = fork_apps and not simulation
        self.tls, self.node_auth = (Path(tls) if tls else None), node_auth
        if node_auth and not tls:
            raise ValueError("SuperNode authentication needs TLS")
        if self.fork_apps and tls:
            raise ValueError("fork_apps: this harness starts pflalign-superexec on insecure clusters only")
        self.link_port = free_port()
        home.mkdir(parents=True, exist_ok=True)
        security = f'root-certificates = "{self.tls / "ca.crt"}"' if self.tls else "insecure = true"
        (home / "config.toml").write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                                          f'address = "127.0.0.1:{self.link_port}"\n{security}\n')

    def start_link(self) -> None:
        if self.tls:
            security = ["--ssl-ca-certfile", str(self.tls / "ca.crt"), "--ssl-certfile", str(self.tls / "server.pem"),
                        "--ssl-keyfile", str(self.tls / "server.key")]
            security += ["--enable-supernode-auth"] if self.node_auth else []
        else:
            security = ["--insecure"]
        args = [str(BIN / "flower-superlink"), *security, "--host", "127.0.0.1", "--port", str(self.link_port),
                "--disable-runtime-dependency-installation"]
        args += ["--simulation"] if self.simulation else []
        args += ["--isolation", "process"] if self.fork_apps else []
        link = self.start("superlink", args, self.link_port)
        if self.fork_apps:
            self.start_superexec("superlink", self.link_port, link.pid)

    def start_node(self, k: int, key: Path | None = None, name: str | None = None) -> None:
        """The SuperNode of client k (partition-id k), its state in `state_dir(k)`; `key`: its
        private key (SuperNode authentication); `name`: its process name (default node<k>)."""
        port = free_port()
        config = f'partition-id={k} num-partitions={self.clients} state-dir="{self.state_dir(k)}"'
        security = ["--root-certificates", str(self.tls / "ca.crt")] if self.tls else ["--insecure"]
        security += ["--auth-supernode-private-key", str(key)] if key else []
        isolation = ["--isolation", "process"] if self.fork_apps else []
        name = name or f"node{k}"
        node = self.start(name, [str(BIN / "flower-supernode"), *security, *isolation, "--superlink",
                                 f"127.0.0.1:{self.link_port}", "--port", str(port), "--node-config", config], port)
        if self.fork_apps:
            self.start_superexec(name, port, node.pid)

    def start_superexec(self, name: str, port: int, parent: int) -> None:
        """pflalign-superexec for the SuperLink or SuperNode `name`, whose Runtime API is on `port` and
        whose process is `parent` (the SuperExec Flower's would otherwise start itself, and ends with it)."""
        self.start(f"{name}-superexec", [str(BIN / "pflalign-superexec"), "--insecure", "--runtime-api-address",
                                         f"127.0.0.1:{port}", "--parent-pid", str(parent)])

    def register(self, public_key: Path) -> str:
        """`flwr supernode register` of a SuperNode's public key (OpenSSH format); its output."""
        return subprocess.run([str(BIN / "flwr"), "supernode", "register", str(public_key), CONNECTION],
                              env=self.env, cwd=self.root, capture_output=True, text=True, check=True).stdout

    def state_dir(self, k: int) -> Path:
        return self.root / f"node{k}-state"

    def kill_node(self, k: int, crash: bool = True) -> None:
        """crash: SIGKILL to the SuperNode and everything it started (the SuperLink notices when
        its heartbeats stop); else SIGTERM to the SuperNode, which deregisters and stops."""
        self.track()
        node = self.procs.pop(f"node{k}")
        superexec = self.procs.pop(f"node{k}-superexec", None)  # fork_apps: ends with its node (--parent-pid)
        family = [psutil.Process(node.pid)]
        if crash:  # the node's tree, and with fork_apps its SuperExec's, as Flower's SuperExec is the node's child
            family += family[0].children(recursive=True)
            if superexec is not None:
                try:
                    family += [psutil.Process(superexec.pid), *psutil.Process(superexec.pid).children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
        for p in family:
            try:
                p.send_signal(signal.SIGKILL if crash else signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        node.wait(timeout=60)

    def flwr_run(self, run_config: dict, name: str) -> subprocess.Popen:
        """`flwr run` of the app (in the background; `finish(name)` waits for it: it streams the
        ServerApp's log until the run ends)."""
        for started, proc in self.procs.items():  # a run would wait for its tasks until connect-timeout
            if started.endswith("-superexec") and proc.poll() is not None:
                raise RuntimeError(f"{started} exited with {proc.returncode}:\n{self.log(started)[-3000:]}")
        items = []
        for key, value in run_config.items():
            if isinstance(value, bool):
                items.append(f"{key}={str(value).lower()}")
            elif isinstance(value, str):
                items.append(f"{key}='{value}'")  # a TOML literal string: JSON inside is fine
            else:
                items.append(f"{key}={value}")
        args = [str(BIN / "flwr"), "run", str(self.app), CONNECTION, "--run-config", " ".join(items), "--stream"]
        if self.simulation:
            federation = f"num-supernodes={self.clients} client-resources-num-cpus={self.client_cpus}"
            federation += f" init-args-num-cpus={self.runtime_cpus}" if self.runtime_cpus else ""
            args += ["--federation-config", federation]
        return self.start(name, args)


# ---- Flower's managed local SuperLink ------------------------------------------------------
def flwr_home() -> Path:
    """Flower's home folder: $FLWR_HOME, else ~/.flwr (as `flwr` decides it)."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")


def local_superlinks(home: Path | None = None) -> list[psutil.Process]:
    """The SuperLinks that `flwr` started for its ``local`` connection of `home` (this user's
    ``flower-superlink --simulation`` processes logging to ``home/local-superlink/superlink.log``)."""
    log = str(Path(home or flwr_home()).expanduser().absolute().joinpath(*LOCAL_LOG))
    found = []
    for p in psutil.process_iter(["cmdline", "uids"]):
        cmd = p.info["cmdline"] or []
        if p.info["uids"] is None or p.info["uids"].real != os.getuid():
            continue
        if any(Path(c).name == "flower-superlink" for c in cmd[:2]) and "--simulation" in cmd \
                and "--log-file" in cmd[:-1] and cmd[cmd.index("--log-file") + 1] == log:
            found.append(p)
    return found


def stop_local_superlink(home: Path | None = None, timeout: float = 20) -> list[int]:
    """Stop `flwr`'s local SuperLink of `home` and every process it started (SIGTERM, then
    SIGKILL after `timeout` s); the pids stopped (none: none was running)."""
    family = []
    for link in local_superlinks(home):
        try:
            family += [link, *link.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for p in family:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(family, timeout=timeout)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=timeout)
    return [p.pid for p in family]


def main(argv: list[str] | None = None) -> int:
    """``python -m pflalign.flower.cluster stop-local [FLWR_HOME]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pflalign.flower.cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop-local", help="stop the SuperLink that `flwr run . local` left running on 127.0.0.1")
    stop.add_argument("home", nargs="?", help="Flower's home folder (default $FLWR_HOME, else ~/.flwr)")
    args = parser.parse_args(argv)
    pids = stop_local_superlink(Path(args.home) if args.home else None)
    print(f"stopped the local SuperLink and what it started: pids {', '.join(map(str, pids))}" if pids
          else "no local SuperLink of this user is running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
