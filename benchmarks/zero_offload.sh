#!/usr/bin/env bash
# The cost of ZeRO's offload to disk: the same ZeRO-3 run of PRESET (default
# gpt2-124m, byte vocabulary, block BLOCK (default 256), micro-batch 1) at
# dp=2 for STEPS steps (default 10) with everything in memory, with
# --offload_optimizer=disk, with --offload_params=disk and with both, the
# files in DIR (default $TMPDIR): step time (the median of the logged steps
# after the first), peak resident memory of the largest rank, and bytes moved
# to and from disk per step. Then hybrid sharding at dp=4 (groups of 2)
# beside ZeRO-3 over all four. RUNS=offloaded runs only the run with both
# offloads (a model whose state does not fit the machine, such as
# llama-3b), after measuring DIR's sequential bandwidth (2 GiB, direct I/O).
#
#   bazel build -c opt //benchmarks:zero_offload
#   bazel-bin/benchmarks/zero_offload [PRESET] [STEPS] [DIR] [RUNS] [BLOCK]
#   bazel-bin/benchmarks/zero_offload llama-3b 5 /scratch offloaded 128
set -euo pipefail
here="${BASH_SOURCE[0]}.runfiles/trident"
[ -d "$here" ] || here="$(cd "$(dirname "$0")/.." && pwd)"
source "$here/benchmarks/train_logs.sh"
preset="${1:-gpt2-124m}"
steps="${2:-10}"
dir="${3:-${TMPDIR:-/tmp}}"
runs="${4:-all}"
block="${5:-256}"
case "$preset" in llama-*) model=llama ;; mlp-*) model=mlp ;; *) model=gpt ;; esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$here/tools/prepare_data" --output_dir="$work/data" >/dev/null
run() {  # NAME DP FLAGS...: prints "| NAME | ms/step | peak MB | offload |"
  local name="$1" dp="$2"
  shift 2
  local log="$work/$name.log"
  "$here/trainer/train" --data="$work/data" --model="$model" --preset="$preset" --block_size="$block" --vocab_size=256 \
    --micro_batch_size=1 --global_batch_size="$dp" --nproc="$dp" --dp="$dp" --zero_stage=3 --max_steps="$steps" \
    --eval_every=0 --sample_tokens=0 --log_every=1 --enable_progress_bar=false "$@" >"$log" 2>&1 ||
    { tail -5 "$log"; exit 1; }
  local ms peak offload
  ms=$(median_step_ms "$log")
  peak=$(peak_rss_mb "$log")
  offload=$(sed -n 's/.*offload files: \(.*\) per step.*/\1/p' "$log")
  echo "| $name | $ms | $peak | ${offload:--} |"
}
offload=(--offload_dir="$dir")
if [ "$runs" = offloaded ]; then
  probe="$dir/trident-bandwidth-probe.$$"
  write=$(dd if=/dev/zero of="$probe" bs=16M count=128 oflag=direct 2>&1 | sed -n 's/.*, \([0-9.]* [GM]B\/s\)$/\1/p')
  read=$(dd if="$probe" of=/dev/null bs=16M iflag=direct 2>&1 | sed -n 's/.*, \([0-9.]* [GM]B\/s\)$/\1/p')
  rm -f "$probe"
  echo "$dir sequential bandwidth (2 GiB, direct I/O): write $write, read $read"
fi
echo "| run | ms/step (median) | peak RSS MB | disk per step (rank 0) |"
echo "|---|---|---|---|"
if [ "$runs" = offloaded ]; then
  run "dp2 zero3 offload_optimizer=disk offload_params=disk" 2 --offload_optimizer=disk --offload_params=disk \
    "${offload[@]}"
  exit 0
fi
run "dp2 zero3" 2
run "dp2 zero3 offload_optimizer=disk" 2 --offload_optimizer=disk "${offload[@]}"
run "dp2 zero3 offload_params=disk" 2 --offload_params=disk "${offload[@]}"
run "dp2 zero3 both offloaded" 2 --offload_optimizer=disk --offload_params=disk "${offload[@]}"
run "dp4 zero3" 4
run "dp4 zero3 shard groups of 2" 4 --zero_shard_group_size=2
