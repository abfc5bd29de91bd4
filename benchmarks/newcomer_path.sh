#!/usr/bin/env bash
# The path a new user takes with data of their own, timed step by step (issue 42):
# a CSV -> 8 Dirichlet clients -> a short run -> export -> AutoPeftModelForCausalLM -> generate.
# Run from the root of a fresh clone (it runs `make setup` itself), with a Dolly jsonl to cut
# the CSV from:
#     bash benchmarks/newcomer_path.sh ../shared/data/dolly/databricks-dolly-15k.jsonl
# Writes its files under $WORK (default runs/newcomer) and the times to $WORK/times.txt.
set -eu
DOLLY=${1:?usage: benchmarks/newcomer_path.sh PATH/TO/databricks-dolly-15k.jsonl}
WORK=${WORK:-runs/newcomer}
ROUNDS=${ROUNDS:-3}
mkdir -p "$WORK"
: > "$WORK/times.txt"
step() {  # step NAME COMMAND...: run it, note its wall time
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  "$@"
  awk -v n="$name" -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%-10s %7.1f s\n", n, b - a }' | tee -a "$WORK/times.txt"
}

step setup make setup
# A CSV of one's own: 600 Dolly rows, 150 of each of 4 categories (instruction, context, response, category).
step csv .venv/bin/python benchmarks/newcomer_csv.py "$DOLLY" "$WORK/mine.csv"
step run .venv/bin/pflalign run --set data.name=files --data-dir "$WORK/mine.csv" \
    --set data.columns.context=context --set data.partition=dirichlet --set data.partition_by=category \
    --set data.num_clients=8 --set data.alpha=1.0 --set data.max_test=8 --set rounds="$ROUNDS" \
    --set method=fedavg --workers 2 --out "$WORK/run" --overwrite
rm -rf "$WORK/export"
step export .venv/bin/pflalign export "$WORK/run" --out "$WORK/export"
client=$(ls "$WORK/export" | grep -v '^global$' | head -1)
step autopeft .venv/bin/python - "$WORK/export/$client" <<'EOF'
import sys
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer
model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1])
tok = AutoTokenizer.from_pretrained(model.peft_config["default"].base_model_name_or_path)
ids = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                              add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=32, do_sample=False)
print("AutoPeft:", tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
EOF
step generate .venv/bin/pflalign generate "$WORK/export/$client" --max-new-tokens 32 "Name three rivers in Europe."
cat "$WORK/times.txt"
