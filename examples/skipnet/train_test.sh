#!/usr/bin/env bash
# SkipNet trains end to end both ways: through the C++ API program and
# through Trident's `train` linked with SkipNet's registrations (the model,
# dataset and loss named in skipnet.pbtxt), with dp, pp and ZeRO.
set -u
dir="$TEST_SRCDIR/trident_examples/skipnet"
out="$TEST_TMPDIR/out"
fail() { echo "FAIL: $*"; echo "--- output:"; tail -40 "$out"; exit 1; }

timeout 300 "$dir/train_skipnet" --dp=2 --pp=2 --zero_stage=1 --steps=40 >"$out" 2>&1 ||
  fail "train_skipnet exited $?"
grep -aq '^\[rank 0\] step 40/40 | loss ' "$out" || fail "train_skipnet step line"
grep -aq '^\[rank 0\] validation loss ' "$out" || fail "train_skipnet validation"

timeout 300 "$dir/train" --config="$dir/skipnet.pbtxt" --dp=2 --zero_stage=2 --max_steps=40 >"$out" 2>&1 ||
  fail "train --config=skipnet.pbtxt exited $?"
grep -aq '^\[rank 0\] step 40/40 | loss ' "$out" || fail "train step line"
grep -aq 'model skipnet' "$out" || fail "the registered model"
first=$(grep -a '^\[rank 0\] step 10/40' "$out" | sed 's/.*| loss \([0-9.]*\).*/\1/')
last=$(grep -a '^\[rank 0\] step 40/40' "$out" | sed 's/.*| loss \([0-9.]*\).*/\1/')
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || fail "loss did not fall: $first -> $last"
timeout 300 "$dir/train" --config="$dir/skipnet.pbtxt" --dp=1 --pp=2 --schedule=zb_h1 --max_steps=10 \
  >"$out" 2>&1 || fail "train --pp=2 exited $?"
grep -aq '^\[rank 0\] step 10/10 | loss ' "$out" || fail "train pp=2 step line"
echo "train_test: all checks passed"
