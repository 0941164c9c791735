#!/usr/bin/env bash
# The train binary end to end: bad configurations are one error line and a
# non-zero exit before any rank starts; a short run on 2 self-spawned ranks
# trains, evaluates, samples, writes metrics, TensorBoard events and a checkpoint.
set -u
bin="$TEST_SRCDIR/trident"
train="$bin/trainer/train"
out="$TEST_TMPDIR/out"
fail() { echo "FAIL: $*"; echo "--- output:"; cat "$out"; exit 1; }

printf 'It was the best of times, it was the worst of times.\n%.0s' $(seq 400) >"$TEST_TMPDIR/text.txt"
"$bin/tools/prepare_data" --input="$TEST_TMPDIR/text.txt" --output_dir="$TEST_TMPDIR/data" >"$out" 2>&1 \
  || fail "prepare_data"
small=(--data="$TEST_TMPDIR/data" --n_layer=1 --n_embd=32 --n_head=2 --block_size=16)

expect_error() {  # expect_error "message" flags...
  local message=$1; shift
  timeout 20 "$train" "${small[@]}" "$@" >"$out" 2>&1 && fail "accepted: $*"
  [ "$(wc -l <"$out")" -eq 1 ] || fail "want one error line for: $*"
  grep -aq "^train: error: .*$message" "$out" || fail "want '$message' for: $*"
}
expect_error "dp\*tp\*pp = 3\*1\*1 = 3 but 2 ranks were started" --dp=3 --nproc=2
expect_error "global_batch_size=10 is not divisible by micro_batch_size\*dp = 8\*2 = 16" --global_batch_size=10
expect_error "unknown model 'bert'; choose gpt, llama, mlp, torchscript" --model=bert
expect_error "lr=-1 must be positive" --lr=-1
expect_error "data directory /nonexistent has no train.bin" --data=/nonexistent
expect_error "flag --max_steps='x' is not a valid int64 value" --max_steps=x
expect_error "unknown flag --bogus; the flags are the fields of trainer/config.proto" --bogus=1
expect_error "n_head=2 is not divisible by tp=4" --tp=4 --dp=1
expect_error "sequence_parallel needs tp > 1" --sequence_parallel
expect_error "precision=pure_fp16 computes or stores float16, which needs a GPU" --precision=pure_fp16
expect_error "zero_stage=5 is unknown" --zero_stage=5
printf 'methods { name: "zero2" schedule: "1f1b" }\n' >"$TEST_TMPDIR/bad.strategy"
expect_error "strategy: method 'zero2' takes no 'schedule'" --load_strategy="$TEST_TMPDIR/bad.strategy"
printf 'methods { name: "zero1" } methods { name: "fsdp" }\n' >"$TEST_TMPDIR/pair.strategy"
expect_error "methods 'zero1' and 'fsdp' do not go together" --load_strategy="$TEST_TMPDIR/pair.strategy"
printf 'methods { name: ' >"$TEST_TMPDIR/broken.strategy"
expect_error "is not a valid Strategy (line 1" --load_strategy="$TEST_TMPDIR/broken.strategy"
expect_error "strategy='best' is unknown; use auto" --strategy=best
expect_error "strategy_excluded names 'ddp'" --strategy=auto --strategy_excluded=ddp
expect_error "run_mode=compile needs strategy=auto" --run_mode=compile
expect_error "strategy=auto with load_strategy: the loaded strategy already decides" --strategy=auto \
  --load_strategy="$TEST_TMPDIR/pair.strategy"

timeout 120 "$train" "${small[@]}" --max_steps=6 --log_every=2 --eval_every=3 --eval_steps=2 \
  --sample_tokens=20 --save_dir="$TEST_TMPDIR/run" --metrics_file="$TEST_TMPDIR/run/metrics.jsonl" \
  --tensorboard_dir="$TEST_TMPDIR/run/tb" >"$out" 2>&1 || fail "training run exited $?"
