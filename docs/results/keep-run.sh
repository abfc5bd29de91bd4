#!/usr/bin/env bash
# keep-run.sh RUN_DIR DEST: a finished run's small files, as docs/results keeps them, into DEST:
# config.json and results.json as they are, metrics.jsonl and predictions.jsonl gzipped (about a
# sixth of the size: the committed runs' JSON lines were 52 of the tree's 62 MB, near the 64 MiB that
# a lent GPU machine takes in one call). `pflalign report`, `pflalign.api.load_run` and the analysis
# scripts read the .gz copies as they read a run folder (checkpoint.stored). No checkpoint, no
# adapters. results.json goes last, so a copy cut short is one that collect scripts take again. RUN_DIR
# may itself be such a copy (its JSON lines already gzipped): they are copied as they are.
set -eu
src=${1:?usage: keep-run.sh RUN_DIR DEST}; dst=${2:?usage: keep-run.sh RUN_DIR DEST}
[ -f "$src/results.json" ] || { echo "keep-run.sh: $src holds no finished run (no results.json)" >&2; exit 2; }
mkdir -p "$dst"
for f in metrics.jsonl predictions.jsonl; do
  if [ -f "$src/$f" ]; then
    gzip -9 -n -c "$src/$f" > "$dst/$f.gz.part" && mv "$dst/$f.gz.part" "$dst/$f.gz"
  elif [ -f "$src/$f.gz" ]; then  # a copy kept by this script already (a GPU call's runs.tar.gz)
    cp "$src/$f.gz" "$dst/$f.gz.part" && mv "$dst/$f.gz.part" "$dst/$f.gz"
  fi
done
cp "$src/config.json" "$dst/"
cp "$src/results.json" "$dst/results.json.part" && mv "$dst/results.json.part" "$dst/results.json"
