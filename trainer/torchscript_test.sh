#!/usr/bin/env bash
# A model written and traced in Python (trainer/testdata/torchscript_gpt.py,
# Debian's python3-torch) trains through `train --model=torchscript:PATH` at
# dp=2, pp=2, dp=2 x pp=2 (with ZeRO-3, the file's values read layer by
# layer), tp=2 and 4 (automatic tensor parallelism, with
# sequence parallelism, and with a Llama-style model too) and the layout
# --strategy=auto chooses, with the
# losses of the same module run eagerly in Python from the same weights (20
# steps, 1e-5 relative); its tied weights stay
# tied across pipeline stages, or untie with no_tie_modules (the losses of
# the Python model with its head untied); a model returning logits trains with a named
# loss; module_replace rewrites its traced patterns with the same losses, and
# checkpoint_modules recomputes its blocks with them;
# untraceable models, bad input names and models without a loss are
# refused with errors that say why.
set -u
bin="$TEST_SRCDIR/trident"
train="$bin/trainer/train"
model_py="$bin/trainer/testdata/torchscript_gpt.py"
python=/usr/bin/python3
work="$TEST_TMPDIR"
out="$work/out"
fail() { echo "FAIL: $*"; echo "--- output:"; tail -30 "$out"; exit 1; }

printf 'It was the best of times, it was the worst of times.\n%.0s' $(seq 400) >"$work/text.txt"
"$bin/tools/prepare_data" --input="$work/text.txt" --output_dir="$work/data" >"$out" 2>&1 || fail "prepare_data"
"$python" "$model_py" save "$work/gpt.pt" >"$out" 2>&1 || fail "tracing the model in Python"
"$python" "$model_py" save_logits "$work/logits.pt" >"$out" 2>&1 || fail "tracing the logits model"
"$python" "$model_py" save_branching "$work/branching.pt" >"$out" 2>&1 || fail "scripting the branching model"
"$python" "$model_py" train "$work/gpt.pt" "$work/data" 20 >"$work/python.txt" 2>"$out" || fail "Python training"
"$python" "$model_py" save "$work/llama.pt" llama >"$out" 2>&1 || fail "tracing the Llama model"
"$python" "$model_py" train "$work/llama.pt" "$work/data" 20 llama >"$work/python_llama.txt" 2>"$out" ||
  fail "Python training of the Llama model"

# tp_split_all: these models are too small for tensor parallelism to pay, so
# the cost model of the automatic pass would keep them whole.
costed=(--data="$work/data" --block_size=16 --micro_batch_size=2 --global_batch_size=8 --max_steps=20
        --lr=3e-3 --warmup_steps=5 --eval_every=0 --sample_tokens=0 --noshuffle)
common=("${costed[@]}" --tp_split_all)

# train_and_compare TAG FLAGS...: 20 steps, losses against Python's (those of
# the Llama model where REFERENCE=python_llama), with the flags in `common`
# (or in the array FLAGS names).
train_and_compare() {
  local tag=$1; shift
  local reference="$work/${REFERENCE:-python}.txt"
  local -n flags=${FLAGS:-common}
  rm -f "$work/$tag.jsonl"
  timeout 300 "$train" "${flags[@]}" --metrics_file="$work/$tag.jsonl" "$@" >"$out" 2>&1 ||
    fail "$tag: train exited $?"
  "$python" - "$reference" "$work/$tag.jsonl" "$tag" <<'PY' || fail "$tag: losses differ from Python's"
import json, sys
python = [float(line) for line in open(sys.argv[1])]
trident = [json.loads(line)["loss"] for line in open(sys.argv[2])]
assert len(python) == len(trident) == 20, (len(python), len(trident))
worst = max(abs(p - t) / abs(p) for p, t in zip(python, trident))
print(f"{sys.argv[3]}: largest relative loss difference against Python eager over 20 steps: {worst:.3g}")
assert worst <= 1e-5, worst
PY
}

train_and_compare dp2 --model=torchscript:"$work/gpt.pt" --dp=2
train_and_compare pp2 --model=torchscript:"$work/gpt.pt" --dp=1 --pp=2 \
  --export_safetensors="$work/pp2.safetensors"
