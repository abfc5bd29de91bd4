#!/usr/bin/env bash
# Issue 38, section 5: the short-run advice runs (short-runs.toml), then their report into
# short-runs/. Run from the repository root; the CSV and the run folders go to $RUNS-short.
#     bash docs/results/pflalign-analysis/short-runs.sh ../shared/data/dolly/databricks-dolly-15k.jsonl
set -eu
DOLLY=${1:?usage: short-runs.sh PATH/TO/databricks-dolly-15k.jsonl}
here=docs/results/pflalign-analysis
RUNS=${RUNS:-$HOME/analysis-runs}
PFL=${PFL:-.venv/bin/pflalign}
mkdir -p "$RUNS-short"
.venv/bin/python benchmarks/newcomer_csv.py "$DOLLY" "$RUNS-short/mine.csv"
"$PFL" sweep --config "$here/short-runs.toml" --data-dir "$RUNS-short/mine.csv" --out "$RUNS-short" \
  --no-progress --workers "${WORKERS:-2}"
# the small files of each finished run, then the report
for r in "$RUNS-short"/dolly-csv/*/seed*/results.json; do
  d=$(dirname "$r"); t="$here/short-runs/runs/dolly-csv/$(basename "$(dirname "$d")")/$(basename "$d")"
  bash docs/results/keep-run.sh "$d" "$t"  # the small files, the JSON lines gzipped
done
"$PFL" report "$here/short-runs/runs" --out "$here/short-runs" >/dev/null && echo "report: $here/short-runs"
