#!/usr/bin/env bash
# Issue 38's grid, in the order the issue asks for, each phase a `pflalign sweep` that skips
# finished runs (here or committed: --done) and resumes an unfinished one. Run folders go to
# $RUNS (outside the work tree); each pFLAlign run (and variant) is then scored a second time
# with w^R + Delta_k by `pflalign rescore` into a sibling folder "<name>,personalized=after_aggregation"
# (or "<name>@personalized=after_aggregation"). Start it in the background at the lowest priority:
#
#   setsid nice -n 19 bash docs/results/pflalign-analysis/run-grid.sh > ~/analysis.log 2>&1 &
#   sleep 5; echo 19 > /proc/$(pgrep -f 'run-grid.sh' | head -1)/autogroup
#
# and copy finished runs into the repo with collect.sh. PHASES="val matched ..." picks phases.
# Folders: $RUNS-val (validation grid), $RUNS (matched, components, validated, validated-next), $RUNS-curves,
# $RUNS-remake, $RUNS-curves-full.
# PFL=path/to/pflalign runs another checkout's code (e.g. a worktree frozen at one commit, so
# merges into this one do not reach a running grid); CONF=folder reads the sweep files and the
# committed runs (--done) from another checkout (default: this folder), so a phase file written
# after the start is found. PY=python reads finished runs with another checkout's pflalign (its
# analysis code; the frozen code may predate it).
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
cd "$repo"
here=${CONF:-$here}
RUNS=${RUNS:-$HOME/analysis-runs}
DATA=${DATA:-$(cd "$repo/../shared/data/flan" 2>/dev/null && pwd)}
PFL=${PFL:-$repo/.venv/bin/pflalign}
PY=${PY:-$(dirname "$PFL")/python}  # reads finished runs (the seed-0 divergence test) with this checkout's pflalign
WORKERS=${WORKERS:-2}
PHASES=${PHASES:-"val matched components validated curves curves-full remake validated-next"}  # README: why this order

sweep() {  # sweep FILE OUT DONE [ARGS...] (DONE: the committed runs, passed once there are some)
  [ -f "$1" ] || { echo "skip $1 (not written yet)"; return 0; }
  local file=$1 out=$2 done=(); [ -d "$3" ] && done=(--done "$3"); shift 3
  "$PFL" sweep --config "$file" --data-dir "$DATA" --out "$out" "${done[@]}" --no-progress --workers "$WORKERS" "$@"
}

seed0_verdicts() {  # "held M" or "diverged M" per method of sweep file $1 (its seed-0 run under $2, or committed under $3)
  "$PY" - "$@" <<'PY'
import sys
from pathlib import Path
from pflalign.analysis.report import divergence, find_runs
from pflalign.sweep import plan_sweep
file, *roots = sys.argv[1:]
# planned into a folder that does not exist: only the runs' names are wanted, not plan_sweep's check
# of finished runs against this checkout's config (the grid's frozen code may write older configs)
for planned in plan_sweep(file, "/nonexistent/plan", data_dir="/nonexistent/data", seeds=[0]):
    found = [Path(root) / planned.key for root in roots if (Path(root) / planned.key / "results.json").is_file()]
    if found:
        runs, notes = find_runs(found[0])
        if not runs:  # a run that cannot be read is not taken for one that held
            sys.exit("; ".join(notes) or f"{found[0]}: no run")
    print("diverged" if found and divergence(runs[0]) else "held", planned.cfg.method)
PY
}

seed0_first() {  # seed0_first FILE: every method's seed 0, then seeds 1-2 of those whose seed 0 did not diverge
  [ -f "$1" ] || { echo "skip $1 (not written yet)"; return 0; }
  sweep "$1" "$RUNS" "$here/runs" --seeds 0
  local verdicts bad keep
  if ! verdicts=$(seed0_verdicts "$1" "$RUNS" "$here/runs"); then
    echo "the seed-0 divergence test failed (above): no seed 1-2 run of $(basename "$1") started"; return 0
  fi
  bad=$(sed -n 's/^diverged //p' <<<"$verdicts")
  keep=$(sed -n 's/^held //p' <<<"$verdicts" | paste -sd,)
  [ -n "$bad" ] && echo "seed 0 diverged, seeds 1-2 held back (README's rule: the next lr in validation order): $bad"
  [ -n "$keep" ] && sweep "$1" "$RUNS" "$here/runs" --methods "$keep"
  return 0
}

rescore_all() {  # every finished pFLAlign run (and variant) under $1, scored with w^R + Delta_k too
  for r in "$1"/flan/pflalign*/seed*; do
    [ -f "$r/results.json" ] || continue
    name=$(basename "$(dirname "$r")"); seed=$(basename "$r")
    case "$name" in *personalized=*) continue ;; esac
    case "$name" in *@*) alt="$name,personalized=after_aggregation" ;; *) alt="$name@personalized=after_aggregation" ;; esac
    out="$1/flan/$alt/$seed"; done_copy="$2/flan/$alt/$seed"
    [ -f "$out/results.json" ] || [ -f "$done_copy/results.json" ] && continue
    "$PFL" rescore "$r" --out "$out" --set method_args.personalized=after_aggregation \
      --no-progress --workers "$WORKERS" --overwrite
  done
}

for phase in $PHASES; do
  echo "== phase $phase ($(date -u +%H:%M))"
  case $phase in
    val) sweep "$here/validation.toml" "$RUNS-val" "$here/validation/runs"
         rescore_all "$RUNS-val" "$here/validation/runs" ;;
    matched|components)
         sweep "$here/$phase.toml" "$RUNS" "$here/runs"
         rescore_all "$RUNS" "$here/runs" ;;
    validated|validated-next)  # validated-next: the next lr of a method whose validated lr's seed 0 diverged
         seed0_first "$here/$phase.toml"
         rescore_all "$RUNS" "$here/runs" ;;
    curves)  # a folder of its own: its runs are Table 1's seed-0 configs (plus per-round scoring), named as its rows
         sweep "$here/curves.toml" "$RUNS-curves" "$here/curves/runs"
         rescore_all "$RUNS-curves" "$here/curves/runs" ;;
    remake)  # Table 1's pFLAlign seeds 1-2 again, to be rescored (Table 1 kept no checkpoints); named as its rows too.
         # No --done: a committed remake run keeps no adapters either, so a seed whose rescoring is not
         # committed is trained again (collect.sh keeps the committed copy; made on another CPU kind it is
         # another checkpoint, which answers.md flags) and then rescored, seed by seed, as soon as it is trained
         for s in $("$PY" -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["seeds"])' "$here/remake.toml"); do
           [ -f "$here/remake/runs/flan/pflalign@personalized=after_aggregation/seed$s/results.json" ] && continue
           sweep "$here/remake.toml" "$RUNS-remake" /nonexistent --seeds "$s"
           rescore_all "$RUNS-remake" "$here/remake/runs"
         done ;;
    curves-full)  # the curves of pFLAlign and FedAvg again, scored on the whole test split (question 4 only: no rescoring)
         sweep "$here/curves-full.toml" "$RUNS-curves-full" "$here/curves-full/runs" ;;
  esac
done
echo "== grid done ($(date -u +%H:%M))"