"$python" "$model_py" tied "$work/pp2.safetensors" >"$out" 2>&1 || fail "tied weights differ after pp=2"
train_and_compare dp2_pp2 --model=torchscript:"$work/gpt.pt" --dp=2 --pp=2 --schedule=zb_h1
# no_tie_modules: the traced head reads a tensor of its own, starting from the
# tied values, as the Python model's head does once untied: at pp=2 (exported
# beside the embedding), at dp=2 x tp=2 (vocabulary-parallel embedding and
# head), and with the embedding, now read by its lookup alone, recomputed.
"$python" "$model_py" train "$work/gpt.pt" "$work/data" 20 untied >"$work/python_untied.txt" 2>"$out" ||
  fail "Python training of the untied model"
[ "$(tail -1 "$work/python_untied.txt")" != "$(tail -1 "$work/python.txt")" ] || fail "untying changed no loss"
untied=(--model=torchscript:"$work/gpt.pt" --no_tie_modules)
REFERENCE=python_untied train_and_compare untied_pp2 "${untied[@]}" --dp=1 --pp=2 \
  --export_safetensors="$work/untied.safetensors"
grep -aq "no_tie_modules: lm_head.weight (was transformer.wte.weight)" "$out" || fail "untied_pp2: the head is tied"
"$python" "$model_py" untied "$work/untied.safetensors" >"$out" 2>&1 || fail "untied weights equal after pp=2"
REFERENCE=python_untied train_and_compare untied_dp2_tp2 "${untied[@]}" --dp=2 --tp=2 --zero_stage=1
REFERENCE=python_untied train_and_compare untied_recompute_wte "${untied[@]}" --dp=1 --checkpoint_modules=wte
# ZeRO-3 (parameters gathered shard by shard) and recomputation on the traced graph.
train_and_compare zero3 --model=torchscript:"$work/gpt.pt" --dp=2 --zero_stage=3
# The file's parameter values are read layer by layer by the ranks that keep
# each (never whole on load): dp=2 x pp=2 with ZeRO-3 slicing each layer as it
# is read, twice (a race shows as run-to-run differences), and for the Llama model.
for run in 1 2; do
  train_and_compare dp2_pp2_zero3_$run --model=torchscript:"$work/gpt.pt" --dp=2 --pp=2 --zero_stage=3
  grep -aq "loaded it whole instead" "$out" && fail "dp2_pp2_zero3: the values were not deferred"
done
REFERENCE=python_llama train_and_compare llama_dp2_pp2_zero3 --model=torchscript:"$work/llama.pt" --dp=2 --pp=2 \
  --zero_stage=3
train_and_compare recompute --model=torchscript:"$work/gpt.pt" --dp=1 --pp=2 --activation_checkpointing=full
# ATorch's checkpoint method on the traced graph: the Python blocks, named by
# class, recompute their operators (ZeRO-3 gathering parameters for the rerun,
# and across pp=2); the products by name at tp=2 with sequence parallelism.
train_and_compare recompute_blocks --model=torchscript:"$work/gpt.pt" --dp=2 --zero_stage=3 --checkpoint_modules=Block
grep -aq "checkpoint_modules: Block 2 (modules whose operators recompute in backward)" "$out" ||
  fail "recompute_blocks: the blocks were not found"
train_and_compare recompute_blocks_pp2 --model=torchscript:"$work/gpt.pt" --dp=1 --pp=2 --checkpoint_modules=Block
train_and_compare recompute_tp2_sp --model=torchscript:"$work/gpt.pt" --dp=1 --tp=2 --sequence_parallel \
  --checkpoint_modules=c_attn,c_fc
# The automatic search profiles the traced model's shards on 2 ranks and trains
# the layout it chose with the same parity.
train_and_compare auto --model=torchscript:"$work/gpt.pt" --nproc=2 --strategy=auto \
  --profile_cache_dir="$work/profiles"
grep -aq "<- chosen" "$out" || fail "auto: no table of candidates"
# Automatic tensor parallelism: the traced graphs split Megatron's way (fused
# q, k, v by heads; grouped-query attention; SwiGLU), composed with dp, pp and ZeRO.
train_and_compare tp2 --model=torchscript:"$work/gpt.pt" --dp=1 --tp=2
# --tp_plan_report prints the plan and stops before the first step.
timeout 120 "$train" "${common[@]}" --model=torchscript:"$work/gpt.pt" --tp=2 --tp_plan_report >"$out" 2>&1 ||
  fail "tp_plan_report exited $?"
