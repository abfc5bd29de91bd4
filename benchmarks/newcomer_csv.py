"""A CSV of one's own, as a new user would bring it: 600 Dolly rows, 150 of each of 4 categories
(instruction, context, response, category). Used by newcomer_path.sh and issue 38's short-run
advice (docs/results/pflalign-analysis/short-runs.sh).

    python benchmarks/newcomer_csv.py PATH/TO/databricks-dolly-15k.jsonl OUT.csv
"""

import csv
import json
import sys

KEEP = ("open_qa", "classification", "brainstorming", "general_qa")
PER_CATEGORY = 150


def main(dolly: str, out: str) -> None:
    rows, seen = [], dict.fromkeys(KEEP, 0)
    with open(dolly) as f:
        for r in map(json.loads, f):
            if seen.get(r["category"], PER_CATEGORY) < PER_CATEGORY:  # Dolly is sorted by category: take 150 of each
                seen[r["category"]] += 1
                rows.append(r)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["instruction", "context", "response", "category"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main(*sys.argv[1:3])
