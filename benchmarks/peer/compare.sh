#!/usr/bin/env bash
# Trident's `train` against PyTorch eager Python on the same GPT (n_layer 4,
# n_head 4, n_embd 256, block 128, vocab 256), data and steps, global batch 16,
# one rank; the Python side at its best of 1 and 2 threads; the same in bf16
# (the peer under torch.autocast). Then data-parallel
# scaling: dp=2 with one thread per rank against one rank with one thread.
#
#   bazel build -c opt //benchmarks:peer_compare && bazel-bin/benchmarks/peer_compare [STEPS]
set -euo pipefail
here="${BASH_SOURCE[0]}.runfiles/trident"
[ -d "$here" ] || here="$(cd "$(dirname "$0")/../.." && pwd)"
steps="${1:-60}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python=/usr/bin/python3
"$python" -c 'import torch' 2>/dev/null || { echo "needs Debian's python3-torch (tools/setup.sh)"; exit 1; }

"$here/tools/prepare_data" --output_dir="$work/data" >/dev/null

# Median tokens/s of a metrics file, over the steps after the first 10.
median_rate() {
  "$python" -c 'import json,statistics,sys
rates=[json.loads(l)["tokens_per_s"] for l in open(sys.argv[1])][10:]
print(f"{statistics.median(rates):.1f}")' "$1"
}
cpp_rate() {  # cpp_rate NAME THREADS FLAGS...; THREADS "" keeps train's own policy
  local name=$1 threads=$2; shift 2
  local env=()
  [ -z "$threads" ] || env=(OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads")
  env "${env[@]}" "$here/trainer/train" --data="$work/data" --global_batch_size=16 \
    --max_steps="$steps" --eval_every=0 --eval_steps=1 --sample_tokens=0 --log_every=1000 \
    --enable_progress_bar=false --metrics_file="$work/$name.jsonl" "$@" >"$work/$name.out"
  median_rate "$work/$name.jsonl"
}

cpp=$(cpp_rate cpp "" --dp=1 --micro_batch_size=16)
# The peer multiplies with the OpenBLAS kernels train chose: on a CPU that
# OpenBLAS does not know, train leaves its generic fallback for its AVX-512 or
# AVX2 kernels, and the peer left on the fallback would be measured too low.
blas=$(grep -o 'OPENBLAS_CORETYPE=[A-Za-z0-9]*' "$work/cpp.out" | head -n 1 | cut -d= -f2 || true)
[ -z "$blas" ] || export OPENBLAS_CORETYPE="$blas"
py1=$("$python" "$here/benchmarks/peer/gpt_eager.py" --data="$work/data" --threads=1 --steps="$steps" | cut -d' ' -f2)
py2=$("$python" "$here/benchmarks/peer/gpt_eager.py" --data="$work/data" --threads=2 --steps="$steps" | cut -d' ' -f2)
best=$("$python" -c "print(max($py1, $py2))")
echo "peer comparison ($steps steps, gpt n_layer 4 n_embd 256 block 128, batch 16, one rank):"
[ -z "$blas" ] || echo "  both use OpenBLAS's $blas kernels (train chose them over OpenBLAS's generic fallback for this CPU)"
echo "  trident train (its default: fp32 products in oneDNN on the intra-op threads, one per core): $cpp tokens/s"
echo "  pytorch eager python:      $py1 tokens/s (1 intra-op thread), $py2 tokens/s (2; OpenBLAS pool at its default in both)"
echo "  ratio trident / best python: $("$python" -c "print(f'{$cpp / $best:.2f}x')")"

# bf16 compute: Trident's bf16 (autocast-style, fp32 master weights) against
# PyTorch eager under torch.autocast("cpu", torch.bfloat16), each at its best
# thread setting (Trident's default gives bf16 products the intra-op pool).
cpp16=$(cpp_rate cpp16 "" --dp=1 --micro_batch_size=16 --precision=bf16)
py16_1=$("$python" "$here/benchmarks/peer/gpt_eager.py" --data="$work/data" --threads=1 --steps="$steps" --precision=bf16 | cut -d' ' -f2)
py16_2=$("$python" "$here/benchmarks/peer/gpt_eager.py" --data="$work/data" --threads=2 --steps="$steps" --precision=bf16 | cut -d' ' -f2)
best16=$("$python" -c "print(max($py16_1, $py16_2))")
echo "bf16 compute:"
echo "  trident train --precision=bf16 (its default: products in oneDNN on the intra-op threads, one per core): $cpp16 tokens/s"
echo "  pytorch eager python, autocast bf16: $py16_1 tokens/s (1 thread), $py16_2 tokens/s (2 threads)"
echo "  ratio trident / best python: $("$python" -c "print(f'{$cpp16 / $best16:.2f}x')")"

one=$(cpp_rate dp1 1 --dp=1 --micro_batch_size=16)
two=$(cpp_rate dp2 1 --dp=2 --micro_batch_size=8)
echo "data-parallel scaling, one thread per rank (OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=1):"
echo "  dp=1: $one tokens/s, dp=2: $two tokens/s, speed-up $("$python" -c "print(f'{$two / $one:.2f}x')")"