grep -aq "c_attn.weight *column *dim 0, part 0 of 2 in each of 3 pieces" "$out" || fail "tp_plan_report: no plan"
grep -aq "transformer.wte.weight *vocabulary" "$out" || fail "tp_plan_report: the embedding is not split"
grep -aq "vocab_parallel_cross_entropy" "$out" || fail "tp_plan_report: no vocabulary-parallel loss"
grep -aq "step 1/" "$out" && fail "tp_plan_report trained"
train_and_compare tp4 --model=torchscript:"$work/gpt.pt" --dp=1 --tp=4
train_and_compare dp2_tp2 --model=torchscript:"$work/gpt.pt" --dp=2 --tp=2 --zero_stage=1
train_and_compare tp2_pp2 --model=torchscript:"$work/gpt.pt" --dp=1 --tp=2 --pp=2
train_and_compare tp2_sp --model=torchscript:"$work/gpt.pt" --dp=1 --tp=2 --sequence_parallel
grep -aq "reduce_scatter_to_sequence_region" "$out" || fail "tp2_sp: no reduce-scatter into sequence shards"
# Without tp_split_all the cost model keeps every region of this small model whole, and says so.
timeout 120 "$train" "${costed[@]}" --model=torchscript:"$work/gpt.pt" --tp=2 --max_steps=2 >"$out" 2>&1 &&
  fail "a tp=2 run of a model too small to split was accepted"
grep -aq "c_fc.weight *replicated splitting its region would save" "$out" || fail "no cost-model reason in the plan"
grep -aq "set tp_split_all to split regardless of the cost model" "$out" || fail "no advice to set tp_split_all"
# Merak's layer lists pin the MLPs split; the cost model keeps the rest whole.
echo 'tp_layer_lists { col_para_list: "c_fc" row_para_list: "mlp_proj" }' >"$work/pinned.pbtxt"
pinned=(--config="$work/pinned.pbtxt" "${costed[@]}")
FLAGS=pinned train_and_compare pinned --model=torchscript:"$work/gpt.pt" --tp=2
grep -aq "c_fc.weight *column" "$out" || fail "pinned: c_fc is not column-parallel"
grep -aq "c_attn.weight *replicated splitting its region" "$out" || fail "pinned: c_attn is not left to the cost model"
REFERENCE=python_llama train_and_compare llama_tp2 --model=torchscript:"$work/llama.pt" --dp=1 --tp=2
grep -aq "layers.1.wo.weight *row" "$out" || fail "llama_tp2: wo is not row-parallel"
REFERENCE=python_llama train_and_compare llama_dp2_tp2 --model=torchscript:"$work/llama.pt" --dp=2 --tp=2
REFERENCE=python_llama train_and_compare llama_tp2_sp --model=torchscript:"$work/llama.pt" --dp=1 --tp=2 \
  --sequence_parallel
# parallel_vocab false: the embedding and the head stay whole (tied in GPT,
# untied in Llama), with Python's losses; with sequence parallelism each rank
# embeds its sequence shard and sums its shard's loss over the group.
train_and_compare whole_vocabulary --model=torchscript:"$work/gpt.pt" --dp=1 --tp=2 --parallel_vocab=false
grep -aq "transformer.wte.weight *replicated" "$out" || fail "whole_vocabulary: the embedding is split"
REFERENCE=python_llama train_and_compare llama_whole_vocabulary --model=torchscript:"$work/llama.pt" --dp=1 --tp=2 \
  --parallel_vocab=false
grep -aq "output.weight *replicated" "$out" || fail "llama_whole_vocabulary: the head is split"
train_and_compare whole_vocabulary_sp --model=torchscript:"$work/gpt.pt" --dp=1 --tp=2 --sequence_parallel \
  --parallel_vocab=false
grep -aq "sums the sequence shards' cross-entropy" "$out" || fail "whole_vocabulary_sp: no shard loss"
REFERENCE=python_llama train_and_compare llama_whole_vocabulary_sp --model=torchscript:"$work/llama.pt" --dp=1 --tp=2 \
  --sequence_parallel --parallel_vocab=false
# Exports after 5 steps at tp=2 equal one process's, tensor by tensor. SGD:
# Adam would turn the rounding noise of gradients that are zero in exact
# arithmetic (the key biases') into whole learning-rate steps.
echo 'optimizer_config { type: "sgd" args { key: "momentum" value: "0.9" } }' >"$work/sgd.pbtxt"
for tp in 1 2; do
  timeout 300 "$train" --config="$work/sgd.pbtxt" "${common[@]}" --model=torchscript:"$work/gpt.pt" --tp=$tp \
    --max_steps=5 --export_safetensors="$work/export_tp$tp.safetensors" >"$out" 2>&1 || fail "export at tp=$tp exited $?"
