#!/usr/bin/env bash
# GPU validation, on a machine with a GPU and PyTorch (no Bazel): builds
# Trident with CMake against PyTorch's CUDA LibTorch, runs the gpu tests
# (amp_gpu_test, parallel_gpu_test: CUDA against CPU, NCCL), then trains
# gpt2-124m for 50 steps on one GPU (one rank: its groups call no backend) in fp32 and in bf16
# and runs the PyTorch eager peer (benchmarks/peer/gpt_eager.py) on the same
# model, batch and GPU, and prints median tokens/s and Trident's MFU.
#
#   tools/gpu/fetch_deps.sh        # first, where Debian's archive is reachable
#   tools/gpu/validate.sh [LOGDIR] # then on the GPU machine, from the repository root
#
# LOGDIR (default build/) receives build.log, errors.txt and the metrics files.
# Before the throughput runs it fine-tunes gpt2-124m fully, with attention and
# MLP recomputed (checkpoint_modules), with every fused replacement pair (module_replace) and with LoRA (memory and
# tokens/s) and generates 512 tokens with and without the
# key/value cache (fp32 and greedy, so that both draw the same text); a model
# traced in Python trains with its blocks recomputed. VALIDATE_STEPS (default 50; 0 skips the throughput runs)
# sets the steps; VALIDATE_PROFILE_STEP=N records step N of the bf16 run
# with --profile_step (GPU kernels by time, and the Chrome trace
# LOGDIR/trace_bf16.json); VALIDATE_PEERS lists the PyTorch peer's runs
# (attention:precision, default "manual:fp32 manual:bf16 sdpa:bf16");
# VALIDATE_REST_S=0 skips compiling the rest of the tree.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
logs="${1:-$root/build}"
source tools/gpu/common.sh
start=$SECONDS
gpu_configure "$logs" || exit 1
gpu_build "$logs" train prepare_data checkpoint "${gpu_tests[@]}" replace_replace_test
built=$?
compile_rest() {  # the other targets, to list every file that does not compile (VALIDATE_REST_S=0 skips)
  [ "${VALIDATE_REST_S:-300}" != 0 ] || return 0
  echo "== compile check of the rest of the tree (tests, benchmarks)"
  timeout "${VALIDATE_REST_S:-300}" cmake --build build -j"$(nproc)" -- "${keep_going[@]}" >"$logs/build_rest.log" 2>&1 ||
    { grep -E 'error:|undefined reference' "$logs/build_rest.log" | sort -u | head -60; return 1; }
}
if [ $built -ne 0 ]; then compile_rest; exit 1; fi

status=0
echo "== gpu tests"
timeout 120 ctest --test-dir build -R 'gpu_test|replace_test' --output-on-failure || status=1

gpu_data || exit 1

echo "== checkpoint on the GPU: gpt-tiny, 20 steps straight against 10 + save + resume for 10"
tiny=(--data=build/data --model=gpt --preset=gpt-tiny --device=cuda --dp=1 --micro_batch_size=8 --global_batch_size=8
      --max_steps=20 --log_every=10 --eval_every=0 --eval_steps=1 --sample_tokens=0)
rm -rf build/ck
{ timeout 120 build/train "${tiny[@]}" --save_every=10 --save_dir=build/ck --export_safetensors=build/ck/straight.safetensors &&
  timeout 120 build/train "${tiny[@]}" --resume_from=build/ck/step_10 --save_dir=build/ck/resumed \
    --export_safetensors=build/ck/resumed.safetensors &&
  build/checkpoint verify build/ck/step_10 &&
  build/checkpoint compare build/ck/straight.safetensors build/ck/resumed.safetensors 1e-5; } >"$logs/checkpoint.log" 2>&1 ||
  { status=1; tail -20 "$logs/checkpoint.log"; }
grep -E "resumed from|largest difference|match the manifest|step 20/20" "$logs/checkpoint.log"

echo "== a model traced in Python on the GPU: its blocks recomputed (checkpoint_modules by class) train the same losses"
traced=(--data=build/data --model=torchscript:build/gpt.pt --device=cuda --dp=1 --block_size=16 --micro_batch_size=2
        --global_batch_size=8 --max_steps=20 --lr=3e-3 --warmup_steps=5 --eval_every=0 --sample_tokens=0 --noshuffle)
{ python3 trainer/testdata/torchscript_gpt.py save build/gpt.pt &&
  timeout 120 build/train "${traced[@]}" --metrics_file="$logs/traced.jsonl" &&
  timeout 120 build/train "${traced[@]}" --checkpoint_modules=Block --metrics_file="$logs/traced_recompute.jsonl"; } \
  >"$logs/traced.log" 2>&1 || { status=1; tail -20 "$logs/traced.log"; }
python3 - "$logs"/traced{,_recompute}.jsonl <<'PY' || status=1
import json, sys
plain, recomputed = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:])
worst = max(abs(a - b) / abs(a) for a, b in zip(plain, recomputed))
print(f"traced GPT on CUDA, checkpoint_modules=Block against none over {len(plain)} steps: {worst:.3g}")
assert len(plain) == len(recomputed) == 20 and worst <= 1e-5, worst
PY

