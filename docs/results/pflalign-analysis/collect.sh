#!/usr/bin/env bash
# Copy every finished run's small files (no checkpoint, no adapters) from the grid's run folders
# into the repo, then regenerate both reports. Safe to run at any time: a run is copied once.
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
cd "$repo"
RUNS=${RUNS:-$HOME/analysis-runs}
PFL=${PFL:-$repo/.venv/bin/pflalign}
copy() {  # copy SRC_ROOT DST_ROOT
  for r in "$1"/flan/*/seed*/results.json; do
    [ -f "$r" ] || continue
    d=$(dirname "$r"); t="$2/flan/$(basename "$(dirname "$d")")/$(basename "$d")"
    [ -e "$t/results.json" ] && continue
    mkdir -p "$t" && cp "$d"/{config.json,results.json,metrics.jsonl,predictions.jsonl} "$t"/ && echo "copied $t"
  done
}
copy "$RUNS-val" "$here/validation/runs"
copy "$RUNS" "$here/runs"
rel=${here#"$repo"/}  # relative paths: the committed report names no machine's folders
"$PFL" report "$rel/validation/runs" --out "$rel/validation" >/dev/null && echo "report: $rel/validation"
if ls "$here"/runs/flan/*/seed*/results.json >/dev/null 2>&1; then
  "$PFL" report "$rel/runs" --out "$rel" >/dev/null && echo "report: $rel"  # paired against pFLAlign where it ran
fi
