#!/usr/bin/env bash
# Every binary answers --help with its own flags (exit 0), not LibTorch's,
# glog's or gflags' (those stay behind --helpfull); train lists TrainerConfig's
# fields with their comments, nested ones by dotted name.
set -euo pipefail
fail() { echo "FAIL: $*"; exit 1; }
for binary in trainer/train tools/launch tools/hello_world tools/prepare_data tools/graph_dump tools/pipeline_sim \
              tools/checkpoint; do
  out=$("$binary" --help) || fail "$binary --help exited $?"
  [ -n "$out" ] || fail "$binary --help printed nothing"
  if grep -qE 'caffe2|--v=|logtostderr|--flagfile' <<<"$out"; then fail "$binary --help lists the libraries' flags"; fi
done
help=$(trainer/train --help)
for expected in '--config (string' '--nproc (int32, default: 0)' '--zero_stage (int32, default: 0)' \
                '--model_config.args.KEY' '--axis_order (string, default: "")' 'ZeRO inside each data-parallel group'; do
  grep -qF -- "$expected" <<<"$help" || fail "train --help lacks: $expected"
done
grep -qF -- '--nproc_per_node (int32' <<<"$(tools/launch --help)" || fail "launch --help lacks --nproc_per_node"
full=$(trainer/train --helpfull 2>&1 || true)
grep -q 'caffe2' <<<"$full" || fail "train --helpfull should keep the libraries' flags"
echo "help_test: every binary's --help lists its own flags"