grep -aq '^\[rank 0\] step 6/6 | loss ' "$out" || fail "step log line"
grep -aq '^\[rank 0\] step 3 | val_loss ' "$out" || fail "evaluation line"
grep -aq '^\[rank 0\] validation loss .* nats/token (unigram entropy of the data ' "$out" || fail "final validation"
grep -aq '^\[rank 0\] sample (temperature 0.8, top_k 40, 20 tokens in .* key/value cache):' "$out" || fail "sample"
[ "$(wc -l <"$TEST_TMPDIR/run/metrics.jsonl")" -eq 6 ] || fail "metrics lines"
ls "$TEST_TMPDIR"/run/tb/events.out.tfevents.* >/dev/null || fail "tensorboard file"
[ -f "$TEST_TMPDIR/run/step_6/manifest.pbtxt" ] || fail "checkpoint"
grep -aq 'name: "rank_1.safetensors"' "$TEST_TMPDIR/run/step_6/manifest.pbtxt" || fail "manifest"
# Pipeline parallelism end to end, with the timeline of step 2 written out:
# interleaved (2 chunks per rank), then zero-bubble.
timeout 120 "$train" "${small[@]}" --n_layer=2 --pp=2 --dp=1 --micro_batch_size=2 \
  --global_batch_size=8 --schedule=interleaved_1f1b --virtual_stages=2 --max_steps=3 \
  --eval_steps=1 --sample_tokens=0 --trace_file="$TEST_TMPDIR/trace/step.json" \
  --trace_step=2 >"$out" 2>&1 || fail "pipeline run exited $?"
grep -aq '^\[rank 0\] step 3/3 | loss ' "$out" || fail "pipeline step line"
grep -aq '"name":"backward 3 (chunk 1)"' "$TEST_TMPDIR/trace/step.json" || fail "trace events"
grep -aq '"tid":1' "$TEST_TMPDIR/trace/step.json" || fail "trace row of rank 1"
grep -aq '<svg' "$TEST_TMPDIR/trace/step.svg" || fail "timeline svg"
# With --profile_step the trace also holds every operator of the step, on each rank.
timeout 120 "$train" "${small[@]}" --pp=2 --dp=1 --micro_batch_size=2 --global_batch_size=8 \
  --schedule=zb_h1 --max_steps=2 --eval_steps=1 --sample_tokens=0 \
  --trace_file="$TEST_TMPDIR/zb/step.json" --profile_step=2 >"$out" 2>&1 || fail "zb_h1 run exited $?"
