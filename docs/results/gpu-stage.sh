# gpu-stage.sh: what the docs/results/*/gpu-runs.sh scripts share, sourced by them (not run): the
# default model, the wheels and the data brought to a lent GPU machine, and the jobs run there under
# a deadline. A device call takes the working tree and what it carries, 64 MiB in all; the default
# model's GGUF (98 MB) does not fit one, so it travels in parts over consecutive calls on the same
# warm machine (a machine stays warm about 30 s after a call: make the calls back to back).
#
# gpu_prepare NAME=PATH...  here, from the repository root: fills .gpu/ (ignored by git) with
#     whl/ (what the GPU image lacks, at the venv's versions: gguf for the GGUF, datasets and
#     flwr-datasets with dill and multiprocess for the natural partition of the paper's federations,
#     and the ROUGE-L of benchmarks/gpu_wheels.sh), each data file or folder PATH as NAME.tar.gz,
#     the GGUF in parts sized so that each call fits with the tree (the first call also carries the
#     wheels and the data), and the GGUF's sha256; prints each call's carry list.
# gpu_stage STAGE  there, first in every call: copies what the call carried to STAGE outside the
#     tree (model parts, wheels installed into STAGE/site, data unpacked into STAGE/NAME); once
#     every part is there, assembles the GGUF into STAGE/cache/models and checks its sha256.
# gpu_env STAGE  there: the environment the runs need (PFLALIGN_CACHE=STAGE/cache, PYTHONPATH
#     with src/ and STAGE/site, the system allocator); refuses if the model is not assembled.
# gpu_start LOG CMD...  starts CMD in a process group of its own, with SIGINT's default action (a
#     background job of a script otherwise ignores it), its output added to LOG; gpu_until DEADLINE_S T0
#     waits until every started job ended or DEADLINE_S seconds after T0 passed, then interrupts
#     the rest (a run in lockstep then stops at its last checkpoint) and kills what is left after
#     GRACE_S (20) seconds.

gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf  # the embedded default's file name in the model cache
call_limit=$((64 * 1024 * 1024))  # a device call: the working tree plus what it carries

