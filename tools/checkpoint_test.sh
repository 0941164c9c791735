#!/usr/bin/env bash
# tools/checkpoint on a real checkpoint: a dp=2 x pp=2 run saves (deduped);
# inspect lists slices, verify passes and then names a corrupted file; merge
# makes a one-process checkpoint that a tp=2 run resumes; export writes the
# weights by name.
set -u
bin="$TEST_SRCDIR/trident"
train="$bin/trainer/train"
tool="$bin/tools/checkpoint"
out="$TEST_TMPDIR/out"
fail() { echo "FAIL: $*"; echo "--- output:"; cat "$out"; exit 1; }

printf 'It was the best of times, it was the worst of times.\n%.0s' $(seq 400) >"$TEST_TMPDIR/text.txt"
"$bin/tools/prepare_data" --input="$TEST_TMPDIR/text.txt" --output_dir="$TEST_TMPDIR/data" >"$out" 2>&1 \
  || fail "prepare_data"
small=(--data="$TEST_TMPDIR/data" --n_layer=2 --n_embd=32 --n_head=2 --block_size=16 --sample_tokens=0
       --eval_every=0 --global_batch_size=8 --micro_batch_size=2 --max_steps=4)
saves="$TEST_TMPDIR/saves"
timeout 120 "$train" "${small[@]}" --dp=2 --pp=2 --save_dir="$saves" --save_type=deduped >"$out" 2>&1 \
  || fail "training dp=2 x pp=2"
step="$saves/step_4"

timeout 30 "$tool" inspect "$step" >"$out" 2>&1 || fail "inspect"
grep -q "step 4, layout dp2_tp1_pp2x1_zero0 on 4 ranks" "$out" || fail "inspect: step and layout"
grep -Eq "^transformer.h.1.attn.c_attn.weight +\[96, 32\] +Float" "$out" || fail "inspect: a weight"
grep -q "^optimizer/transformer.wte.weight/exp_avg " "$out" || fail "inspect: optimizer state"
grep -q "^config:" "$out" || fail "inspect: config"

timeout 30 "$tool" verify "$step" >"$out" 2>&1 || fail "verify"
grep -q "files match the manifest" "$out" || fail "verify: message"

merged="$TEST_TMPDIR/merged"
timeout 30 "$tool" merge "$step" "$merged" >"$out" 2>&1 || fail "merge"
[ -f "$merged/step_4/model.safetensors" ] && [ -f "$merged/step_4/state.safetensors" ] || fail "merge: files"
timeout 30 "$tool" verify "$merged/step_4" >"$out" 2>&1 || fail "verify merged"

# The merged checkpoint resumes in another layout for the remaining steps.
timeout 120 "$train" "${small[@]}" --dp=1 --tp=2 --max_steps=6 --resume_from="$merged/step_4" >"$out" 2>&1 \
  || fail "resume merged at tp=2"
grep -q "resumed from $merged/step_4 at step 4 (saved as " "$out" || fail "resume: message"
grep -q "resharded to dp1_tp2_pp1x1_zero0" "$out" || fail "resume: resharded"

timeout 30 "$tool" export "$step" "$TEST_TMPDIR/weights.safetensors" >"$out" 2>&1 || fail "export"
grep -q "exported .* weights" "$out" || fail "export: message"

# A flipped byte is named.
printf '\x7f' | dd of="$step/rank_3.safetensors" bs=1 seek=100 conv=notrunc status=none
timeout 30 "$tool" verify "$step" >"$out" 2>&1 && fail "verify accepted a corrupt file"
grep -q "rank_3.safetensors is corrupt" "$out" || fail "verify: names the file"
timeout 30 "$tool" frobnicate "$step" >"$out" 2>&1 && fail "accepted an unknown command"
grep -q "usage: checkpoint inspect" "$out" || fail "usage"
echo PASS
