#!/usr/bin/env bash
# hello_world started plainly launches 4 ranks and every group's all-reduce checks out.
set -u
out="$TEST_TMPDIR/out"
timeout 120 "$TEST_SRCDIR/trident/tools/hello_world" >"$out" 2>&1 || { cat "$out"; echo "FAIL: exit $?"; exit 1; }
cat "$out"
grep -q '^\[rank 3\] rank 3: world\[0,1,2,3\] sum=6 tp\[2,3\] sum=5 dp\[1,3\] sum=4$' "$out" || { echo "FAIL: rank 3 line"; exit 1; }
grep -q 'distributed engine OK: tensor=2 x data=2 (4 ranks) over gloo' "$out" || { echo "FAIL: summary"; exit 1; }
echo "hello_world_test: passed"
