# Sourced by validate.sh and perf.sh on a GPU machine, from the repository root.
#   gpu_configure LOGDIR    unpacks .gpu_deps (tools/gpu/fetch_deps.sh), finds PyTorch's CUDA
#                           LibTorch and NCCL's header, configures build/ (log: LOGDIR/build.log)
#   gpu_build LOGDIR T...   builds targets T, past errors, so that one run lists every file that
#                           does not compile (LOGDIR/errors.txt); returns the build's status
prefix="$PWD/.gpu_deps/root"
keep_going=(-k 0)
# Every gpu-tagged test's CMake target: `ctest -R gpu_test` runs them all, so build them all.
gpu_tests=(amp_amp_gpu_test parallel_parallel_gpu_test kernels_aligned_linear_gpu_test base_host_copy_gpu_test
  kernels_cross_entropy_gpu_test kernels_layer_norm_gpu_test topology_process_group_gpu_test)

gpu_configure() {
  local logs=$1
  mkdir -p "$logs" build
  if ls .gpu_deps/*.deb >/dev/null 2>&1; then
    mkdir -p "$prefix"
    for deb in .gpu_deps/*.deb; do dpkg -x "$deb" "$prefix"; done
    export PATH="$prefix/usr/bin:$PATH"
    export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  fi
  local torch_dir
  torch_dir=$(python3 -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))') ||
    { echo "gpu: no PyTorch with CMake files found"; return 1; }
  nvidia-smi -L || { echo "gpu: no GPU visible"; return 1; }
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  # NCCL's header comes with the nvidia-nccl wheel beside PyTorch.
  local nccl_header
  nccl_header=$(find /usr/include /usr/local/cuda/include \
    "$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null)" -name nccl.h 2>/dev/null | head -1)
  echo "nccl.h: ${nccl_header:-not found}"
  local generator=()
  if command -v ninja >/dev/null; then generator=(-G Ninja); else keep_going=(-k); fi
  echo "== configure (LibTorch from $torch_dir)"
  cmake -S tools/gpu -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir" \
    -DCMAKE_PREFIX_PATH="$prefix/usr" -DProtobuf_PROTOC_EXECUTABLE="$prefix/usr/bin/protoc" \
    -DNCCL_INCLUDE_DIR="$(dirname "${nccl_header:-/nonexistent/nccl.h}")" >"$logs/build.log" 2>&1 ||
    { tail -60 "$logs/build.log"; return 1; }
}

gpu_build() {
  local logs=$1 start=$SECONDS status
  shift
  cmake --build build -j"$(nproc)" --target "$@" -- "${keep_going[@]}" >>"$logs/build.log" 2>&1
  status=$?
  grep -E 'error:|undefined reference' "$logs/build.log" | sort -u >"$logs/errors.txt"
  echo "build of $*: exit $status after $((SECONDS - start)) s, $(wc -l <"$logs/errors.txt") distinct error lines"
  [ $status -eq 0 ] || head -80 "$logs/errors.txt"
  return $status
}

# A byte corpus (the machine's licence texts) prepared in build/data.
gpu_data() {
  [ -d build/data ] && return 0
  find /usr/share/doc -name copyright | head -400 | xargs cat >build/text.txt 2>/dev/null
  build/prepare_data --input=build/text.txt --output_dir=build/data >/dev/null
}

# Median tokens/s (and MFU, and step ms) of a metrics file after its first 10 steps.
gpu_median() {
  python3 -c 'import json,statistics,sys
rows=[json.loads(l) for l in open(sys.argv[1])][10:]
med=lambda k: statistics.median(r[k] for r in rows)
print("%.0f tokens/s" % med("tokens_per_s"), "step %.1f ms" % med("step_time_ms"),
      *("mfu %.1f%%" % (100 * med("mfu")),) if rows and "mfu" in rows[0] else ())' "$1"
}
