#!/usr/bin/env bash
# What a rank holds to set up a model written in Python against the zoo's own:
# PRESET (default llama-1b, byte vocabulary, block 128, micro-batch 1) from
# the zoo and the same shape written and traced in Python
# (benchmarks/python_llama.py, saved with torch.jit.save), each trained STEPS
# steps (default 2) at dp=DP (default 4) with ZeRO-3. Prints the largest
# rank's peak resident memory at the end of setup and over the whole run,
# the median step time after the first, and the TorchScript file's size (what
# each rank held on load before the file's values were read layer by layer).
# Needs Debian's python3-torch.
#
#   bazel build -c opt //benchmarks:torchscript_setup
#   bazel-bin/benchmarks/torchscript_setup [PRESET] [DP] [STEPS] [DIR]
set -euo pipefail
here="${BASH_SOURCE[0]}.runfiles/trident"
[ -d "$here" ] || here="$(cd "$(dirname "$0")/.." && pwd)"
source "$here/benchmarks/train_logs.sh"
preset="${1:-llama-1b}"
dp="${2:-4}"
steps="${3:-2}"
dir="${4:-${TMPDIR:-/tmp}}"
work=$(mktemp -d -p "$dir")
trap 'rm -rf "$work"' EXIT
"$here/tools/prepare_data" --output_dir="$work/data" >/dev/null
/usr/bin/python3 "$here/benchmarks/python_llama.py" "$work/model.pt" "$preset" 128 256
run() {  # NAME FLAGS...: prints "| NAME | setup peak MB | run peak MB | ms/step |"
  local name="$1"
  shift
  local log="$work/$name.log"
  "$here/trainer/train" --data="$work/data" --block_size=128 --vocab_size=256 --micro_batch_size=1 \
    --global_batch_size="$dp" --nproc="$dp" --dp="$dp" --zero_stage=3 --max_steps="$steps" --eval_every=0 \
    --sample_tokens=0 --log_every=1 --enable_progress_bar=false "$@" >"$log" 2>&1 || { tail -5 "$log"; exit 1; }
  local setup peak ms
  setup=$(sed -n "s/.*setup's peak RSS \([0-9]*\) MB.*/\1/p" "$log")
  peak=$(peak_rss_mb "$log")
  ms=$(median_step_ms "$log")
  echo "| $name | $setup | $peak | $ms |"
}
echo "TorchScript file: $(($(stat -c %s "$work/model.pt") / 1048576)) MiB"
echo "| $preset, dp=$dp ZeRO-3 | setup peak RSS MB (largest rank) | run peak RSS MB | ms/step (median after the first) |"
echo "|---|---|---|---|"
run "zoo (--model=llama --preset=$preset)" --model=llama --preset="$preset"
run "Python, traced (--model=torchscript:PATH)" --model=torchscript:"$work/model.pt"
