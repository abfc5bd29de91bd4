#!/usr/bin/env bash
# Every finished run of the Dolly grid ($RUNS, default ~/dolly-runs, and its lanes' $RUNS/lane*, run-grid.sh)
# not yet committed: its small files into runs/ (docs/results/keep-run.sh), then the report regenerated and the count said.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
RUNS=${RUNS:-$HOME/dolly-runs}
PFL=${PFL:-$repo/.venv/bin/pflalign}
for r in "$RUNS"/dolly/*/seed*/results.json "$RUNS"/lane*/dolly/*/seed*/results.json; do
  [ -f "$r" ] || continue
  d=$(dirname "$r"); t="$here/runs/dolly/$(basename "$(dirname "$d")")/$(basename "$d")"
  [ -e "$t/results.json" ] || bash "$repo/docs/results/keep-run.sh" "$d" "$t"
done
n=$(find "$here/runs" -name results.json 2>/dev/null | wc -l)
echo "runs committed: $n of 39"
paired=()  # the rows that have a finished run (report refuses --paired of a row without one)
for m in pflalign fedavg "pflalign@lr=0.33" "fedavg@lr=0.16"; do
  ls "$here"/runs/dolly/"$m"/seed*/results.json >/dev/null 2>&1 && paired+=(--paired "$m")
done
rel=${here#"$repo"/}  # the report names its folder relative to the repository, as FLAN's does
[ "$n" -gt 0 ] && (cd "$repo" && "$PFL" report "$rel/runs" --out "$rel" "${paired[@]}" --claims)
# the paper's table beside ours (the paper's table1.csv lives beside the project, not in it)
PAPER=${PAPER:-$repo/../shared/paper/table1.csv}
if [ "$n" -gt 0 ] && [ -f "$PAPER" ]; then
  python3 "$repo/docs/results/beside-paper.py" "$PAPER" "$here/dolly/table.csv" dolly > "$here/beside-paper.md.tmp" \
    && mv "$here/beside-paper.md.tmp" "$here/beside-paper.md"
elif [ "$n" -gt 0 ]; then
  echo "no $PAPER: beside-paper.md left as it is"
fi
exit 0
