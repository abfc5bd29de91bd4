#!/usr/bin/env bash
# Issue 58's grid: Table 1 on Dolly (table1.toml, 33 runs) and the step-size rows (step-size.toml,
# 6 runs), in this order: every row's seed 0 first (Table 1's, then the step-size rows'), then
# seed 1, then seed 2, so that each stop of the grid leaves whole seeds. Each phase is a
# `pflalign sweep` that skips finished runs (here or committed: --done) and resumes an
# unfinished one from its last checkpoint. Run folders go to $RUNS, outside the work tree.
# Start it in the background at the lowest priority:
#
#   LANES=2 setsid nice -n 19 bash docs/results/table1-dolly/run-grid.sh > ~/dolly.log 2>&1 &
#   sleep 5; for p in $(pgrep -f 'table1-dolly/run-grid.sh'); do echo 19 > /proc/$p/autogroup; done
#
# and copy finished runs into the repo with collect.sh. PFL=path/to/pflalign runs another
# checkout's code (a worktree frozen at one commit, so that merges into this one do not reach a
# running grid); CONF=folder reads the sweep files and the committed runs from another checkout.
#
# METHODS="a b ..." (LANES=1 only): only these rows, in this order (cheapest first on a machine that
# lasts one session: a Dolly run takes about 2 h of both cores with --workers 2, FedSAM about twice
# that, and an unfinished run is lost with the machine).
# FILES="step-size table1": within each seed, the step-size rows before Table 1's (default
# "table1 step-size"); a file not named is skipped.
#
# LANES=N (default 1: one sweep with WORKERS processes): N lanes side by side, each a process of
# one thread (--workers 1, OMP_NUM_THREADS=1) that takes the next run in the order above which no
# other lane has taken, one run at a time. Why: one sweep's 2 workers wait for a round's slowest
# client (Dolly's 4 clients are unequal: classification ~15 s a round, the others 50-150 s), so a
# round took 6-10% longer than half its clients' summed time in the first three runs, and their
# final scoring 5-21% longer; two lanes keep both cores busy through whole runs. The results are a
# one-thread run's either way, bit for bit (tests/test_workers.py). Lane 0 writes to $RUNS, lane i
# to $RUNS/lane$i; each skips the runs the others finished (--done), and a lane's claim on a run
# is $RUNS/claims/<run key> holding the lane's number (an unfinished run belongs to the lane whose
# folder holds it). The grid's last run trains alone in one thread; LANES=1 resumes only the runs
# in $RUNS itself (one unfinished in $RUNS/lane1 would start again there), so keep LANES=2 while
# $RUNS/lane1 holds an unfinished run.
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
FILES=${FILES:-"table1 step-size"}
LANES=${LANES:-1}
done=(); [ -d "$here/runs" ] && done=(--done "$here/runs")  # the committed runs, once there are some

if [ "$LANES" -le 1 ]; then
  for seed in $SEEDS; do
    for file in $FILES; do
      echo "== $file seed $seed ($(date -u +%H:%M))"
      for m in ${METHODS:-all}; do  # METHODS: these of the file's rows, one sweep each, in this order
        pick=()
        if [ "$m" != all ]; then grep -q "\"$m\"" "$here/$file.toml" || continue; pick=(--methods "$m"); fi
        "$PFL" sweep --config "$here/$file.toml" --data-dir "$DATA" --out "$RUNS" "${done[@]}" \
          --seeds "$seed" "${pick[@]}" --no-progress --workers "$WORKERS"
      done
    done
  done
  echo "== grid done ($(date -u +%H:%M))"
  exit 0
fi

lane_out() { if [ "$1" -eq 0 ]; then echo "$RUNS"; else echo "$RUNS/lane$1"; fi; }

claim() {  # claim LANE KEY: true if the run KEY is lane LANE's (claimed now, or before)
  local dir="$RUNS/claims/${2//\//_}"
  if mkdir "$dir" 2>/dev/null; then echo "$1" > "$dir/lane"; return 0; fi
  [ "$(cat "$dir/lane" 2>/dev/null)" = "$1" ]
}

lane() {  # lane I: the next run no other lane has, until none is left
  local i=$1 out j seed file plan key state rest picked last="" m
  out=$(lane_out "$i")
  local skip=("${done[@]}")
  for ((j = 0; j < LANES; j++)); do [ "$j" -eq "$i" ] || skip+=(--done "$(lane_out "$j")"); done
  while :; do
    picked=""
    for seed in $SEEDS; do
      for file in $FILES; do
        plan=$("$PFL" sweep --config "$here/$file.toml" --data-dir "$DATA" --out "$out" "${skip[@]}" \
                 --seeds "$seed" --dry-run) || { echo "== lane $i: $plan"; return 2; }
        while read -r key state rest; do
          case $state in unfinished|new) claim "$i" "$key" && { picked="$file $seed $key"; break 3; } ;; esac
        done <<<"$plan"
      done
    done
    [ -n "$picked" ] || { echo "== lane $i: no run left ($(date -u +%H:%M))"; return 0; }
    [ "$picked" != "$last" ] || { echo "== lane $i: $picked is still not finished; the lane stops"; return 1; }
    last=$picked
    read -r file seed key <<<"$picked"
    m=${key#*/}; m=${m%%/*}; m=${m%%@*}  # dolly/pflalign@lr=0.33/seed0 -> pflalign
    echo "== lane $i: $key ($file seed $seed, $(date -u +%H:%M))"
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PFL" sweep --config "$here/$file.toml" --data-dir "$DATA" --out "$out" \
      "${skip[@]}" --seeds "$seed" --methods "$m" --no-progress --workers 1 \
      || { echo "== lane $i: sweep exited $?; the lane stops"; return 1; }
  done
}

mkdir -p "$RUNS/claims"
for ((i = 0; i < LANES; i++)); do  # each lane's folder, and its claim on the unfinished runs in it
  out=$(lane_out "$i"); mkdir -p "$out"
  for d in "$out"/dolly/*/seed*; do
    [ -d "$d" ] && [ ! -f "$d/results.json" ] && { claim "$i" "${d#"$out"/}" || echo "== $d: claimed by another lane"; }
  done
done
for ((i = 0; i < LANES; i++)); do
  lane "$i" 2>&1 | sed -u "s/^/[lane $i] /" &
done
wait
echo "== grid done ($(date -u +%H:%M))"
