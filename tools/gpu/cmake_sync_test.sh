#!/usr/bin/env bash
# Checks that tools/gpu/CMakeLists.txt lists exactly the .cc files of the tree.
set -u
root="$TEST_SRCDIR/trident"
cmake="$root/tools/gpu/CMakeLists.txt"
status=0
tree=$(cd "$root" && find -L . -name '*.cc' -not -path './external/*' | sed 's#^\./##' | sort)
[ -n "$tree" ] || { echo "FAIL: no sources found under $root"; exit 1; }
for f in $tree; do
  grep -q "\${ROOT}/$f\b" "$cmake" || { echo "missing from tools/gpu/CMakeLists.txt: $f"; status=1; }
done
for f in $(grep -o '\${ROOT}/[A-Za-z0-9_/.-]*\.cc' "$cmake" | sed 's#^\${ROOT}/##' | sort -u); do
  echo "$tree" | grep -qx "$f" || { echo "tools/gpu/CMakeLists.txt names a file that does not exist: $f"; status=1; }
done
[ $status -eq 0 ] && echo "cmake_sync_test: $(echo "$tree" | wc -l) sources listed"
exit $status
