"""pflalign benchmark: the memory a round's aggregation holds, against the number of participants
(issue 21: "Aggregation keeps a running weighted sum instead of every reply").

    python benchmarks/aggregation_memory.py --data-dir ../shared/data --out benchmarks/results/aggregation_memory.json

For each participant count P (``--participants``, default 10 and 100), in a fresh subprocess:
the tiny random Llama with LoRA rank ``--lora-r`` (default 64: a 512 KiB message, large enough
to show in the resident memory), Dolly split IID into P clients, participation 1, one round of
one local step. Every client is tokenized before the round, so the round allocates only what
training and aggregation need. Measured over the round (`Federation.train_round`):

* ``peak_messages_bytes``: the most bytes of client messages alive at once (weak references to
  each message's tensors, taken when the method's `client_end` returns it; exact, allocator-free);
* ``rss_growth_kib``: the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``
  just before the round) minus the resident set at its start.

Run it from a checkout of the code to measure (``PYTHONPATH=<checkout>/src``) to compare
before and after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def one(participants: int, data_dir: Path, lora_r: int, method: str) -> dict:
    from pflalign.config import build_config
    from pflalign.run.engine import Federation

    cfg = build_config(None, {
        "method": method, "model": "tiny-llama", "lora": {"r": lora_r, "alpha": 2 * lora_r}, "rounds": 1,
        "local_steps": 1, "batch_size": 2, "max_seq_len": 96, "participation": 1.0,
        "data": {"name": "dolly", "dir": str(data_dir / "dolly"), "partition": "iid",
                 "num_clients": participants, "max_test": 1},
        "eval": {"max_new_tokens": 4, "batch_size": 4, "base_model": False},
    })
    with tempfile.TemporaryDirectory() as tmp:
        fed = Federation(cfg, progress=False, out=tmp)
        for client in fed.clients:
            client.train  # tokenized now, not during the round
        live, peak = {}, [0]  # message id → its bytes while any of its tensors lives
        client_end = fed.method.client_end

        def tracked(global_params, params, state, scratch):
            message = client_end(global_params, params, state, scratch)
            tensors = [t for ts in message.values() for t in ts.values()]
            key = id(message)
            live[key] = sum(t.numel() * t.element_size() for t in tensors)
            sizes.append(live[key])
            peak[0] = max(peak[0], sum(live.values()))
            alive = [len(tensors)]

            def gone(_):
                alive[0] -= 1
                if alive[0] == 0:
                    live.pop(key, None)

            message_refs.extend(weakref.ref(t, gone) for t in tensors)
            return message

        message_refs, sizes = [], []
        fed.method.client_end = tracked
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
        rss_start = status_kib("VmRSS")
        tic = time.perf_counter()
        fed.train_round(0)
        seconds = time.perf_counter() - tic
        rss_peak = status_kib("VmHWM")
    return {"participants": participants, "method": method, "lora_r": lora_r,
            "peak_messages_bytes": peak[0], "messages_alive_after_round": len(live),
            "one_message_bytes": max(sizes), "rss_start_kib": rss_start, "rss_peak_kib": rss_peak,
            "rss_growth_kib": rss_peak - rss_start, "round_seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--participants", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--lora-r", type=int, default=64)
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the subprocess: one participant count
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.data_dir, args.lora_r, args.method)))
        return
    rows = []
    for p in args.participants:
        cmd = [sys.executable, __file__, "--data-dir", str(args.data_dir), "--lora-r", str(args.lora_r),
               "--method", args.method, "--one", str(p)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