grep -aq '"name":"backward_weight 3"' "$TEST_TMPDIR/zb/step.json" || fail "zb_h1 weight gradients"
grep -aq '^\[rank 0\] operators of step 2 on rank 0:' "$out" || fail "operator breakdown"
grep -aEq '^\[rank 0\] aten::mm +[0-9.]+ +[0-9]+ +[0-9.]+%' "$out" || fail "matrix products in the breakdown"
/usr/bin/python3 - "$TEST_TMPDIR/zb/step.json" <<'PY' || fail "profiled operators"
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
operators = [e for e in events if e.get("cat") == "operator"]
for rank in (0, 1):  # operator rows 1000 * (rank + 1) + thread
    names = {e["name"] for e in operators if e["tid"] // 1000 == rank + 1}
    assert {"aten::mm", "trident::forward_backward", "trident::fused_adamw"} <= names, (rank, sorted(names)[:20])
    assert any(n.startswith("gloo:") for n in names), rank
step = [e for e in operators if e["name"] == "trident::forward_backward" and e["tid"] == 1000][0]
pipeline = [e for e in events if e.get("cat") == "forward" and e["tid"] == 0]
assert pipeline and all(step["ts"] - 1e3 <= e["ts"] <= step["ts"] + step["dur"] for e in pipeline), "timeline outside the step"
PY
# Tensor and sequence parallelism end to end, exported as one model.
timeout 120 "$train" "${small[@]}" --tp=2 --dp=1 --sequence_parallel --max_steps=2 --eval_steps=1 \
  --sample_tokens=10 --export_safetensors="$TEST_TMPDIR/tp/model.safetensors" >"$out" 2>&1 ||
  fail "tensor-parallel run exited $?"
grep -aq '^\[rank 0\] step 2/2 | loss ' "$out" || fail "tensor-parallel step line"
grep -aq '^\[rank 0\] sample (temperature' "$out" || fail "tensor-parallel sample"
grep -aq 'exported the model to' "$out" || fail "tensor-parallel export"
# The semi-automatic mode: a strategy file lays out the ranks (2: its
# parallel_mode), is timed first when asked, and the strategy in use is saved
# and loads back.
printf 'methods { name: "parallel_mode" parallel_mode { name: "pipeline" size: 2 } }\nmethods { name: "zero1" }\nmethods { name: "pipeline_parallel" schedule: "zb_h1" micro_batches: 4 }\n' \
  >"$TEST_TMPDIR/pp.strategy"
timeout 120 "$train" "${small[@]}" --load_strategy="$TEST_TMPDIR/pp.strategy" --noignore_dryrun_on_load_strategy \
  --save_strategy="$TEST_TMPDIR/saved.strategy" --max_steps=2 --eval_steps=1 --sample_tokens=0 >"$out" 2>&1 ||
  fail "strategy run exited $?"
grep -aq '^\[rank 0\] dry run of the loaded strategy (pp2 zb_h1 mb8x4 zero1): [0-9]* ms/step' "$out" ||
  fail "dry run line"
grep -aq '^\[rank 0\] step 2/2 | loss ' "$out" || fail "strategy step line"
grep -q 'schedule: "zb_h1"' "$TEST_TMPDIR/saved.strategy" || fail "saved strategy"
timeout 120 "$train" "${small[@]}" --load_strategy="$TEST_TMPDIR/saved.strategy" --max_steps=1 --eval_steps=1 \
  --sample_tokens=0 >"$out" 2>&1 || fail "saved strategy does not load back"
# The fully automatic mode on 2 ranks. A compile run profiles, ranks the
# candidates, dry-runs the best two, prints the table and saves the winner
# with its fingerprint, and trains nothing; a run reuses it; a run for
# another global batch is refused under strategy_reuse=match (the default)
# and searches again under moo; a memory limit nothing fits is one error
# naming the smallest requirement.
auto=(--strategy=auto --nproc=2 --profile_cache_dir="$TEST_TMPDIR/profiles" --strategy_dry_runs=2
      --save_strategy="$TEST_TMPDIR/auto.strategy" --eval_steps=1 --sample_tokens=0)
timeout 300 "$train" "${small[@]}" "${auto[@]}" --run_mode=compile >"$out" 2>&1 || fail "compile run exited $?"
grep -aq '^\[rank 0\] .*candidates modelled, 0 over the memory limit' "$out" || fail "candidate table"
[ "$(grep -ac '^\[rank 0\] [0-9].* [0-9.]* *<- chosen' "$out")" -eq 1 ] || fail "one dry-run winner"
grep -aq 'step 1/' "$out" && fail "compile mode trained"
grep -q '^fingerprint: ".*world=2' "$TEST_TMPDIR/auto.strategy" || fail "strategy fingerprint"
timeout 300 "$train" "${small[@]}" "${auto[@]}" --max_steps=2 >"$out" 2>&1 || fail "reuse run exited $?"
grep -aq "reusing the strategy in $TEST_TMPDIR/auto.strategy" "$out" || fail "strategy not reused"
grep -aq '^\[rank 0\] step 2/2 | loss ' "$out" || fail "automatic step line"
timeout 300 "$train" "${small[@]}" "${auto[@]}" --global_batch_size=32 --max_steps=1 >"$out" 2>&1 &&
  fail "reused a strategy chosen for another batch"
grep -aq 'was chosen for another run' "$out" || fail "strategy_reuse=match error"
timeout 300 "$train" "${small[@]}" "${auto[@]}" --global_batch_size=32 --max_steps=1 --strategy_reuse=moo \
  >"$out" 2>&1 || fail "moo run exited $?"
grep -aq 'candidates modelled' "$out" || fail "moo did not search again"
timeout 300 "$train" "${small[@]}" "${auto[@]}" --strategy_reuse=override --memory_limit_mb=1 >"$out" 2>&1 &&
  fail "trained over the memory limit"
grep -aq 'no strategy fits the memory limit of 1 MB per rank: the smallest found (.*) needs [0-9]* MB' "$out" ||
  fail "memory limit error"
echo "train_test: all checks passed"
