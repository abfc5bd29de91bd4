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
# in parts over consecutive calls on the same warm machine; each call first runs `stage`, which copies
# what it carried (.gpu/, ignored by git: model parts, the model's sha256, wheels, the FLAN data) to
# STAGE outside the tree, and once every part is there assembles and checks the GGUF:
#
#   here:   split -n 2 -d MODEL.gguf .gpu/model.part-   (and .gpu/model.sha256, .gpu/whl, .gpu/flan)
#   call 1: bash docs/results/pflalign-analysis/gpu-runs.sh stage /tmp/pfl-gpu            (carry part 0 ...)
#   call 2: bash docs/results/pflalign-analysis/gpu-runs.sh stage /tmp/pfl-gpu &&
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
mode=${1:?usage: gpu-runs.sh stage|run STAGE [OUT]}; stage=${2:?usage: gpu-runs.sh stage|run STAGE [OUT]}
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf  # the embedded default's file name in the model cache

stage() {
  mkdir -p "$stage/parts" "$stage/cache/models"
  [ -d .gpu ] || { echo "no .gpu folder carried"; return 0; }
  for f in .gpu/model.part-* .gpu/model.sha256; do [ -f "$f" ] && cp "$f" "$stage/parts/"; done
  [ -d .gpu/flan ] && [ ! -d "$stage/flan" ] && cp -r .gpu/flan "$stage/flan"
  if [ -d .gpu/whl ] && [ ! -f "$stage/site.done" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$stage/site" .gpu/whl/*.whl \
      && touch "$stage/site.done"
  fi
  local model="$stage/cache/models/$gguf_name"
  if [ ! -f "$model" ] && [ -f "$stage/parts/model.sha256" ]; then
    local want have; want=$(cut -d' ' -f1 "$stage/parts/model.sha256")
    have=$(cat "$stage"/parts/model.part-* | sha256sum | cut -d' ' -f1)
    if [ "$have" = "$want" ]; then
      cat "$stage"/parts/model.part-* > "$model.part" && mv "$model.part" "$model" && echo "model assembled ($want)"
    else
      echo "model parts so far: $(ls "$stage/parts" | grep -c part-) (sha256 not yet the model's)"
    fi
  fi
  ls "$stage/parts"; ls -la "$stage/cache/models"
}

run() {
  local out=${3:?usage: gpu-runs.sh run STAGE OUT} deadline=${DEADLINE_S:-500} device=${DEVICE:-cuda}
  local extra; read -r -a extra <<<"${EXTRA:-}"
  [ -f "$stage/cache/models/$gguf_name" ] || { echo "the model is not assembled in $stage"; return 2; }
  export PFLALIGN_CACHE="$stage/cache" PYTHONPATH="$repo/src:$stage/site" PFLALIGN_ALLOCATOR=system PYTHONUNBUFFERED=1
  local pfl=(python3 -m pflalign) runs="$stage/runs" data="${DATA:-$stage/flan}" logs="$stage/logs"
  [ -n "${PY:-}" ] && pfl=("$PY" -m pflalign)
  mkdir -p "$logs" "$out"
  local t0=$SECONDS pids=() names=()
  job() {  # job NAME COMMAND...: in a process group of its own, so that the deadline stops all of it
    setsid bash -c "$2" > "$logs/$1.log" 2>&1 & pids+=($!); names+=("$1")
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
  while [ $((SECONDS - t0)) -lt "$deadline" ]; do
    local alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 5
  done
  local stopped=()
  for i in "${!pids[@]}"; do
    if kill -0 "${pids[$i]}" 2>/dev/null; then
      kill -INT -- "-${pids[$i]}" 2>/dev/null; stopped+=("${pids[$i]}")
      echo "${names[$i]}: stopped at the deadline (${deadline} s)"
    else
      wait "${pids[$i]}"; echo "${names[$i]}: exit $? after $((SECONDS - t0)) s or less"
    fi
  done
  # a run stopped by SIGINT ends its round and checkpoints; the checkpoint cannot travel back, so no waiting
  sleep 3; for p in "${stopped[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
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
  stage) stage ;;
  run) run "$@" ;;
  *) echo "usage: gpu-runs.sh stage|run STAGE [OUT]"; exit 2 ;;
esac
