#!/usr/bin/env bash
# ZeRO's step time against plain data parallelism in `train`: PRESET
# (default gpt-tiny; byte vocabulary, block BLOCK (default 128), micro-batch 4)
# at dp=2 for STEPS steps (default 40), plain, ZeRO-2 and ZeRO-3, run after
# one another ROUNDS times (default 2) so a slow spell of the machine lands on
# all three. Prints each run's median step time (steps after the first) and
# the largest rank's peak resident memory, and each stage's median step time
# over the rounds against plain's.
#
#   bazel build -c opt //benchmarks:zero_step_time
#   bazel-bin/benchmarks/zero_step_time [PRESET] [STEPS] [ROUNDS] [BLOCK]
#   bazel-bin/benchmarks/zero_step_time gpt2-124m 20 2 256
set -euo pipefail
here="${BASH_SOURCE[0]}.runfiles/trident"
[ -d "$here" ] || here="$(cd "$(dirname "$0")/.." && pwd)"
source "$here/benchmarks/train_logs.sh"
preset="${1:-gpt-tiny}"
steps="${2:-40}"
rounds="${3:-2}"
block="${4:-128}"
case "$preset" in llama-*) model=llama ;; mlp-*) model=mlp ;; *) model=gpt ;; esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$here/tools/prepare_data" --output_dir="$work/data" >/dev/null
run() {  # STAGE: prints the run's median ms/step and peak MB
  local log="$work/zero$1.log"
  "$here/trainer/train" --data="$work/data" --model="$model" --preset="$preset" --block_size="$block" \
    --vocab_size=256 --micro_batch_size=4 --global_batch_size=8 --nproc=2 --dp=2 --zero_stage="$1" \
    --max_steps="$steps" --eval_every=0 --sample_tokens=0 --log_every=1 --enable_progress_bar=false >"$log" 2>&1 ||
    { tail -5 "$log" >&2; exit 1; }
  echo "$(median_step_ms "$log") $(peak_rss_mb "$log")"
}
echo "$preset, dp=2, block $block, micro-batch 4, $steps steps, $rounds rounds (ms/step, median of steps 2-$steps; peak MB)"
declare -A runs
for round in $(seq "$rounds"); do
  line="round $round:"
  for stage in 0 2 3; do
    out=$(run "$stage")
    read -r ms peak <<<"$out"
    runs[$stage]+="$ms "
    line+=" zero$stage $ms ms ${peak} MB,"
  done
  echo "${line%,}"
done
plain=$(echo "${runs[0]}" | tr ' ' '\n' | grep . | median)
for stage in 0 2 3; do
  ms=$(echo "${runs[$stage]}" | tr ' ' '\n' | grep . | median)
  echo "zero_stage=$stage: $ms ms/step, $(awk -v a="$ms" -v b="$plain" 'BEGIN { printf "%.2fx", a / b }') of plain"
done