gpu_prepare() {
  git check-ignore -q .gpu/x || { echo "gpu_prepare: .gpu/ is not ignored by git (.gitignore)"; return 2; }
  local model=${MODEL:-${PFLALIGN_CACHE:-$HOME/.cache/pflalign}/models/$gguf_name}
  [ -f "$model" ] || { echo "gpu_prepare: no $model (pflalign fetch-model smollm2-135m)"; return 2; }
  mkdir -p .gpu
  if [ ! -d .gpu/whl ]; then
    local tmp; tmp=$(mktemp -d)
    local py=${PYTHON:-$PWD/.venv/bin/python} pins  # the venv's Python (pip, PyPI) and its versions
    pins=$("$py" -c 'import importlib.metadata as m; print(" ".join(f"{p}=={m.version(p)}" for p in
      ("gguf", "datasets", "flwr-datasets", "dill", "multiprocess")))') || return 2
    # shellcheck disable=SC2086 # $pins: one word per package
    (cd "$tmp" && PYTHON=$py sh "$OLDPWD/benchmarks/gpu_wheels.sh" >/dev/null \
      && "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
           --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
           -d .whl $pins) || { rm -rf "$tmp"; return 2; }
    mv "$tmp/.whl" .gpu/whl && rm -rf "$tmp"
  fi
  local pair name path
  for pair in "$@"; do
    name=${pair%%=*}; path=${pair#*=}
    if [ -d "$path" ]; then tar czf ".gpu/$name.tar.gz" -C "$path" .
    elif [ -f "$path" ]; then tar czf ".gpu/$name.tar.gz" -C "$(dirname "$path")" "$(basename "$path")"
    else echo "gpu_prepare: no data at $path"; return 2
    fi
  done
  # the tree that travels: tracked and untracked-but-not-ignored files
  local tree extras part n
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
  extras=$(du -cb .gpu/whl .gpu/*.tar.gz 2>/dev/null | tail -1 | cut -f1)
  part=$((call_limit - tree - extras - 1024 * 1024))  # 1 MiB to spare
  [ "$part" -gt $((4 * 1024 * 1024)) ] || { echo "gpu_prepare: the tree ($tree B) leaves no room for the model"; return 2; }
  rm -f .gpu/model.part-*
  split -b "$part" -d "$model" .gpu/model.part-
  sha256sum "$model" > .gpu/model.sha256
  n=$(ls .gpu/model.part-* | wc -l)
  echo "tree $((tree / 1024 / 1024)) MiB, wheels and data $((extras / 1024)) KiB: the model in $n parts of at most $((part / 1024 / 1024)) MiB"
  local i=0 f carry
  for f in .gpu/model.part-*; do
    carry="\"$f\""
    [ $i = 0 ] && carry="$carry, \".gpu/model.sha256\", \".gpu/whl\"$(for t in .gpu/*.tar.gz; do [ -f "$t" ] && printf ', "%s"' "$t"; done)"
    i=$((i + 1)); echo "call $i of $n carries: [$carry]"
  done
}

gpu_stage() {
  local stage=$1
  mkdir -p "$stage/parts" "$stage/cache/models"
  [ -d .gpu ] || { echo "no .gpu folder carried"; return 0; }
  local f name
  for f in .gpu/model.part-* .gpu/model.sha256; do [ -f "$f" ] && cp "$f" "$stage/parts/"; done
  for f in .gpu/*.tar.gz; do  # data: NAME.tar.gz -> STAGE/NAME/
    [ -f "$f" ] || continue
    name=$(basename "$f" .tar.gz)
    [ -d "$stage/$name" ] || { mkdir -p "$stage/$name.part" && tar xzf "$f" -C "$stage/$name.part" && mv "$stage/$name.part" "$stage/$name"; }
  done
  for f in .gpu/*/; do  # data carried as a plain folder (.gpu/flan)
    name=$(basename "$f"); [ "$name" = whl ] || [ -d "$stage/$name" ] || cp -r "$f" "$stage/$name"
  done
  if [ -d .gpu/whl ] && [ ! -f "$stage/site.done" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$stage/site" .gpu/whl/*.whl \
      && touch "$stage/site.done"
  fi
  [ -f "$stage/site.done" ] && PYTHONPATH="$stage/site" "${PY:-python3}" -c \
    'import gguf, rouge_score.rouge_scorer, flwr_datasets.partitioner; print("imports: ok")' 2>&1 | tail -1
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

gpu_env() {
  local stage=$1
  [ -f "$stage/cache/models/$gguf_name" ] || { echo "the model is not assembled in $stage"; return 2; }
  export PFLALIGN_CACHE="$stage/cache" PYTHONPATH="$repo/src:$stage/site${PYTHONPATH:+:$PYTHONPATH}"
  export PFLALIGN_ALLOCATOR=system PYTHONUNBUFFERED=1
}

gpu_pids=() gpu_names=()
gpu_start() {  # gpu_start LOG CMD...: LOG's name (without .log) names the job; a later call's lines follow
  local log=$1 dfl=(); shift
  echo "== $(date -u +%FT%TZ): $*" >> "$log"
  # a script started in the background ignores SIGINT, and what it starts inherits that: the job
  # gets it back (else the deadline's interrupt never reaches Python as a KeyboardInterrupt)
  env --default-signal=INT true 2>/dev/null && dfl=(env --default-signal=INT)
  set -m; "${dfl[@]}" "$@" >> "$log" 2>&1 & gpu_pids+=($!); gpu_names+=("$(basename "$log" .log)"); set +m
}

gpu_until() {  # gpu_until DEADLINE_S T0 (T0: $SECONDS when the deadline's clock started)
  local deadline=$1 t0=$2 i alive stopped=()
  while [ $((SECONDS - t0)) -lt "$deadline" ]; do
    alive=0; for i in "${gpu_pids[@]}"; do kill -0 "$i" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 5
  done
  for i in "${!gpu_pids[@]}"; do
    if kill -0 "${gpu_pids[$i]}" 2>/dev/null; then
      kill -INT -- "-${gpu_pids[$i]}" 2>/dev/null; stopped+=("$i")
      echo "${gpu_names[$i]}: interrupted at the deadline ($deadline s)"
    else
      wait "${gpu_pids[$i]}"; echo "${gpu_names[$i]}: exit $? after $((SECONDS - t0)) s or less"
    fi
  done
  local t1=$SECONDS
  for i in "${stopped[@]}"; do
    while kill -0 "${gpu_pids[$i]}" 2>/dev/null && [ $((SECONDS - t1)) -lt "${GRACE_S:-20}" ]; do sleep 1; done
    if kill -0 "${gpu_pids[$i]}" 2>/dev/null; then
      kill -KILL -- "-${gpu_pids[$i]}" 2>/dev/null; echo "${gpu_names[$i]}: killed ${GRACE_S:-20} s after the interrupt"
    else
      wait "${gpu_pids[$i]}"; echo "${gpu_names[$i]}: exit $? after the interrupt"
    fi
  done
}
