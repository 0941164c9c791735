#!/usr/bin/env bash
# Checks that tools/gpu/CMakeLists.txt lists exactly the .cc and .proto files of the tree.
set -u
root="$TEST_SRCDIR/trident"
cmake="$root/tools/gpu/CMakeLists.txt"
tree=$(cd "$root" && find -L . \( -name '*.cc' -o -name '*.proto' \) -not -path './external/*' \
  | sed 's#^\./##' | sort -u)
[ -n "$tree" ] || { echo "FAIL: no sources found under $root"; exit 1; }
listed=$( { grep -oE '\$\{ROOT\}/[A-Za-z0-9_/.-]+\.(cc|proto)' "$cmake" | sed 's#^\${ROOT}/##'
            grep -oE '^trident_proto\([A-Za-z0-9_]+ [A-Za-z0-9_/.-]+\.proto' "$cmake" | cut -d' ' -f2
          } | sort -u)
missing=$(comm -23 <(echo "$tree") <(echo "$listed"))
stale=$(comm -13 <(echo "$tree") <(echo "$listed"))
[ -z "$missing" ] || echo "missing from tools/gpu/CMakeLists.txt:"$'\n'"$missing"
[ -z "$stale" ] || echo "tools/gpu/CMakeLists.txt names files that do not exist:"$'\n'"$stale"
[ -z "$missing$stale" ] || exit 1
echo "cmake_sync_test: $(echo "$tree" | wc -l) sources listed"