done
"$python" "$model_py" compare "$work/export_tp1.safetensors" "$work/export_tp2.safetensors" >"$out" 2>&1 ||
  fail "the tp=2 export differs from one process's"
# bf16 compute runs (its losses track fp32, not to 1e-5).
timeout 300 "$train" "${common[@]}" --model=torchscript:"$work/gpt.pt" --dp=2 --precision=bf16 \
  --max_steps=5 >"$out" 2>&1 || fail "bf16 run exited $?"
grep -aq '^\[rank 0\] step 5/5 | loss ' "$out" || fail "bf16 step line"
# init_from reads the export by the module's own names (the tied head too):
# training resumes from the trained weights, below the untrained first loss.
timeout 300 "$train" "${common[@]}" --model=torchscript:"$work/gpt.pt" --dp=1 --max_steps=1 --log_every=1 \
  --init_from="$work/pp2.safetensors" >"$out" 2>&1 || fail "init_from run exited $?"
first=$(grep -a '^\[rank 0\] step 1/1 | loss' "$out" | sed 's/.*| loss \([0-9.]*\).*/\1/')
untrained=$(head -1 "$work/python.txt")
awk -v a="$first" -v b="$untrained" 'BEGIN { exit !(a < b - 0.5) }' || fail "init_from: loss $first vs untrained $untrained"
# LoRA on the Python model's nn.Linear layers (adapters added to the traced
# graph): one process and pp=2 train the same losses from the export above,
# and the adapter exports under PEFT's names.
printf 'r: 4\nalpha: 8\ntarget_modules: "c_attn"\ntarget_modules: "c_fc"\n' >"$work/lora.pbtxt"
lora=("${common[@]}" --model=torchscript:"$work/gpt.pt" --init_from="$work/pp2.safetensors"
      --lora_config="$work/lora.pbtxt" --max_steps=10)
timeout 300 "$train" "${lora[@]}" --dp=1 --metrics_file="$work/lora1.jsonl" \
  --export_safetensors="$work/adapter.safetensors" >"$out" 2>&1 || fail "LoRA run exited $?"
grep -aq "LoRA adapter 'default' (r 4, scale 2)" "$out" || fail "LoRA summary line"
grep -aq "exported adapter 'default' (PEFT names)" "$out" || fail "LoRA export line"
timeout 300 "$train" "${lora[@]}" --dp=1 --pp=2 --metrics_file="$work/lora2.jsonl" >"$out" 2>&1 ||
  fail "LoRA pp=2 run exited $?"
"$python" - "$work/lora1.jsonl" "$work/lora2.jsonl" "$work/adapter.safetensors" <<'PY' || fail "LoRA losses or adapter"
import json, sys, struct
one = [json.loads(line)["loss"] for line in open(sys.argv[1])]
two = [json.loads(line)["loss"] for line in open(sys.argv[2])]
assert len(one) == len(two) == 10 and one[-1] != one[0], (one, two)
worst = max(abs(a - b) / abs(a) for a, b in zip(one, two))
print(f"LoRA on TorchScript: pp=2 against one process over 10 steps: {worst:.3g}")
assert worst <= 1e-5, worst
with open(sys.argv[3], "rb") as f:
    names = sorted(k for k in json.loads(f.read(struct.unpack("<Q", f.read(8))[0])) if k != "__metadata__")
assert names and all(n.startswith("base_model.model.transformer.h.") and ".lora_" in n for n in names), names
PY
# At tp=2 (with sequence parallelism too) the adapters of the split products,
# column (c_attn, c_fc) and row (c_proj, mlp_proj), train one process's losses
# and export its adapter.
printf 'r: 4\nalpha: 8\ntarget_modules: "c_attn"\ntarget_modules: "c_proj"\ntarget_modules: "c_fc"\ntarget_modules: "mlp_proj"\n' \
  >"$work/lora_all.pbtxt"
lora_all=("${common[@]}" --model=torchscript:"$work/gpt.pt" --init_from="$work/pp2.safetensors"
          --lora_config="$work/lora_all.pbtxt" --max_steps=10)
for layout in "1 false" "2 false" "2 true"; do
  set -- $layout
  timeout 300 "$train" "${lora_all[@]}" --dp=1 --tp="$1" --sequence_parallel="$2" --metrics_file="$work/lora_tp$1_$2.jsonl" \
    --export_safetensors="$work/adapter_tp$1_$2.safetensors" >"$out" 2>&1 || fail "LoRA tp=$1 sequence_parallel=$2 run exited $?"
