#!/usr/bin/env bash
# What checkpoints cost, with gpt2-124m (85M parameters on the byte corpus;
# with Adam's two moments 1 GB of state per replica):
#  1. saving at steps 10 and 20 of 30 on WORLD ranks (default 2, dp=WORLD,
#     sharded), with --async_save and without, and not at all: a run's time
#     lost to saving is its elapsed time from step 1 to step 29 minus 28 times
#     its median step time (pauses between steps plus steps slowed down by a
#     background write; the run without saves shows what is left of noise);
#  2. loading the step-20 checkpoint into 4 ranks laid out dp=2 x pp=2
#     (resharded): the time to check the checksums and read rank 0's slices.
#
#   bazel build -c opt //benchmarks:checkpoint_benchmark
#   bazel-bin/benchmarks/checkpoint_benchmark [WORLD]
set -euo pipefail
here="${BASH_SOURCE[0]}.runfiles/trident"
[ -d "$here" ] || here="$(cd "$(dirname "$0")/.." && pwd)"
world="${1:-2}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$here/tools/prepare_data" --output_dir="$work/data" >/dev/null
common=(--data="$work/data" --model=gpt --preset=gpt2-124m --block_size=128 --micro_batch_size=1
        --global_batch_size="$world" --max_steps=30 --eval_every=0 --eval_steps=1 --sample_tokens=0 --log_every=10
        --enable_progress_bar=false --nproc="$world" --dp="$world")
# Seconds lost to saving in a metrics file (see above).
lost() {
  local rows median
  rows=$(sed -E 's/.*"step": ([0-9]+),.*"step_time_ms": ([0-9.e+-]+), "elapsed_s": ([0-9.e+-]+),.*/\1 \2 \3/' "$1")
  median=$(awk '$1 >= 2 && $1 <= 29 { print $2 }' <<<"$rows" | sort -g |
    awk '{ t[NR] = $1 } END { print (t[int((NR + 1) / 2)] + t[int(NR / 2) + 1]) / 2000 }')
  awk -v m="$median" '$1 == 1 { first = $3 } $1 == 29 { last = $3 } END { printf "%.2f", last - first - 28 * m }' <<<"$rows"
}
run() {  # name, flags...
  local name=$1
  shift
  "$here/trainer/train" "${common[@]}" --metrics_file="$work/$name.jsonl" "$@" >"$work/$name.log" 2>&1 ||
    { tail -5 "$work/$name.log"; exit 1; }
  lost "$work/$name.jsonl"
}

none=$(run none)
async=$(run async --save_every=10 --save_dir="$work/async" --async_save=true)
sync=$(run sync --save_every=10 --save_dir="$work/sync" --async_save=false)
echo "gpt2-124m, $world rank(s) (dp=$world, sharded), saving at steps 10 and 20 of 30:"
grep -h "saved checkpoint .*step_[12]0 " "$work/async.log" "$work/sync.log" | sed 's/^\[rank 0\]/ /'
awk -v n="$none" -v a="$async" -v s="$sync" 'BEGIN {
  printf "  seconds lost per save: synchronous %.2f, asynchronous %.2f (%.0f%% of the synchronous); %.2f s in the run without saves\n",
         s / 2, a / 2, 100 * a / s, n }'

"$here/trainer/train" "${common[@]}" --nproc=4 --dp=2 --pp=2 --global_batch_size=2 --max_steps=21 \
  --resume_from="$work/sync/step_20" >"$work/load.log" 2>&1 || { tail -5 "$work/load.log"; exit 1; }
echo "  resharded load into 4 ranks (dp=2 x pp=2):"
grep -o "resumed from .*" "$work/load.log" | sed 's/^/    /'
