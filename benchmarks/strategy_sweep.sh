#!/usr/bin/env bash
# train --strategy=auto against an exhaustive sweep of hand layouts, all
# measured in one run on the same data: dp, tp, pp with 1f1b and zb_h1,
# dp x tp, dp x pp, tp x pp, and data parallelism with ZeRO 1-3. Prints each
# layout's steady tokens/s (median of the steps after the first 10), the
# automatic run's (search excluded) and its ratio to the best hand layout, and
# the search time with a cold and with a warm profile cache.
#
#   bazel build -c opt //benchmarks:strategy_sweep
#   bazel-bin/benchmarks/strategy_sweep [MODEL PRESET WORLD STEPS]   # default: gpt gpt-tiny 2 40
#   bazel-bin/benchmarks/strategy_sweep llama llama-tiny 4 40
set -euo pipefail
here="${BASH_SOURCE[0]}.runfiles/trident"
[ -d "$here" ] || here="$(cd "$(dirname "$0")/.." && pwd)"
model="${1:-gpt}" preset="${2:-gpt-tiny}" world="${3:-2}" steps="${4:-40}"
global=16
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$here/tools/prepare_data" --output_dir="$work/data" >/dev/null

median_rate() {
  python3 -c 'import json,statistics,sys
rates=[json.loads(l)["tokens_per_s"] for l in open(sys.argv[1])][10:]
print(f"{statistics.median(rates):.0f}")' "$1"
}
run() {  # run NAME FLAGS...: trains and prints the steady tokens/s
  local name=$1; shift
  "$here/trainer/train" --data="$work/data" --model="$model" --preset="$preset" --global_batch_size=$global \
    --max_steps="$steps" --eval_every=0 --eval_steps=1 --sample_tokens=0 --log_every=1000 \
    --enable_progress_bar=false --metrics_file="$work/$name.jsonl" "$@" >"$work/$name.log" 2>&1 ||
    { echo "$name failed:" >&2; tail -5 "$work/$name.log" >&2; return 1; }
  median_rate "$work/$name.jsonl"
}

# The hand layouts for this world size: "name|flags".
layouts=("dp$world|--dp=$world --tp=1 --pp=1 --micro_batch_size=$((global / world))")
for zero in 1 2 3; do
  layouts+=("dp$world zero$zero|--dp=$world --tp=1 --pp=1 --zero_stage=$zero --micro_batch_size=$((global / world))")
done
layouts+=("tp$world|--dp=1 --tp=$world --pp=1 --micro_batch_size=$global")
for schedule in 1f1b zb_h1; do
  layouts+=("pp$world $schedule|--dp=1 --tp=1 --pp=$world --schedule=$schedule --micro_batch_size=$((global / (2 * world)))")
done
if [ "$world" -ge 4 ]; then
  half=$((world / 2))
  layouts+=("dp$half x tp2|--dp=$half --tp=2 --pp=1 --micro_batch_size=$((global / half))")
  for schedule in 1f1b zb_h1; do
    layouts+=("dp$half x pp2 $schedule|--dp=$half --tp=1 --pp=2 --schedule=$schedule --micro_batch_size=$((global / half / 4))")
    layouts+=("tp$half x pp2 $schedule|--dp=1 --tp=$half --pp=2 --schedule=$schedule --micro_batch_size=$((global / 4))")
  done
fi

echo "strategy sweep: $model $preset, world size $world, global batch $global, $steps steps each"
best=0 best_name="" n=0
for entry in "${layouts[@]}"; do
  name=${entry%%|*} flags=${entry#*|}
  n=$((n + 1))
  # shellcheck disable=SC2086
  rate=$(run "hand$n" --nproc="$world" $flags) || rate=0
  printf '  %-24s %8s tokens/s\n' "$name" "$rate"
  if [ "${rate%.*}" -gt "${best%.*}" ]; then best=$rate best_name=$name; fi
done

search_line() { grep -E 'candidates modelled' "$work/$1.log" | sed 's/^\[rank 0\] //'; }
# The candidates dry-run (predicted and measured ms), the chosen one marked.
dry_runs() { grep -E '^\[rank 0\] [0-9]+ .*[0-9]+\.[0-9]+ +[0-9]+\.[0-9]+ +[0-9]+\.[0-9]+' "$work/$1.log" | sed 's/^\[rank 0\] /    /'; }
cache="$work/profiles"
auto=$(run auto_cold --nproc="$world" --strategy=auto --profile_cache_dir="$cache")
echo "  auto (cold profile cache): $auto tokens/s; $(search_line auto_cold)"
dry_runs auto_cold
warm=$(run auto_warm --nproc="$world" --strategy=auto --profile_cache_dir="$cache")
echo "  auto (warm profile cache): $warm tokens/s; $(search_line auto_warm)"
dry_runs auto_warm
echo "best hand layout: $best_name at $best tokens/s"
python3 -c "import sys; a, w, b = map(float, sys.argv[1:]); print(f'auto / best hand: {a / b:.2f}x (cold run), {w / b:.2f}x (warm run)')" \
  "$auto" "$warm" "$best"
