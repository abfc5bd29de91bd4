#!/usr/bin/env bash
# Issue 38's last full-protocol runs (not the curves) on a lent GPU, side by side: FedSA-LoRA at lr
# 0.08 seed 2 (validated-next.toml) and Table 1's pFLAlign seeds 1 and 2 made again and rescored with
# w^R + Delta_k (remake.toml, as run-grid.sh's remake phase does). The same sweep files and configs as
# the CPU grid, with --set device=cuda (float32, TF32 off: the library's default on CUDA); a GPU's
# float32 differs from a CPU's in the last bits, as two CPU kinds' do (benchmarks/results/gpu.json:
# 8.7e-8 in the losses of the pinned tiny runs). Written for the tenth session (2026-11-27), which
# was lent one GPU for 15 minutes while the CPU grid ran FedAvg's curves-full run (~2 h here).
#
# The default model's GGUF (98 MB) does not fit one device call (64 MiB with the tree), so it travels
# in parts over consecutive calls on the same warm machine (../gpu-stage.sh, shared with
# table1-dolly/gpu-runs.sh); each call first runs `stage`, which copies what it carried (.gpu/,
# ignored by git: model parts, the model's sha256, wheels, the FLAN data) to STAGE outside the tree,
# and once every part is there assembles and checks the GGUF:
#
#   here:   bash docs/results/pflalign-analysis/gpu-runs.sh prepare   (.gpu/; prints each call's carry)
#   call 1: bash docs/results/pflalign-analysis/gpu-runs.sh stage /tmp/pfl-gpu     (carry part 00, ...)
#   call n: bash docs/results/pflalign-analysis/gpu-runs.sh stage /tmp/pfl-gpu &&
#           DEADLINE_S=500 bash docs/results/pflalign-analysis/gpu-runs.sh run /tmp/pfl-gpu $OUT
#
# `run` starts the three jobs at once (each is launch-bound on a 135M model, one CPU core each), stops
# whatever is unfinished at DEADLINE_S seconds, and writes every finished run's small files
# (../keep-run.sh) as runs.tar.gz to OUT, with the logs: runs/ and remake/, as under this folder.
# DEVICE=cpu and EXTRA="--set rounds=1 ..." run the same plumbing here at toy size (a check, not results).
#
# What it gave (tenth session, one H100, image torch 2.11 + transformers 5.17): FedSA-LoRA seed 2 ran the
# whole protocol in 5.7 min and scored 16.49 with empty or degenerate answers, and the two pFLAlign runs
# reached round 42 of 50 by the 530 s deadline (about 12.6 s a round, three runs sharing the GPU). Cause:
# transformers 5.0-5.17 swap the GGUF tokenizer's BOS and EOS, fixed in pflalign since (b1d4f2a;
# benchmarks/README.md, "The default model on a GPU"); nothing of that call was kept. With the fix, the
# image reproduces this CPU's short FLAN run word for word. A 10-minute call holds about two runs side by
# side with their final scoring, not three (an estimate from those paces; no run was timed alone).
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
cd "$repo"
. "$here/../gpu-stage.sh"  # gpu_prepare, gpu_stage, gpu_env, gpu_start, gpu_until
[ "${1:-}" = prepare ] && { gpu_prepare "flan=${FLAN:-$repo/../shared/data/flan}"; exit; }
mode=${1:?usage: gpu-runs.sh prepare | stage|run STAGE [OUT]}; stage=${2:?usage: gpu-runs.sh prepare | stage|run STAGE [OUT]}

run() {
  local out=${3:?usage: gpu-runs.sh run STAGE OUT} deadline=${DEADLINE_S:-500} device=${DEVICE:-cuda}
  local extra; read -r -a extra <<<"${EXTRA:-}"
  gpu_env "$stage" || return 2
  local pfl=(python3 -m pflalign) runs="$stage/runs" data="${DATA:-$stage/flan}" logs="$stage/logs"
  [ -n "${PY:-}" ] && pfl=("$PY" -m pflalign)
  mkdir -p "$logs" "$out"
  local t0=$SECONDS
  job() {  # job NAME COMMAND: in a process group of its own, so that the deadline stops all of it
    gpu_start "$logs/$1.log" bash -c "$2"
  }
  local common="--data-dir '$data' --set device=$device ${extra[*]} --no-progress"
  # one --out per job: a sweep folder is locked by the sweep that uses it
  job fedsa-lora-seed2 "${pfl[*]} sweep --config '$here/validated-next.toml' --out '$runs/runs-fedsa' --seeds 2 $common"
  for s in 1 2; do
    local r="$runs/remake-seed$s/flan/pflalign"
    job "remake-seed$s" "${pfl[*]} sweep --config '$here/remake.toml' --out '$runs/remake-seed$s' --seeds $s $common && \
      ${pfl[*]} rescore '$r/seed$s' --out '$r@personalized=after_aggregation/seed$s' \
        --set method_args.personalized=after_aggregation --no-progress --overwrite"
  done
  gpu_until "$deadline" "$t0"  # then interrupted: each run stops at its last round checkpoint
  # collect.sh's layout: $RUNS (-> runs/) and $RUNS-remake (-> remake/runs/)
  local keep="$stage/keep"; rm -rf "$keep"
  for f in "$runs"/*/flan/*/seed*/results.json; do
    [ -f "$f" ] || continue
    local d kind; d=$(dirname "$f"); case $f in "$runs"/remake-*) kind=remake ;; *) kind=runs ;; esac
    bash "$here/../keep-run.sh" "$d" "$keep/$kind/flan/$(basename "$(dirname "$d")")/$(basename "$d")" && echo "kept $d"
  done
  [ -d "$keep" ] && tar czf "$out/runs.tar.gz" -C "$keep" .
  tar czf "$out/logs.tar.gz" -C "$logs" .
  grep -h "finished in\|avg ROUGE-L\|Error\|error" "$logs"/*.log | tail -20
  echo "run: $((SECONDS - t0)) s"
}

case $mode in
  stage) gpu_stage "$stage" ;;
  run) run "$@" ;;
  *) echo "usage: gpu-runs.sh prepare | stage|run STAGE [OUT]"; exit 2 ;;
esac
