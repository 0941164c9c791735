#!/usr/bin/env bash
# Fault drill: trains a dp=2 x pp=2 job with --max_restarts=3 --save_every=5
# and SIGKILLs a random rank at a random moment, TRIALS times; every trial
# must finish (exit 0, no hang) with weights equal to an uninterrupted run's
# (1e-5). Then SIGTERM mid-run must save and exit 0, and resuming finishes
# with the same weights.
#
#   tools/fault_drill.sh TRAIN CHECKPOINT_TOOL WORK_DIR [TRIALS] -- TRAIN_FLAGS...
set -u
train=$1 tool=$2 work=$3 trials=${4:-10}
shift 4
[ "${1:-}" = "--" ] && shift
flags=("$@" --dp=2 --pp=2 --max_steps=20 --sample_tokens=0 --eval_every=0)
mkdir -p "$work"
fail() { echo "FAIL: $*"; [ -f "$work/out" ] && tail -30 "$work/out"; exit 1; }

timeout 300 "$train" "${flags[@]}" --export_safetensors="$work/reference.safetensors" >"$work/out" 2>&1 \
  || fail "the uninterrupted run"

# The rank processes of the job started as `timeout ... train` with pid $1
# (train is the launcher, its children the ranks).
ranks() { for launcher in $(pgrep -P "$1"); do pgrep -P "$launcher"; done; }

for trial in $(seq "$trials"); do
  rm -rf "$work/saves"
  timeout 300 "$train" "${flags[@]}" --max_restarts=3 --save_every=5 --save_dir="$work/saves" \
    --export_safetensors="$work/trial.safetensors" >"$work/out" 2>&1 &
  job=$!
  # A random rank, once rank 0 logged a random step (1 to 18).
  at=$((1 + RANDOM % 18))
  for _ in $(seq 600); do grep -q "step $at/20" "$work/out" 2>/dev/null && break; sleep 0.05; done
  victims=($(ranks "$job"))
  if [ "${#victims[@]}" -gt 0 ]; then
    victim=${victims[$((RANDOM % ${#victims[@]}))]}
    kill -KILL "$victim" 2>/dev/null && echo "trial $trial: killed rank process $victim after step $at"
  fi
  wait "$job" || fail "trial $trial: the job did not finish (exit $?)"
  grep -q "restarting the local group" "$work/out" && grep -o "restarting the local group (restart [0-9]* of 3)" "$work/out"
  "$tool" compare "$work/reference.safetensors" "$work/trial.safetensors" 1e-5 >"$work/compare" 2>&1 \
    || { cat "$work/compare"; fail "trial $trial: weights differ"; }
  echo "trial $trial: finished; $(cat "$work/compare")"
done

# Preemption: SIGTERM to the job saves a checkpoint and exits 0; resuming finishes the run.
rm -rf "$work/saves"
timeout 300 "$train" "${flags[@]}" --save_dir="$work/saves" >"$work/out" 2>&1 &
job=$!
for _ in $(seq 100); do grep -q "step 2/" "$work/out" 2>/dev/null && break; sleep 0.2; done
kill -TERM $(pgrep -P "$job")  # to train itself (as a scheduler would), not to the timeout wrapper
wait "$job" || fail "SIGTERM: the job exited $?"
grep -q "preempted (SIGTERM) after step [0-9]*; checkpoint saved" "$work/out" || fail "SIGTERM: no checkpoint saved"
saved=$(readlink "$work/saves/last")
timeout 300 "$train" "${flags[@]}" --save_dir="$work/saves" --resume_from=last \
  --export_safetensors="$work/preempted.safetensors" >"$work/out" 2>&1 || fail "resuming after SIGTERM"
"$tool" compare "$work/reference.safetensors" "$work/preempted.safetensors" 1e-5 >"$work/compare" 2>&1 \
  || { cat "$work/compare"; fail "after preemption the weights differ"; }
echo "preemption: saved $saved, resumed, $(cat "$work/compare")"
echo "fault drill passed: $trials trials"
