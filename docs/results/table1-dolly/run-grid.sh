#!/usr/bin/env bash
# Issue 58's grid: Table 1 on Dolly (table1.toml, 33 runs) and the step-size rows (step-size.toml,
# 6 runs), in this order: every row's seed 0 first (Table 1's, then the step-size rows'), then
# seed 1, then seed 2, so that each stop of the grid leaves whole seeds. Each phase is a
# `pflalign sweep` that skips finished runs (here or committed: --done) and resumes an
# unfinished one from its last checkpoint. Run folders go to $RUNS, outside the work tree.
# Start it in the background at the lowest priority:
#
#   setsid nice -n 19 bash docs/results/table1-dolly/run-grid.sh > ~/dolly.log 2>&1 &
#   sleep 5; echo 19 > /proc/$(pgrep -f 'table1-dolly/run-grid.sh' | head -1)/autogroup
#
# and copy finished runs into the repo with collect.sh. PFL=path/to/pflalign runs another
# checkout's code (a worktree frozen at one commit, so that merges into this one do not reach a
# running grid); CONF=folder reads the sweep files and the committed runs from another checkout.
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
cd "$repo"
here=${CONF:-$here}
RUNS=${RUNS:-$HOME/dolly-runs}
DATA=${DATA:-$(cd "$repo/../shared/data/dolly" 2>/dev/null && pwd)/databricks-dolly-15k.jsonl}
PFL=${PFL:-$repo/.venv/bin/pflalign}
WORKERS=${WORKERS:-2}
SEEDS=${SEEDS:-"0 1 2"}

for seed in $SEEDS; do
  for file in table1 step-size; do
    echo "== $file seed $seed ($(date -u +%H:%M))"
    done=(); [ -d "$here/runs" ] && done=(--done "$here/runs")  # the committed runs, once there are some
    "$PFL" sweep --config "$here/$file.toml" --data-dir "$DATA" --out "$RUNS" "${done[@]}" \
      --seeds "$seed" --no-progress --workers "$WORKERS"
  done
done
echo "== grid done ($(date -u +%H:%M))"
