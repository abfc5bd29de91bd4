#!/usr/bin/env bash
# Issue 58's Dolly runs (table1.toml, step-size.toml) on a lent GPU: the runs not yet committed, in
# run-grid.sh's order (every row's seed 0 first, Table 1's then the step-size rows', then seed 1,
# then seed 2), RUNS_PER_CALL of them at a time in lockstep (`pflalign sweep --batch runs`: one base
# model, every client of every run in shared passes, each run its own folder, checkpoint and
# results), with --set device=cuda (float32, TF32 off: the library's default on CUDA; config.json
# records the device). The same sweep files and configs as the CPU grid; a GPU's float32 differs
# from a CPU's in the last bits (benchmarks/results/gpu.json). The model, wheels and data reach the
# machine in parts over consecutive calls on one warm machine (../gpu-stage.sh):
#
#   here:   bash docs/results/table1-dolly/gpu-runs.sh prepare       (.gpu/; prints each call's carry)
#   then, back to back (a machine stays warm about 30 s after a call), with the tree at 23 MiB:
#   call 1: run(command="bash docs/results/table1-dolly/gpu-runs.sh stage /tmp/pfl-gpu", timeout_s=120,
#               carry=[".gpu/model.part-00", ".gpu/model.sha256", ".gpu/whl", ".gpu/dolly.tar.gz"])
#   call 2: run(command="bash docs/results/table1-dolly/gpu-runs.sh stage /tmp/pfl-gpu", timeout_s=120,
#               carry=[".gpu/model.part-01"])
#   call 3: run(command="bash docs/results/table1-dolly/gpu-runs.sh stage /tmp/pfl-gpu &&
#               SKIP='fedavg/seed0' bash docs/results/table1-dolly/gpu-runs.sh run /tmp/pfl-gpu $OUT",
#               carry=[".gpu/model.part-02"], timeout_s=600)
#   here:   mkdir -p /tmp/dolly-gpu && tar xzf FILES_AT/runs.tar.gz -C /tmp/dolly-gpu &&
#           RUNS=/tmp/dolly-gpu bash docs/results/table1-dolly/collect.sh
#
# `prepare` sizes the parts to the tree that travels: 3 parts with the tree at 23 MiB (2026-11-28),
# 2 if the committed runs are out of git's index for the calls (as the tenth session did: 2.6 MB);
# make it just before the calls. Call 1's `stage` prints "imports: ok" or the import that fails
# with the image's packages (the tenth session's FLAN runs there needed the same partition code,
# so datasets and flwr-datasets; which wheels it carried is not recorded). SKIP
# leaves out runs the CPU grid is on (row/seedK, space-separated: its log's last phase and
# ~/dolly-runs say which). `run` writes every finished run's small files (../keep-run.sh) as
# OUT/runs.tar.gz, in collect.sh's layout (dolly/<row>/seed<k>/), with OUT/logs.tar.gz and
# OUT/env.txt (GPU, torch, transformers). A run interrupted at DEADLINE_S (default 540 s from the
# start of `run`) stops at its last round checkpoint in STAGE, which cannot travel back but which
# a further `run` call on the same warm machine resumes first (no carry needed). Since 2026-11-28 a
# CUDA run checkpoints every 60 s, not every round (--checkpoint-every; the clients' records kept in
# memory between, benchmarks/client_files.py): the deadline's interrupt costs a run it stops at most
# its last minute's rounds, which the resuming call trains again.
#
# RUNS_PER_CALL (default 1): how many runs one 10-minute call can finish, from the figures there
# are (none is a Dolly run on a GPU): a Dolly local step of SmolLM2-135M on an H100 is bound by
# kernel launches, 0.22 s at 4 x 1024 tokens against 0.18 s at 4 x 256 (gpu.json, smollm2-135m),
# so a Dolly round costs about a FLAN round there, not 4x: 20 steps, about 4.5 s, plus the round's
# work outside the passes (FLAN: 12.6 s a round with three runs sharing the H100, ~4.2 s each;
# pflalign-analysis/gpu-runs.sh). 50 rounds: about 4 min for one run. Runs in lockstep are
# scored in one decoding loop (run/batched_scoring.py), but their decoding work adds up: each run
# decodes its 662 test prompts twice (personalized, global; answers up to 128 tokens, 8.4 s per 64 rows x 128 new tokens on the H100, gpu.json), about
# 2-3 min, and the first Table 1 run the base model once more, about 1.5 min. One run: about 8 of
# the 9 minutes that a 600-s call leaves for runs (DEADLINE_S 540); two in lockstep: about 6 min
# of training (the shared passes stay launch-bound, the per-run work does not) and 6-7 min of
# scoring, more than a call, and the 15-minute lease (a start and two staging calls first) has no
# second full call. So 1; the log's per-round seconds ("round r/50 ... (s, K runs)") say whether a
# later lease can take 2. Since 2026-11-28 (after those estimates, untimed on a GPU) a CUDA run
# decodes up to 1024 rows at once (eval.batch_size=auto) and takes every client step's updates
# flat (params.aligned): both estimates above are then upper bounds, by several times for the scoring. PY picks the Python (default python3, the image's). The same plumbing
# here at toy size (a check, not results; a few minutes; the wheels are for the image's Python
# 3.12, so a 3.11 venv's own packages stand in for them):
#   bash docs/results/table1-dolly/gpu-runs.sh stage /tmp/pfl-toy &&
#   EXTRA="--set rounds=1 --set local_steps=1 --set data.max_train=8 --set data.max_test=2 --set eval.max_new_tokens=8 --set max_seq_len=256" \
#     PY=.venv/bin/python DEVICE=cpu RUNS_PER_CALL=2 bash docs/results/table1-dolly/gpu-runs.sh run /tmp/pfl-toy /tmp/pfl-toy-out
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
cd "$repo"
. "$here/../gpu-stage.sh"
usage="usage: gpu-runs.sh prepare | stage STAGE | run STAGE OUT"

