#!/usr/bin/env bash
# tools/fault_drill.sh with 10 SIGKILL trials and the SIGTERM drill.
set -u
bin="$TEST_SRCDIR/trident"
printf 'It was the best of times, it was the worst of times.\n%.0s' $(seq 400) >"$TEST_TMPDIR/text.txt"
"$bin/tools/prepare_data" --input="$TEST_TMPDIR/text.txt" --output_dir="$TEST_TMPDIR/data" >/dev/null 2>&1 \
  || { echo "FAIL: prepare_data"; exit 1; }
exec "$bin/tools/fault_drill.sh" "$bin/trainer/train" "$bin/tools/checkpoint" "$TEST_TMPDIR/drill" 10 -- \
  --data="$TEST_TMPDIR/data" --n_layer=2 --n_embd=32 --n_head=2 --block_size=16 --global_batch_size=8 \
  --micro_batch_size=2 --log_every=1
