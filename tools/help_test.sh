#!/usr/bin/env bash
# Every binary answers --help with its own flags (exit 0), not LibTorch's,
# glog's or gflags' (those stay behind --helpfull); train lists TrainerConfig's
# fields by dotted name with their comments, defaults, enum values and the
# flat aliases of earlier versions.
set -euo pipefail
fail() { echo "FAIL: $*"; exit 1; }
for binary in trainer/train tools/launch tools/hello_world tools/prepare_data tools/graph_dump tools/pipeline_sim \
              tools/checkpoint; do
  out=$("$binary" --help) || fail "$binary --help exited $?"
  [ -n "$out" ] || fail "$binary --help printed nothing"
  if grep -qE 'caffe2|--v=|logtostderr|--flagfile' <<<"$out"; then fail "$binary --help lists the libraries' flags"; fi
done
help=$(trainer/train --help)
for expected in '--config (string' '--nproc (int32, default: 0)' '--plan.zero.stage (int32, default: 0; alias --zero_stage)' \
                '--model.args.KEY' '--n_layer for n_layer' '--plan.dp (int32, default: 2; alias --dp)' \
                '--plan.recompute.method (enum: none|full|stage_aware|selected, default: none' \
                '--loop.lr (double, default: 0.001; alias --lr)' '--plan.axis_order (list of string, one per flag; alias --axis_order (comma-separated))' \
                'alias --model_config.FIELD' '1: optimizer states sharded over the data-parallel ranks'; do
  grep -qF -- "$expected" <<<"$help" || fail "train --help lacks: $expected"
done
grep -qF -- '--nproc_per_node (int32' <<<"$(tools/launch --help)" || fail "launch --help lacks --nproc_per_node"
full=$(trainer/train --helpfull 2>&1 || true)
grep -q 'caffe2' <<<"$full" || fail "train --helpfull should keep the libraries' flags"
echo "help_test: every binary's --help lists its own flags"
