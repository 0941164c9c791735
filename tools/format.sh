#!/usr/bin/env bash
# Formats the C++ and CUDA sources git tracks with .clang-format (Debian's
# clang-format). `tools/format.sh --check` changes nothing: it lists the files
# that are not formatted and fails when there are any (.ci/run runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "format.sh: clang-format is missing (apt-get install clang-format)"; exit 1; }
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu')
if [ "${1:-}" = "--check" ]; then
  unformatted=()
  for f in "${files[@]}"; do
    clang-format --style=file "$f" | cmp -s - "$f" || unformatted+=("$f")
  done
  if [ ${#unformatted[@]} -gt 0 ]; then
    echo "not formatted (run tools/format.sh): ${unformatted[*]}"
    exit 1
  fi
else
  clang-format --style=file -i "${files[@]}"
fi