done
# The adapters' slices join into one process's adapter. Adam normalises B's
# first, rounding-level gradients into whole steps (see the SGD exports
# below), so the bound is 1e-4; the comparison prints the largest difference.
"$bin/tools/checkpoint" compare "$work/adapter_tp1_false.safetensors" "$work/adapter_tp2_true.safetensors" 1e-4 \
  >"$out" 2>&1 || fail "the tp=2 adapter differs from one process's"
echo "LoRA adapter at tp=2 with sequence parallelism against one process: $(tail -1 "$out")"
"$python" - "$work"/lora_tp{1_false,2_false,2_true}.jsonl <<'PY' || fail "LoRA losses at tp=2 differ"
import json, sys
one, *others = ([json.loads(line)["loss"] for line in open(p)] for p in sys.argv[1:])
for name, other in zip(("tp=2", "tp=2 with sequence parallelism"), others):
    assert len(one) == len(other) == 10 and one[-1] != one[0], (one, other)
    worst = max(abs(a - b) / abs(a) for a, b in zip(one, other))
    print(f"LoRA on TorchScript: {name} against one process over 10 steps: {worst:.3g}")
    assert worst <= 1e-5, worst
PY

# module_replace on the traced graph: the Python model's explicit attention,
# its residual adds into LayerNorm and its c_fc + GELU become the fused
# operators, with the losses of Python eager, in one process, at pp=2 and at
# tp=2 with sequence parallelism.
fused=(--module_replace=fused_attention,fused_layer_norm,fused_bias_gelu)
train_and_compare replace --model=torchscript:"$work/gpt.pt" --dp=1 "${fused[@]}"
grep -aq "module_replace: fused_attention 2, fused_layer_norm 4, fused_bias_gelu 2 (this rank)" "$out" ||
  fail "replace: not every pattern was replaced"
train_and_compare replace_pp2 --model=torchscript:"$work/gpt.pt" --dp=1 --pp=2 "${fused[@]}"
train_and_compare replace_tp2_sp --model=torchscript:"$work/gpt.pt" --dp=1 --tp=2 --sequence_parallel "${fused[@]}"
# The model's F.cross_entropy as one operator, on the last of two stages.
train_and_compare replace_loss_pp2 --model=torchscript:"$work/gpt.pt" --dp=1 --pp=2 --module_replace=fused_cross_entropy
grep -aq "module_replace: fused_cross_entropy 1 (this rank)" "$out" || fail "replace_loss_pp2: the loss was not replaced"

# The model's own loss is absent: a registered loss on its logits, fed the inputs by name.
train_and_compare logits --model=torchscript:"$work/logits.pt" --dp=1 --pp=2 --loss=cross_entropy \
  --input_names=input_ids

# refused MESSAGE FLAGS...: train fails and says MESSAGE.
refused() {
  local message=$1; shift
  timeout 120 "$train" "${common[@]}" --max_steps=2 "$@" >"$out" 2>&1 && fail "accepted: $*"
  grep -aq -- "$message" "$out" || fail "want '$message' for: $*"
}
refused "reads a tensor's value (aten::Bool" --model=torchscript:"$work/branching.pt" --dp=1
refused "use trace_method=layers" --model=torchscript:"$work/branching.pt" --dp=1
refused "input_names names 'tokens', which the batch does not have; its fields are input_ids, labels" \
  --model=torchscript:"$work/logits.pt" --dp=1 --input_names=tokens
refused "takes 1 input(s) (idx) but is given 2 (input_ids, labels); choose them with input_names" \
  --model=torchscript:"$work/logits.pt" --dp=1
refused "hold no scalar loss" --model=torchscript:"$work/logits.pt" --dp=1 --input_names=input_ids
refused "layers.0.wk.weight), makes a dimension of size 2 from the split one (attention heads, for example), which tp=4 does not divide" \
  --model=torchscript:"$work/llama.pt" --dp=1 --tp=4
refused "cannot read TorchScript file $work/missing.pt" --model=torchscript:"$work/missing.pt"
refused "checkpoint_modules: module 'transformer.wte' is not one run of operators in the traced graph" \
  --model=torchscript:"$work/gpt.pt" --dp=1 --checkpoint_modules=wte
refused "checkpoint_modules: entry 'attn' matches no module of the model" --model=torchscript:"$work/gpt.pt" --dp=1 \
  --checkpoint_modules=attn
echo "torchscript_test: all checks passed"
