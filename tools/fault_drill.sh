#!/usr/bin/env bash
# Fault drill: trains a dp=2 x pp=2 job with --max_restarts=3 --save_every=5
# and SIGKILLs a random rank at a random moment, TRIALS times; every trial
# must finish (exit 0, no hang) with weights equal to an uninterrupted run's
# (1e-5). Then SIGTERM mid-run must save and exit 0, and resuming finishes
# with the same weights; resuming it on 2 ranks instead of 4 (--elastic)
# too. SIGKILL while a checkpoint is being written must leave the previous
# one `last` and valid. SIGSTOP of one rank must fail the others within
# --collective_timeout_s, naming the stopped rank.
#
#   tools/fault_drill.sh TRAIN CHECKPOINT_TOOL WORK_DIR [TRIALS] -- TRAIN_FLAGS...
set -u
train=$1 tool=$2 work=$3 trials=${4:-10}
shift 4
[ "${1:-}" = "--" ] && shift
flags=("$@" --dp=2 --pp=2 --max_steps=20 --sample_tokens=0 --eval_every=0)
mkdir -p "$work"
fail() { echo "FAIL: $*"; [ -f "$work/out" ] && tail -30 "$work/out"; exit 1; }
# Starts `timeout LIMIT train FLAGS...` in the background as $job, its output in a fresh
# $work/out (the redirection happens in the child, later: a stale file must not be read).
start() {
  local limit=$1
  shift
  rm -f "$work/out"
  timeout "$limit" "$train" "$@" >"$work/out" 2>&1 &
  job=$!
}
# Waits up to $2 seconds (a loaded machine starts jobs slowly) for the regex $1 in the job's output.
await() {
  for _ in $(seq $(($2 * 20))); do grep -qE "$1" "$work/out" 2>/dev/null && return 0; sleep 0.05; done
  fail "no '$1' in the job's output within $2 s"
}

timeout 300 "$train" "${flags[@]}" --export_safetensors="$work/reference.safetensors" \
  --metrics_file="$work/reference.jsonl" >"$work/out" 2>&1 || fail "the uninterrupted run"

# The rank processes of the job started as `timeout ... train` with pid $1
# (train is the launcher, its children the ranks).
ranks() { for launcher in $(pgrep -P "$1"); do pgrep -P "$launcher"; done; }

for trial in $(seq "$trials"); do
  rm -rf "$work/saves"
  start 300 "${flags[@]}" --max_restarts=3 --save_every=5 --save_dir="$work/saves" \
    --export_safetensors="$work/trial.safetensors"
  # A random rank, once rank 0 logged a random step (1 to 18).
  at=$((1 + RANDOM % 18))
  await "step $at/20" 120
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
start 300 "${flags[@]}" --save_dir="$work/saves"
# Once rank 0 prints its layout every rank has joined, and ranks catch SIGTERM
# from their start: the job stops after the step in progress. (Waiting for a
# step instead races with the end of this short run.)
await "layout:" 120
launcher=$(pgrep -P "$job") || fail "SIGTERM: the job ended before it could be signalled"
kill -TERM "$launcher"  # to train itself (as a scheduler would), not to the timeout wrapper
wait "$job" || fail "SIGTERM: the job exited $?"
grep -q "preempted (SIGTERM) after step [0-9]*; checkpoint saved" "$work/out" || fail "SIGTERM: no checkpoint saved"
saved=$(readlink "$work/saves/last")
timeout 300 "$train" "${flags[@]}" --save_dir="$work/saves" --resume_from=last \
  --export_safetensors="$work/preempted.safetensors" >"$work/out" 2>&1 || fail "resuming after SIGTERM"
"$tool" compare "$work/reference.safetensors" "$work/preempted.safetensors" 1e-5 >"$work/compare" 2>&1 \
  || { cat "$work/compare"; fail "after preemption the weights differ"; }
echo "preemption: saved $saved, resumed, $(cat "$work/compare")"

