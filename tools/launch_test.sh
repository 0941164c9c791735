#!/usr/bin/env bash
# End-to-end checks of the launch binary: environment, output prefixes, failure
# propagation within seconds, elastic restart and bad-usage errors.
set -u
launch="$TEST_SRCDIR/trident/tools/launch"
rank="$TEST_SRCDIR/trident/topology/launcher_test_rank"
out="$TEST_TMPDIR/out"
fail() { echo "FAIL: $*"; echo "--- output:"; cat "$out"; exit 1; }

"$launch" --nproc_per_node=2 -- "$rank" print >"$out" 2>&1 || fail "print run exited $?"
grep -q '^\[rank 1\] rank=1 world=2 local=1 local_world=2 addr=127.0.0.1' "$out" || fail "rank 1 env"
grep -q '^\[rank 0\] stderr line of rank 0' "$out" || fail "stderr prefix"

start=$(date +%s)
timeout 30 "$launch" --nproc_per_node=3 --failure_grace_s=0.5 -- "$rank" fail 1 3 >"$out" 2>&1
code=$?
elapsed=$(( $(date +%s) - start ))
[ "$code" -eq 1 ] || fail "failing rank: launch exited $code, want 1"
[ "$elapsed" -lt 10 ] || fail "failing rank took ${elapsed}s to propagate"
grep -q 'launch: error: rank 1 exited with code 3; stopped rank(s) 0, 2' "$out" || fail "failure line"

"$launch" --nproc_per_node=2 --max_restarts=1 --failure_grace_s=0.2 -- "$rank" fail_first_attempt \
  >"$out" 2>&1 || fail "restart run exited $?"
grep -q 'restarting the local group (restart 1 of 1)' "$out" || fail "restart note"
grep -q '^\[rank 1\] attempt 1 ok' "$out" || fail "restarted rank output"

"$launch" --nproc_per_node=2 >"$out" 2>&1 && fail "no program accepted"
grep -q "no program to launch; pass it after '--'" "$out" || fail "no-program message"

echo "launch_test: all checks passed"
