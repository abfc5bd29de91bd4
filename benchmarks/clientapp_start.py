"""How long a Flower ClientApp process takes from its start to its first local step.

On the Deployment Engine every message to a client starts a fresh ClientApp
process (Flower's subprocess isolation), so what it does before it trains is
paid once per client per round. This script measures that in isolation:

    .venv/bin/python benchmarks/clientapp_start.py --data-dir ../shared/data --repeat 2

For each repetition it starts a fresh Python process that does what Flower's
``flwr-clientapp`` does with a train message, without the network: import
Flower and ``pflalign.flower.client_app``, build the message (w^0 read from a
file the parent wrote, the resolved config of benchmarks/engines.py's job),
and call the ClientApp's ``train`` handler for client ``--client`` (round 1,
a fresh state). The time is taken from just before the parent starts the
process (wall clock) to the start of the first forward/backward pass
(`FederatedLM.loss_and_grads`, wrapped in the child), with the child's CPU
time until then (``start_to_first_step_cpu_s``: user + system seconds of the
process, which other processes on the machine inflate far less), and split into
``imports`` (interpreter start and imports), ``setup`` (the handler's model,
data and state) and the first step itself. The child also reports the
handler's total time (all local steps). The model and tokenized-data caches
are whatever ``$PFLALIGN_CACHE`` holds: run it twice to see a warm start
(``--repeat``), or point ``PFLALIGN_CACHE`` at an empty folder for a cold one.
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
import json, sys, time
t_spawn = float(sys.argv[1]); args = json.loads(sys.argv[2])
t_imports0 = time.time()
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from pflalign.flower import client_app, wire
from pflalign.model import FederatedLM
t_imported = time.time()
marks = {}
original = FederatedLM.loss_and_grads
def timed(self, *a, **kw):
    marks.setdefault("first_step_cpu", time.process_time())
    marks.setdefault("first_step", time.time())
    out = original(self, *a, **kw)
    marks.setdefault("first_step_done", time.time())
    return out
FederatedLM.loss_and_grads = timed
w0 = torch.load(args["w0"])
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as Flower sets them in a ClientApp
content = RecordDict({wire.GLOBAL: wire.to_record(w0), "config": ConfigRecord(
    {"cfg": args["cfg"], "experiment": args["experiment"], "done": 0, "round": 0})})
msg = Message(content=content, dst_node_id=1, message_type="train")
ctx = Context(run_id=1, node_id=1, node_config={"partition-id": args["client"], "num-partitions": args["clients"],
              "state-dir": args["state"]}, state=RecordDict(), run_config={})
t_handler = time.time()
client_app.train(msg, ctx)
t_done = time.time()
print("RESULT " + json.dumps({"imports_s": t_imported - t_spawn, "setup_s": marks["first_step"] - t_handler,
    "start_to_first_step_s": marks["first_step"] - t_spawn, "start_to_first_step_cpu_s": marks["first_step_cpu"], "first_step_s": marks["first_step_done"] - marks["first_step"],
    "handler_s": t_done - t_handler, "total_s": t_done - t_spawn, "pflalign": client_app.__file__}))
"""


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engines import resolve  # the engines benchmark's job

    from pflalign.config import build_config
    from pflalign.flower import wire
    from pflalign.model import build_model
    from pflalign.partition import client_names

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="folder with flan/ and dolly/")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--client", type=int, default=0, help="partition-id (default 0)")
    parser.add_argument("--repeat", type=int, default=2, help="fresh processes, one after the other (default 2)")
    parser.add_argument("--out", help="write the measurements here (JSON)")
    args = parser.parse_args()
    cfg = build_config(None, resolve(Path(args.data_dir), args.set))
    import torch

    with tempfile.TemporaryDirectory(prefix="pflalign-start-") as tmp:
        w0 = Path(tmp) / "w0.pt"
        torch.save(build_model(cfg, device="cpu").get_lora(), w0)
        runs = []
        for i in range(args.repeat):
            child = {"w0": str(w0), "cfg": wire.config_json(cfg), "experiment": f"start{i}", "client": args.client,
                     "clients": len(client_names(cfg)), "state": str(Path(tmp) / "state")}
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
        Path(args.out).write_text(json.dumps({"command": sys.argv, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
