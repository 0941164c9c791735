#!/usr/bin/env bash
# ZeRO's savings in resident memory: the peak RSS of the largest rank while
# gpt2-124m (byte vocabulary, block 256, micro-batch 1) trains 2 steps at each
# data-parallel size in DPS (default "2 4") under each ZeRO stage 0-3.
#
#   bazel build -c opt //benchmarks:zero_memory
#   bazel-bin/benchmarks/zero_memory ["2 4"]
set -euo pipefail
here="${BASH_SOURCE[0]}.runfiles/trident"
[ -d "$here" ] || here="$(cd "$(dirname "$0")/.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$here/tools/prepare_data" --output_dir="$work/data" >/dev/null
echo "| dp | ZeRO 0 | ZeRO 1 | ZeRO 2 | ZeRO 3 | ZeRO 3 / ZeRO 0 |"
echo "|---|---|---|---|---|---|"
for dp in ${1:-2 4}; do
  row="| $dp |"
  for stage in 0 1 2 3; do
    log="$work/dp$dp-zero$stage.log"
    "$here/trainer/train" --data="$work/data" --model=gpt --preset=gpt2-124m --block_size=256 --vocab_size=256 \
      --micro_batch_size=1 --global_batch_size="$dp" --nproc="$dp" --dp="$dp" --zero_stage="$stage" \
      --max_steps=2 --eval_every=0 --sample_tokens=0 --log_every=1 --enable_progress_bar=false >"$log" 2>&1 ||
      { tail -5 "$log"; exit 1; }
    peak[$stage]=$(sed -n 's/.*done:.*peak RSS \([0-9]*\) MB.*/\1/p' "$log")
    row="$row ${peak[$stage]} |"
  done
  echo "$row $(awk -v a="${peak[3]}" -v b="${peak[0]}" 'BEGIN { printf "%.2fx", a / b }') |"
done