run() {
  local stage=${1:?$usage} out=${2:?$usage} deadline=${DEADLINE_S:-540} device=${DEVICE:-cuda}
  local t0=$SECONDS per_call=${RUNS_PER_CALL:-1} extra pfl=("${PY:-python3}" -m pflalign)
  read -r -d '' -a extra <<<"${EXTRA:-}" || true  # words over any number of lines
  gpu_env "$stage" || return 2
  local data=${DATA:-$stage/dolly/databricks-dolly-15k.jsonl} runs=$stage/runs logs=$stage/logs keep=$stage/keep
  mkdir -p "$logs" "$out"
  local done=(); [ -d "$here/runs" ] && done=(--done "$here/runs")  # the committed runs, as run-grid.sh
  local common=(--data-dir "$data" "${done[@]}" --set "device=$device" "${extra[@]}")
  # what is left, in the grid's order, runs resumable here (a checkpoint from an earlier call) first
  local seed file plan key state rest resumable=() fresh=()
  for seed in ${SEEDS:-0 1 2}; do
    for file in table1 step-size; do
      plan=$("${pfl[@]}" sweep --config "$here/$file.toml" --out "$runs/$file-seed$seed" --seeds "$seed" \
               "${common[@]}" --dry-run) || { echo "$plan"; return 2; }
      while read -r key state rest; do
        case " ${SKIP:-} " in *" ${key#dolly/} "*) continue ;; esac
        case $state in
          unfinished) resumable+=("$file $seed $key") ;;
          new) fresh+=("$file $seed $key") ;;
        esac
      done <<<"$plan"
    done
  done
  local picked=("${resumable[@]}" "${fresh[@]}")
  picked=("${picked[@]:0:$per_call}")
  [ ${#picked[@]} -gt 0 ] || echo "no run left to run"
  # one sweep per (file, seed) with the picked rows' methods; the sweeps run side by side
  local group groups=() methods m
  for key in "${picked[@]}"; do group=${key% *}; case " ${groups[*]} " in *" $group "*) ;; *) groups+=("$group") ;; esac; done
  for group in "${groups[@]}"; do
    read -r file seed <<<"$group"; methods=""
    for key in "${picked[@]}"; do
      [ "${key% *}" = "$group" ] || continue
      m=${key##* }; m=${m#dolly/}; m=${m%/seed*}; m=${m%%@*}; methods=${methods:+$methods,}$m
    done
    echo "$file seed $seed: $methods"
    gpu_start "$logs/$file-seed$seed.log" "${pfl[@]}" sweep --config "$here/$file.toml" --out "$runs/$file-seed$seed" \
      --seeds "$seed" --methods "$methods" "${common[@]}" --batch runs --no-progress
  done
  gpu_until "$deadline" "$t0"
  # every finished run so far (this call's and earlier calls' on this machine), in collect.sh's layout
  local f d
  rm -rf "$keep"; mkdir -p "$keep"
  for f in "$runs"/*/dolly/*/seed*/results.json; do
    [ -f "$f" ] || continue
    d=$(dirname "$f")
    bash "$here/../keep-run.sh" "$d" "$keep/dolly/$(basename "$(dirname "$d")")/$(basename "$d")" && echo "kept $d"
  done
  [ -d "$keep/dolly" ] && tar czf "$out/runs.tar.gz" -C "$keep" dolly
  tar czf "$out/logs.tar.gz" -C "$logs" .
  { command -v nvidia-smi >/dev/null && nvidia-smi -L
    "${pfl[0]}" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  } > "$out/env.txt" 2>&1
  local name
  for name in "${gpu_names[@]}"; do  # this call's part of each log: its last rounds and how it ended
    echo "== $name"
    awk '/^== /{n = 0} {line[n++] = $0} END {for (i = 0; i < n; i++) print line[i]}' "$logs/$name.log" \
      | grep "round .*/.*runs)\|finished (\|stopped\|interrupted\|rror" | tail -6
  done
  echo "run: $((SECONDS - t0)) s"
}

case ${1:-} in
  prepare) gpu_prepare "dolly=${DOLLY:-$repo/../shared/data/dolly/databricks-dolly-15k.jsonl}" ;;
  stage) gpu_stage "${2:?$usage}" ;;
  run) run "${2:-}" "${3:-}" ;;
  *) echo "$usage"; exit 2 ;;
esac
