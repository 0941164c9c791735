#!/usr/bin/env bash
# Downloads the Debian packages the CMake build needs that a GPU machine may
# lack (Abseil, protobuf, GoogleTest, gflags, glog, Google Benchmark) into
# .gpu_deps/ (ignored by git), for tools/gpu/validate.sh to unpack there:
# the GPU machine reaches no package registry. Run on a machine with Debian's
# archive (the development machine).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$root/.gpu_deps"
cd "$root/.gpu_deps"
packages=(libabsl-dev libabsl20220623 libprotobuf-dev libprotobuf32 libprotoc32 protobuf-compiler
          libgtest-dev libgmock-dev libgflags-dev libgflags2.2 libgoogle-glog-dev libgoogle-glog0v6
          libbenchmark-dev libbenchmark1debian libunwind8 zlib1g-dev)
apt-get download "${packages[@]}" >/dev/null
ls "$root/.gpu_deps"