# Elastic: the same preempted checkpoint of 4 ranks resumed on 2 (dp 2 -> 1, pp 2 kept): its
# losses equal the uninterrupted run's within 1e-5. The reduction order changes, so the
# weights agree only to fp32 rounding, which Adam's normalised steps amplify on small
# biases (up to 5e-5 of a tensor's largest value here): checked at 1e-3.
timeout 300 "$train" "${flags[@]}" --nproc=2 --elastic --save_dir="$work/saves" --resume_from="$work/saves/$saved" \
  --export_safetensors="$work/elastic.safetensors" --metrics_file="$work/elastic.jsonl" >"$work/out" 2>&1 \
  || fail "resuming on 2 ranks (--elastic)"
grep -q "elastic: 2 ranks, so dp=1 instead of 2" "$work/out" || fail "elastic: the layout was not recomputed"
losses() { sed -E 's/.*"step": ([0-9]+), "loss": ([^,]+),.*/\1 \2/' "$1"; }
read -r steps worst < <(awk 'NR == FNR { ref[$1] = $2; next } ($1 in ref) { d = ($2 - ref[$1]) / ref[$1];
  if (d < 0) d = -d; if (d > w) w = d; n++ } END { printf "%d %.3g\n", n, w }' \
  <(losses "$work/reference.jsonl") <(losses "$work/elastic.jsonl"))
awk -v s="$steps" -v w="$worst" 'BEGIN { exit !(s > 0 && w <= 1e-5) }' \
  || fail "elastic: the losses of $steps resumed steps differ by up to $worst (relative)"
"$tool" compare "$work/reference.safetensors" "$work/elastic.safetensors" 1e-3 >"$work/compare" 2>&1 \
  || { cat "$work/compare"; fail "after the elastic restart the weights differ"; }
echo "elastic: $saved of 4 ranks resumed on 2; $steps losses within $worst; $(cat "$work/compare")"

# SIGKILL while step 6 is being written (a larger model, so that writing takes a while).
rm -rf "$work/saves"
big=("${flags[@]}" --pp=1 --n_layer=4 --n_embd=512 --n_head=8 --max_steps=6 --save_every=3 --save_dir="$work/saves")
start 300 "${big[@]}"
for _ in $(seq 12000); do [ -d "$work/saves/.step_6.staging" ] && break; sleep 0.01; done
kill -KILL $(ranks "$job") 2>/dev/null
wait "$job"
[ "$(readlink "$work/saves/last")" = step_3 ] && [ ! -e "$work/saves/step_6" ] \
  || fail "SIGKILL during the write of step 6: last is $(readlink "$work/saves/last")"
"$tool" verify "$work/saves/last" >"$work/compare" 2>&1 || { cat "$work/compare"; fail "last is not valid"; }
timeout 300 "$train" "${big[@]}" --resume_from=last >"$work/out" 2>&1 || fail "resuming after SIGKILL during a write"
grep -q "resumed from $work/saves/step_3" "$work/out" || fail "the resumed run did not start from step 3"
echo "SIGKILL during a checkpoint write: last stayed step_3 ($(cat "$work/compare")); resumed and finished"

# SIGSTOP: the stopped rank is named by the others within the collective timeout.
start 120 "${flags[@]}" --collective_timeout_s=5
await "step 3/20" 120
victims=($(ranks "$job"))
kill -STOP "${victims[1]}" || fail "SIGSTOP: the job ended before rank 1 could be stopped"
stopped_at=$SECONDS
wait "$job"
code=$?
[ "$code" -ne 0 ] && [ "$code" -ne 124 ] || fail "SIGSTOP: the job exited $code (want a failure, not a hang)"
grep -q "timed out.*rank 1 has stopped sending heartbeats" "$work/out" || fail "SIGSTOP: rank 1 not named"
echo "SIGSTOP: the job failed $((SECONDS - stopped_at)) s after rank 1 was stopped (timeout 5 s): $(grep -m1 -o \
  "[a-z_]* on process group '[a-z]*' ([^)]*) failed.*rank 1 has stopped sending heartbeats" "$work/out")"
echo "fault drill passed: $trials trials"
