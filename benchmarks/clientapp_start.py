"""How long a Flower ClientApp process takes from its start to its first local step.

On the Deployment Engine every message to a client starts a fresh ClientApp
process (Flower's subprocess isolation), so what it does before it trains is
paid once per client per round. This script measures that in isolation:

    .venv/bin/python benchmarks/clientapp_start.py --data-dir ../shared/data --repeat 2
    .venv/bin/python benchmarks/clientapp_start.py --data-dir ../shared/data --message query

For each repetition it starts a fresh Python process that does what Flower's
``flwr-clientapp`` does with a message, without the network: import Flower's
ClientApp entry point (``flwr.supernode.cli``, ``run_clientapp``), then
``pflalign.flower.client_app`` (Flower's loading of the app), build the
message with Flower and NumPy alone (as Flower hands it over: for ``train``,
w^0 as `wire.to_record` sends it, written by the parent; the resolved config of
benchmarks/engines.py's job; round 1, a fresh state) and call the ClientApp
with it, as client ``--client``. Times are taken from just before the parent
starts the process (wall clock) to the start of the first local step (the
handler's log line "first local step ..."), or for a ``query`` to its reply,
with the child's CPU time until then (``*_cpu_s``: user + system seconds of
the process, which other processes on the machine inflate far less), and
split into ``flwr_import`` (Flower's entry point), ``app_import`` (our module),
``setup`` (from the handler's call to its first step: torch, transformers,
the model, the data and the state) and ``handler`` (the whole call: all local
steps). The model and tokenized-data caches are whatever ``$PFLALIGN_CACHE``
holds: run it twice to see a warm start (``--repeat``), or point
``PFLALIGN_CACHE`` at an empty folder for a cold one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, logging, sys, time
t_spawn = float(sys.argv[1]); args = json.loads(sys.argv[2])
marks = {"start": (time.time(), time.process_time())}
def mark(name):
    marks.setdefault(name, (time.time(), time.process_time()))
from flwr.supernode.cli import flwr_clientapp  # what Flower's flwr-clientapp command imports first
import flwr.supernode.runtime.run_clientapp
mark("flwr_imported")
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from pflalign.flower import client_app  # what Flower's ClientApp loading imports
mark("app_imported")
class FirstStep(logging.Handler):  # train() logs "first local step ..." just before its first step
    def emit(self, record):
        if "first local step" in record.getMessage():
            mark("first_step")
logging.getLogger("flwr.pflalign").addHandler(FirstStep())
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as Flower sets them in a ClientApp
ctx = Context(run_id=1, node_id=1, node_config={"partition-id": args["client"], "num-partitions": args["clients"],
              "state-dir": args["state"]}, state=RecordDict(), run_config={})
if args["message"] == "query":
    msg = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=1, message_type="query")
else:  # w^0 as the wire sends it (wire.to_record), built with NumPy: the handler imports torch itself
    layout = open(args["w0"] + ".layout").read()
    content = RecordDict({"global": ArrayRecord({layout: Array(np.load(args["w0"] + ".npy"))}), "config": ConfigRecord(
        {"cfg": args["cfg"], "experiment": args["experiment"], "done": 0, "round": 0})})
    msg = Message(content=content, dst_node_id=1, message_type="train")
mark("handler")
client_app.app(msg, ctx)
mark("done")
out = {"message": args["message"], "pflalign": client_app.__file__,
       "spawn_to_python_s": marks["start"][0] - t_spawn, "python_start_cpu_s": marks["start"][1]}
for name, (a, b) in {"flwr_import": ("start", "flwr_imported"), "app_import": ("flwr_imported", "app_imported"),
                     "setup": ("handler", "first_step"), "handler": ("handler", "done")}.items():
    if a in marks and b in marks:
        out[name + "_s"], out[name + "_cpu_s"] = marks[b][0] - marks[a][0], marks[b][1] - marks[a][1]
end, label = ("first_step", "start_to_first_step") if "first_step" in marks else ("done", "start_to_reply")
out[label + "_s"], out[label + "_cpu_s"] = marks[end][0] - t_spawn, marks[end][1]
print("RESULT " + json.dumps(out))
"""


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engines import git_commit, resolve  # the engines benchmark's job

    from pflalign.config import build_config
    from pflalign.flower import wire
    from pflalign.model import build_model
    from pflalign.data.clients import client_names

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="folder with flan/ and dolly/")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--client", type=int, default=0, help="partition-id (default 0)")
    parser.add_argument("--repeat", type=int, default=2, help="fresh processes, one after the other (default 2)")
    parser.add_argument("--message", choices=("train", "query"), default="train",
                        help="train (default): round 1 of client --client; query: which client am I")
    parser.add_argument("--out", help="write the measurements here (JSON)")
    args = parser.parse_args()
    cfg = build_config(None, resolve(Path(args.data_dir), args.set))
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="pflalign-start-") as tmp:
        w0 = Path(tmp) / "w0"
        record = wire.to_record(build_model(cfg, device="cpu").get_lora())
        (layout, array), = record.items()
        w0.with_suffix(".layout").write_text(layout)
        np.save(w0.with_suffix(".npy"), array.numpy())
        runs = []
        for i in range(args.repeat):
            child = {"w0": str(w0), "cfg": wire.config_json(cfg), "experiment": f"start{i}", "client": args.client,
                     "clients": len(client_names(cfg)), "state": str(Path(tmp) / "state"), "message": args.message}
            t = time.time()
            done = subprocess.run([sys.executable, "-c", CHILD, repr(t), json.dumps(child)], capture_output=True,
                                  text=True, env=os.environ)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                return 1
            runs.append(json.loads(lines[-1][len("RESULT "):]))
            print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items() if k.endswith("_s")),
                  flush=True)
    print(f"pflalign imported from {runs[-1]['pflalign']}")
    if args.out:
        report = {"command": sys.argv, "commit": git_commit(), "cpu_affinity": sorted(os.sched_getaffinity(0)),
                  "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "runs": runs}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
