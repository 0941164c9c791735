#!/usr/bin/env bash
# The automatic strategy under a memory limit: gpt2-124m on WORLD ranks
# (default 2). First plain data parallelism, to measure what it needs (peak
# resident memory per rank); then --strategy=auto with a limit of LIMIT_MB
# (default: 80% of that peak), which must choose a layout that fits, train, and
# stay under the limit; then a limit nothing fits, which must fail with one
# error naming the smallest requirement found.
#
#   bazel build -c opt //benchmarks:strategy_memory_limit
#   bazel-bin/benchmarks/strategy_memory_limit [WORLD] [LIMIT_MB]
set -euo pipefail
here="${BASH_SOURCE[0]}.runfiles/trident"
[ -d "$here" ] || here="$(cd "$(dirname "$0")/.." && pwd)"
world="${1:-2}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$here/tools/prepare_data" --output_dir="$work/data" >/dev/null
common=(--data="$work/data" --model=gpt --preset=gpt2-124m --block_size=256 --global_batch_size=$((2 * world))
        --max_steps=3 --eval_every=0 --eval_steps=1 --sample_tokens=0 --log_every=1 --enable_progress_bar=false
        --nproc="$world" --profile_cache_dir="$work/profiles")
peak_mb() { sed -n 's/.*done:.*peak RSS \([0-9]*\) MB.*/\1/p' "$1"; }

"$here/trainer/train" "${common[@]}" --dp="$world" --micro_batch_size=2 >"$work/dp.log" 2>&1 ||
  { tail -5 "$work/dp.log"; exit 1; }
plain=$(peak_mb "$work/dp.log")
limit="${2:-$((plain * 8 / 10))}"
echo "gpt2-124m, world size $world, block 256, global batch $((2 * world)):"
echo "  plain data parallelism: peak resident $plain MB per rank"

status=0
if "$here/trainer/train" "${common[@]}" --strategy=auto --memory_limit_mb="$limit" >"$work/auto.log" 2>&1; then
  peak=$(peak_mb "$work/auto.log")
  echo "  --strategy=auto --memory_limit_mb=$limit: chose $(grep '<- chosen' "$work/auto.log" | sed 's/^\[rank 0\] //')"
  echo "    $(grep 'candidates modelled' "$work/auto.log" | sed 's/^\[rank 0\] //')"
  echo "    trained; peak resident $peak MB per rank ($( [ "$peak" -le "$limit" ] && echo "under" || echo "OVER") the limit)"
  [ "$peak" -le "$limit" ] || status=1
else
  echo "  --strategy=auto --memory_limit_mb=$limit failed:"; grep -m3 'error' "$work/auto.log"; status=1
fi

if "$here/trainer/train" "${common[@]}" --strategy=auto --memory_limit_mb=64 >"$work/none.log" 2>&1; then
  echo "  --memory_limit_mb=64 trained: expected an error"; status=1
else
  echo "  --memory_limit_mb=64: $(grep -m1 'error' "$work/none.log" | sed 's/^\[rank [0-9]*\] //')"
fi
exit $status
