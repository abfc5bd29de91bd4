#!/usr/bin/env bash
# Every finished run of the Dolly grid ($RUNS, default ~/dolly-runs) not yet committed: its small
# files into runs/ (docs/results/keep-run.sh), then the report regenerated and the count said.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
RUNS=${RUNS:-$HOME/dolly-runs}
PFL=${PFL:-$repo/.venv/bin/pflalign}
for r in "$RUNS"/dolly/*/seed*/results.json; do
  [ -f "$r" ] || continue
  d=$(dirname "$r"); t="$here/runs/dolly/$(basename "$(dirname "$d")")/$(basename "$d")"
  [ -e "$t/results.json" ] || bash "$repo/docs/results/keep-run.sh" "$d" "$t"
done
n=$(find "$here/runs" -name results.json 2>/dev/null | wc -l)
echo "runs committed: $n of 39"
[ "$n" -gt 0 ] && "$PFL" report "$here/runs" --out "$here" --paired pflalign --paired fedavg --paired "pflalign@lr=0.33" --paired "fedavg@lr=0.16" --claims
exit 0
