"""Where a Deployment Engine message's time goes, read off a kept run's logs.

    FLWR_LOG_LEVEL=DEBUG .venv/bin/python benchmarks/engines.py --data-dir ../shared/data \\
        --engines deployment --keep /tmp/keep --out /tmp/engines.json
    .venv/bin/python benchmarks/deployment_timeline.py /tmp/keep

``FLWR_LOG_LEVEL=DEBUG`` is needed: it puts a timestamp on every line of
Flower's log (INFO lines carry none otherwise) and adds the ClientApp
process's steps. A SuperNode's log (``node<k>.log``) holds its own lines and
those of the ClientApp processes it starts, one message at a time, so each
message's lines follow its ``Receiving`` line. For every message, the seconds
from the SuperNode's ``Receiving`` (it starts pulling the message from the
SuperLink; the task, and so the ClientApp process, is created at once) to:

* ``received``: ``Received successfully`` (the message is on the SuperNode);
* ``flwr_ready``: the ClientApp process logs ``Start `flwr-clientapp` process``
  (Python and Flower's ClientApp entry point imported);
* ``message_in``: it has pulled the message (``ConfirmMessageReceived``);
* ``app_load``: ``Loading ClientApp`` (the app bundle installed);
* ``first_step`` (train): our handler's ``first local step`` line, with the
  process's age and CPU seconds there (``age_s``, ``cpu_s``), so the
  process's start is ``first_step - age_s``;
* ``reply``: the ClientApp pushes its reply (``Runtime.PushMessages``);
* ``sent``: the SuperNode's ``Sent successfully`` (the reply is on the SuperLink).

And per round (the ServerApp's ``round r/R`` line, ``results:`` for the final
evaluation): ``after_last_sent``, the seconds from the round's last ``Sent
successfully`` to that line (the ServerApp noticing the replies, aggregating,
writing its checkpoint). Prints the median of every column per message type,
and every message with ``--all``.
"""

from __future__ import annotations

import argparse
import re
import statistics
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
FIRST_STEP = re.compile(r"first local step ([\d.]+) s after its ClientApp process started(?:, ([\d.]+) CPU s)?")
MARKS = [("received", "Received successfully"), ("flwr_ready", "Start `flwr-clientapp` process"),
         ("message_in", "Runtime.ConfirmMessageReceived"), ("app_load", "Loading ClientApp"),
         ("first_step", "first local step"), ("reply", "Runtime.PushMessages"), ("sent", "Sent successfully")]
COLUMNS = [name for name, _ in MARKS] + ["age_s", "cpu_s"]


def stamp(line: str) -> float | None:
    m = STAMP.search(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def messages(log: Path) -> list[dict]:
    """One entry per message the SuperNode received: its type and the seconds of each mark."""
    out, cur = [], None
    for line in log.read_text(errors="replace").splitlines():
        t = stamp(line)
        if "Receiving:" in line and t is not None:
            cur = {"node": log.stem, "type": line.split("Receiving: ")[1].split()[0], "t0": t}
            out.append(cur)
            continue
        if cur is None or t is None:
            continue
        for name, text in MARKS:
            if text in line and name not in cur:
                cur[name] = t - cur["t0"]
                if name == "first_step" and (m := FIRST_STEP.search(line)):
                    cur["age_s"] = float(m.group(1))
                    if m.group(2):
                        cur["cpu_s"] = float(m.group(2))
                break
    return out


def rounds(run_log: Path, msgs: list[dict]) -> list[dict]:
    """Per round: seconds from the last reply on the SuperLink to the ServerApp's round line."""
    ends = [stamp(line) for line in run_log.read_text(errors="replace").splitlines()
            if re.search(r"round \d+/\d+: mean loss|results: ", line) and stamp(line)]
    sent = sorted(m["t0"] + m["sent"] for m in msgs if "sent" in m and m["type"] != "query")
    out = []
    for r, end in enumerate(ends):
        before = [s for s in sent if s <= end]
        out.append({"round": r + 1 if r < len(ends) - 1 else "final evaluation",
                    "after_last_sent": end - before[-1] if before else None})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("keep", type=Path, help="engines.py's --keep folder (or its deployment/ folder)")
    parser.add_argument("--all", action="store_true", help="every message, not only the medians")
    args = parser.parse_args()
    root = args.keep / "deployment" if (args.keep / "deployment").is_dir() else args.keep
    msgs = [m for log in sorted(root.glob("node*.log")) for m in messages(log)]
    if not msgs:
        print(f"no messages in {root}/node*.log (was the run kept, with FLWR_LOG_LEVEL=DEBUG?)")
        return 1
    print("seconds after the SuperNode's 'Receiving' (median per message type; n = messages):")
    print(f"{'type':10s} {'n':>3s} " + " ".join(f"{c:>10s}" for c in COLUMNS))
    for kind in dict.fromkeys(m["type"] for m in msgs):
        group = [m for m in msgs if m["type"] == kind]
        cells = []
        for c in COLUMNS:
            values = [m[c] for m in group if c in m]
            cells.append(f"{statistics.median(values):10.1f}" if values else f"{'-':>10s}")
        print(f"{kind:10s} {len(group):3d} " + " ".join(cells))
    if args.all:
        print()
        for m in msgs:
            print(f"{m['node']:6s} {m['type']:10s} " + " ".join(f"{m[c]:10.1f}" if c in m else f"{'-':>10s}"
                                                                for c in COLUMNS))
    if (root / "run.log").exists():
        print("\nthe ServerApp's round line, seconds after the round's last reply reached the SuperLink:")
        for r in rounds(root / "run.log", msgs):
            print(f"  {r['round']}: " + ("-" if r["after_last_sent"] is None else f"{r['after_last_sent']:.1f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
