#!/usr/bin/env bash
# tools/determinism_drill.sh, 4 runs each, where gradient reductions meet
# recomputation and tied weights: gpt's tied embedding and head with every
# layer recomputed at dp=2 (before the recomputation kept backward one pass,
# run 2 differed from run 1 here every time), and ZeRO-3 with one layer
# recomputed at dp=4.
set -u
bin="$TEST_SRCDIR/trident"
printf 'It was the best of times, it was the worst of times.\n%.0s' $(seq 400) >"$TEST_TMPDIR/text.txt"
"$bin/tools/prepare_data" --input="$TEST_TMPDIR/text.txt" --output_dir="$TEST_TMPDIR/data" >/dev/null 2>&1 \
  || { echo "FAIL: prepare_data"; exit 1; }
common=(--data="$TEST_TMPDIR/data" --n_layer=4 --n_embd=64 --n_head=4 --block_size=32 --global_batch_size=8
        --max_steps=12 --sample_tokens=0 --eval_every=0)
drill="$bin/tools/determinism_drill.sh"
"$drill" "$bin/trainer/train" "$TEST_TMPDIR/tied" 4 -- "${common[@]}" --dp=2 --micro_batch_size=4 \
  --activation_checkpointing=full || exit 1
"$drill" "$bin/trainer/train" "$TEST_TMPDIR/zero3" 4 -- "${common[@]}" --dp=4 --micro_batch_size=2 --zero_stage=3 \
  --activation_checkpointing=selected --checkpoint_layers=transformer.h.1 || exit 1