echo "== LoRA and text generation on the GPU: gpt2-124m (vocab 50257), bf16, batch 8 x 1024"
mkdir -p build/lora
printf 'r: 16\nalpha: 32\ntarget_modules: "c_attn"\ntarget_modules: "c_proj"\ntarget_modules: "c_fc"\n' >build/lora/lora.pbtxt
gpt2=(--data=build/data --model=gpt --preset=gpt2-124m --vocab_size=50257 --block_size=1024 --device=cuda --dp=1
      --precision=bf16 --micro_batch_size=8 --global_batch_size=8 --log_every=10 --eval_every=0 --eval_steps=1 --lr=3e-4)
for run in full recompute replace lora; do
  extra=()
  [ $run = lora ] && extra=(--lora_config=build/lora/lora.pbtxt --export_safetensors=build/lora/adapter.safetensors)
  [ $run = recompute ] && extra=(--checkpoint_modules=attn,mlp)
  [ $run = replace ] && extra=(--module_replace=fused_attention,fused_layer_norm,fused_bias_gelu)
  timeout 180 build/train "${gpt2[@]}" "${extra[@]}" --max_steps=40 --sample_tokens=0 \
    --metrics_file="$logs/finetune_$run.jsonl" >"$logs/finetune_$run.log" 2>&1 ||
    { status=1; tail -20 "$logs/finetune_$run.log"; }
  grep -E "per rank:|LoRA adapter|module_replace|step 40/40|exported" "$logs/finetune_$run.log"
  echo "$run fine-tuning: $(gpu_median "$logs/finetune_$run.jsonl")"
done
# Recomputation reruns the same kernels; the fused pairs round bf16 differently (the bias outside the GEMM).
python3 - "$logs"/finetune_{full,recompute,replace}.jsonl <<'PY' || status=1
import json, sys
full, recomputed, replaced = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:])
for name, other, tolerance in (("checkpoint_modules=attn,mlp", recomputed, 1e-3), ("module_replace (all pairs)", replaced, 2e-2)):
    worst = max(abs(a - b) / abs(a) for a, b in zip(full, other))
    print(f"{name} against none over {len(full)} steps: largest relative loss difference {worst:.3g}")
    assert len(full) == len(other) == 40 and worst <= tolerance, worst
PY
# Greedy (top_k 1): sampled tokens follow the logits' rounding, which differs
# between the cached one-token products and the whole-sequence ones.
for cache in true false; do
  timeout 180 build/train "${gpt2[@]}" --precision=fp32 --max_steps=1 --text_generation --out_seq_length=512 \
    --kv_cache=$cache --top_k=1 \
    >"$logs/generation_$cache.log" 2>&1 || { status=1; tail -20 "$logs/generation_$cache.log"; }
  echo "kv_cache=$cache: $(grep -o 'sample (.*' "$logs/generation_$cache.log")"
done
# The logits agree to rounding (ModelsGpuTest.CachedDecodingComputesTheWholeSequencesLogits);
# the texts agree until rounding flips a near tie, so where they part is reported.
generated() { sed -n '/^\[rank 0\] sample (/,$p' "$logs/generation_$1.log" | tail -n +2 | head -5; }
grep -q 'sample (' "$logs/generation_true.log" && grep -q 'sample (' "$logs/generation_false.log" || status=1
if cmp -s <(generated true) <(generated false); then
  echo "cached and uncached generation drew the same text"
else
  echo "cached and uncached generation part at $(cmp <(generated true) <(generated false) | sed 's/.*differ: //')"
fi

steps=${VALIDATE_STEPS:-50}
[ "$steps" = 0 ] && { compile_rest || status=1; echo "validate: done after $((SECONDS - start)) s"; exit $status; }
echo "== gpt2-124m, batch 8 x 1024 tokens, $steps steps, one GPU"
for precision in fp32 bf16; do
  profile=()
  [ "$precision" = bf16 ] && [ "${VALIDATE_PROFILE_STEP:-0}" != 0 ] &&
    profile=(--profile_step="$VALIDATE_PROFILE_STEP" --trace_file="$logs/trace_bf16.json")
  timeout 240 build/train "${profile[@]}" --data=build/data --model=gpt --preset=gpt2-124m --vocab_size=50257 --block_size=1024 --device=cuda \
    --dp=1 --precision="$precision" --micro_batch_size=8 --global_batch_size=8 --max_steps="$steps" --log_every=10 \
    --eval_every=0 --eval_steps=1 --sample_tokens=0 --lr=3e-4 --metrics_file="$logs/trident_$precision.jsonl" \
    >"$logs/trident_$precision.log" 2>&1 || { status=1; tail -20 "$logs/trident_$precision.log"; }
  grep -E "step $steps/$steps|model gpt" "$logs/trident_$precision.log"
  [ ${#profile[@]} -gt 0 ] && sed -n '/operators of step/,/GPU busy/p' "$logs/trident_$precision.log"
  echo "trident $precision: $(gpu_median "$logs/trident_$precision.jsonl")"
done
for peer in ${VALIDATE_PEERS-manual:fp32 manual:bf16 sdpa:bf16}; do
  attention=${peer%:*} precision=${peer#*:}
  rate=$(timeout 180 python3 benchmarks/peer/gpt_eager.py --data=build/data --device=cuda --precision="$precision" \
    --attention="$attention" --vocab=50257 --n_layer=12 --n_head=12 --n_embd=768 --block=1024 --batch=8 \
    --steps="$steps" --warmup=10 2>&1 | tail -1)
  echo "pytorch eager ($attention attention) $precision: $rate"
done
compile_rest || status=1
echo "validate: done after $((SECONDS - start)) s"
exit $status
