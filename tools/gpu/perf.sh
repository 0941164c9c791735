#!/usr/bin/env bash
# GPU throughput runs, on a machine with a GPU and PyTorch (no tests; validate.sh
# checks correctness): builds `train` with CMake against PyTorch's CUDA LibTorch,
# trains gpt2-124m (vocabulary 50257, block 1024) on one GPU in bf16 once per line
# of PERF_RUNS ("name flag flag ..."; default below), records step PERF_PROFILE_STEP
# of the first run with --profile_step (LOGDIR/trace_<name>.json: operators and GPU
# kernels), and runs the PyTorch eager peer (benchmarks/peer/gpt_eager.py, SDPA
# attention, bf16 autocast) on the same model, batch and GPU in the same call.
# Prints median tokens/s, step time and MFU of steps 11 to PERF_STEPS (default 40).
# PERF_PEERS lists the peer's runs as batch:vocabulary (default "8:50257 16:50257
# 8:50304": the last pads the vocabulary to a multiple of 64, as nanoGPT does);
# PERF_TESTS=1 builds and runs the gpu tests first.
#
#   tools/gpu/fetch_deps.sh       # first, where Debian's archive is reachable
#   tools/gpu/perf.sh [LOGDIR]    # then on the GPU machine, from the repository root
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
logs="${1:-$root/build}"
source tools/gpu/common.sh
tests=()
[ "${PERF_TESTS:-0}" = 1 ] && tests=("${gpu_tests[@]}")
gpu_configure "$logs" && gpu_build "$logs" train prepare_data "${tests[@]}" && gpu_data || exit 1
status=0
if [ ${#tests[@]} -gt 0 ]; then
  echo "== gpu tests"
  timeout 180 ctest --test-dir build -R gpu_test --output-on-failure >"$logs/gpu_tests.log" 2>&1 || status=1
  grep -E "tests passed|Passed|Failed|\*\*\*" "$logs/gpu_tests.log"
fi
steps=${PERF_STEPS:-40}
runs=${PERF_RUNS:-"micro8
micro16 --micro_batch_size=16 --global_batch_size=16
fused_all --module_replace=fused_attention,fused_layer_norm,fused_bias_gelu,fused_cross_entropy"}
first=1
while read -r name flags; do
  [ -n "$name" ] || continue
  profile=()
  [ $first = 1 ] && profile=(--profile_step="${PERF_PROFILE_STEP:-25}" --trace_file="$logs/trace_$name.json")
  # shellcheck disable=SC2086  # flags split into arguments
  timeout 300 build/train "${profile[@]}" --data=build/data --model=gpt --preset=gpt2-124m --vocab_size=50257 \
    --block_size=1024 --device=cuda --dp=1 --precision=bf16 --micro_batch_size=8 --global_batch_size=8 \
    --max_steps="$steps" --log_every=10 --eval_every=0 --eval_steps=1 --sample_tokens=0 --lr=3e-4 \
    --metrics_file="$logs/perf_$name.jsonl" $flags >"$logs/perf_$name.log" 2>&1 ||
    { status=1; tail -20 "$logs/perf_$name.log"; continue; }
  [ $first = 1 ] && sed -n '/operators of step/,/GPU busy/p' "$logs/perf_$name.log"
  first=0
  echo "trident $name: $(gpu_median "$logs/perf_$name.jsonl")"
done <<<"$runs"
for peer in ${PERF_PEERS-8:50257 16:50257 8:50304}; do
  batch=${peer%:*} vocab=${peer#*:}
  rate=$(timeout 180 python3 benchmarks/peer/gpt_eager.py --data=build/data --device=cuda --precision=bf16 \
    --attention=sdpa --vocab="$vocab" --n_layer=12 --n_head=12 --n_embd=768 --block=1024 --batch="$batch" \
    --steps="$steps" --warmup=10 2>&1 | tail -1)
  echo "pytorch eager (sdpa attention) bf16, batch $batch, vocabulary $vocab: $rate"
done
exit $status
