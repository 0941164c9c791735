#!/usr/bin/env bash
# No #include runs back up the component order (the design's layering: each
# component may include the ones listed before it, never one listed after
# it), in sources, tests and benchmarks alike; testing/, the test harness,
# serves every test (testing/tiny_model.h is the small model the tests below
# models/ use instead of the zoo).
set -u
root="$TEST_SRCDIR/trident"
order=(base kernels topology graph partition replace tensor_parallel lora context_parallel moe pipeline
       zero amp checkpoint models data parallel zoo strategy trainer tools benchmarks)
declare -A position
for i in "${!order[@]}"; do position[${order[$i]}]=$i; done
failed=0 checked=0
while IFS= read -r file; do
  component=${file%%/*}
  [ -n "${position[$component]:-}" ] || continue
  checked=$((checked + 1))
  while IFS= read -r target; do
    [ -n "${position[$target]:-}" ] || continue
    [ "${position[$target]}" -gt "${position[$component]}" ] || continue
    echo "FAIL: $file ($component) includes $target/, which comes after $component in the component order"
    failed=1
  done < <(sed -nE 's|^#include "([a-z_]+)/.*|\1|p' "$root/$file" | sort -u)
done < <(cd "$root" && find -L . \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) \
           -not -path './external/*' | sed 's#^\./##' | sort)
[ "$checked" -gt 100 ] || { echo "FAIL: only $checked sources found under $root"; exit 1; }
[ "$failed" -eq 0 ] && echo "layering_test: $checked sources, no include runs back up the component order"
exit "$failed"
