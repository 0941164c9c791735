#!/usr/bin/env bash
# GPU validation, on a machine with a GPU and PyTorch (no Bazel): builds
# Trident with CMake against PyTorch's CUDA LibTorch, runs the gpu tests
# (amp_gpu_test, parallel_gpu_test: CUDA against CPU, NCCL), then trains
# gpt2-124m for 50 steps on one GPU in fp32 and in bf16 and prints the
# tokens/s and MFU lines.
#
#   tools/gpu/fetch_deps.sh        # first, where Debian's archive is reachable
#   tools/gpu/validate.sh          # then on the GPU machine, from the repository root
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
prefix="$root/.gpu_deps/root"
if ls .gpu_deps/*.deb >/dev/null 2>&1; then
  mkdir -p "$prefix"
  for deb in .gpu_deps/*.deb; do dpkg -x "$deb" "$prefix"; done
  export PATH="$prefix/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
torch_dir=$(python3 -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))') ||
  { echo "validate: no PyTorch with CMake files found"; exit 1; }
nvidia-smi -L || { echo "validate: no GPU visible"; exit 1; }
echo "== configure and build (LibTorch from $torch_dir)"
cmake -S tools/gpu -B build -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir" \
  -DCMAKE_PREFIX_PATH="$prefix/usr" -DProtobuf_PROTOC_EXECUTABLE="$prefix/usr/bin/protoc" >build.log 2>&1 ||
  { tail -40 build.log; exit 1; }
cmake --build build -j"$(nproc)" --target train prepare_data amp_amp_gpu_test parallel_parallel_gpu_test \
  >>build.log 2>&1 || { grep -m 20 -B2 -A8 'error' build.log; exit 1; }
echo "== gpu tests"
status=0
ctest --test-dir build -R 'gpu_test' --output-on-failure || status=1
echo "== 50 steps of gpt2-124m on one GPU"
find /usr/share/doc -name copyright | head -400 | xargs cat >build/text.txt 2>/dev/null
build/prepare_data --input=build/text.txt --output_dir=build/data >/dev/null || exit 1
for precision in fp32 bf16; do
  echo "-- precision=$precision"
  timeout 240 build/train --data=build/data --model=gpt --preset=gpt2-124m --block_size=1024 --device=cuda \
    --dp=1 --precision="$precision" --micro_batch_size=8 --global_batch_size=8 --max_steps=50 --log_every=10 \
    --eval_every=0 --eval_steps=1 --sample_tokens=0 --lr=3e-4 2>&1 | grep -E 'step [0-9]+/50|error|model gpt' ||
    status=1
done
exit $status
