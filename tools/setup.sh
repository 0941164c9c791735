#!/usr/bin/env bash
# Installs the Debian packages that Trident's build, tests and benchmarks need.
# Idempotent: installs nothing when every package is already present.
set -euo pipefail

packages=(
  bazel-bootstrap          # Bazel 4.2.3, WORKSPACE mode (offline shims live in third_party/)
  g++                      # C++17 compiler
  libtorch-dev             # LibTorch 1.13.1 (CPU, c10d + Gloo)
  libgloo-dev              # Gloo headers that c10d's ProcessGroupGloo.hpp includes
  libopenblas0-pthread     # optimized BLAS: without it LibTorch matmuls run ~30x slower
  libabsl-dev              # absl::Status / StatusOr / strings
  libgoogle-glog-dev       # logging underneath c10's LOG/CHECK
  libgflags-dev            # command-line flags in binaries
  libprotobuf-dev          # runtime for plans, configs and manifests
  protobuf-compiler        # protoc, run by genrules
  libgtest-dev             # GoogleTest
  libgmock-dev             # GoogleMock matchers
  libbenchmark-dev         # Google Benchmark
  zlib1g-dev               # CRC-32 of checkpoint files
  fortunes                 # default training corpus (real English text)
  fortunes-min
  python3-torch            # the PyTorch eager peer in benchmarks/peer (same LibTorch build)
  clang-format             # tools/format.sh (.clang-format; .ci/run checks the tree is formatted)
)

# On a machine with a GPU, `bazel test` builds with CUDA and runs the `gpu`-tagged
# tests too (--config=cuda, see .bazelrc and bazel/cuda.bzl).
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo 'build --config=cuda' >"$repo_root/gpu.bazelrc"
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "setup.sh: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
