#!/usr/bin/env bash
# Determinism drill: trains the same multi-rank job RUNS times while every
# core is kept busy by other processes (so ranks and backward threads
# interleave differently each time) and requires every run's losses and
# exported weights to equal the first run's bit for bit. A race between
# backward and a gradient reduction (a bucket reduced before its last
# gradient arrived) shows here as run-to-run differences.
#
#   tools/determinism_drill.sh TRAIN WORK_DIR [RUNS] -- TRAIN_FLAGS...
set -u
train=$1 work=$2 runs=${3:-5}
shift 3
[ "${1:-}" = "--" ] && shift
mkdir -p "$work"
fail() { echo "FAIL: $*"; [ -f "$work/out" ] && tail -30 "$work/out"; exit 1; }

load=()
for _ in $(seq "$(nproc)"); do
  (while :; do :; done) &
  load+=($!)
done
trap 'kill "${load[@]}" 2>/dev/null' EXIT

# The losses of a metrics file, one per line, as written.
losses() { sed -E 's/.*"loss": ([^,]+),.*/\1/' "$1"; }

for run in $(seq "$runs"); do
  timeout 600 "$train" "$@" --metrics_file="$work/run$run.jsonl" --export_safetensors="$work/run$run.safetensors" \
    >"$work/out" 2>&1 || fail "run $run: train exited $?"
  [ "$run" -eq 1 ] && continue
  diff <(losses "$work/run1.jsonl") <(losses "$work/run$run.jsonl") >"$work/diff" ||
    { cat "$work/diff"; fail "run $run: the losses differ from run 1's"; }
  cmp -s "$work/run1.safetensors" "$work/run$run.safetensors" ||
    fail "run $run: the exported weights differ from run 1's"
  echo "run $run: losses and weights equal run 1's bit for bit"
done
echo "determinism drill passed: $runs runs under load ($(nproc) busy loops), $(wc -l <"$work/run1.jsonl") steps each"
