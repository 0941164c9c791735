#!/usr/bin/env bash
# train started as srun starts it, without --ntasks-per-node: two ranks with
# Slurm's variables only (SLURM_TASKS_PER_NODE and SLURM_STEP_TASKS_PER_NODE,
# no SLURM_NTASKS_PER_NODE). Both know they share the node, so each takes half
# of the CPUs this process may use (rank 0 took them all before), and they train.
# (A real srun needs a Slurm cluster: issue 45's launcher tests.)
set -u
bin="$TEST_SRCDIR/trident"
out="$TEST_TMPDIR/out"
fail() { echo "FAIL: $*"; for r in 0 1; do echo "--- rank $r:"; cat "$out.$r"; done; exit 1; }

printf 'It was the best of times, it was the worst of times.\n%.0s' $(seq 400) >"$TEST_TMPDIR/text.txt"
"$bin/tools/prepare_data" --input="$TEST_TMPDIR/text.txt" --output_dir="$TEST_TMPDIR/data" >"$out.0" 2>&1 ||
  fail "prepare_data"
port=$((20000 + RANDOM % 20000))
for rank in 0 1; do
  env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS SLURM_PROCID=$rank SLURM_NTASKS=2 SLURM_LOCALID=$rank \
    SLURM_NODEID=0 SLURM_TASKS_PER_NODE=2 SLURM_STEP_TASKS_PER_NODE=2 SLURM_JOB_NODELIST=localhost \
    MASTER_PORT=$port timeout 120 "$bin/trainer/train" --data="$TEST_TMPDIR/data" --n_layer=1 --n_embd=32 \
    --n_head=2 --block_size=16 --max_steps=2 --eval_steps=1 --sample_tokens=0 >"$out.$rank" 2>&1 &
  pids[$rank]=$!
done
for rank in 0 1; do wait "${pids[$rank]}" || fail "rank $rank exited $?"; done
grep -aq '^step 2/2 | loss ' "$out.0" || fail "step line"
share=$(($(nproc) / 2))
[ "$share" -ge 1 ] || share=1
grep -aq "2 rank(s).* | $share thread(s) per rank" "$out.0" ||
  fail "want $share thread(s) per rank (of $(nproc) CPUs over 2 ranks)"
echo "slurm_env_test: both ranks share the node's $(nproc) CPUs ($share thread(s) each) and train"
