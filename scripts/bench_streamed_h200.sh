#!/usr/bin/env bash
# Streamed against kept gradients on one H200 (issue: streamed gradients): q3moe-8l at 16K tokens
# on uniformly random tokens over the whole vocabulary, every segment's optimizer state on the
# host (optim.state_placement: host), with 8 micro-batches of one sequence per step and with 1;
# kept (optim.gradients: gpu) and streamed (host) one right after the other, planned with the
# calibrated one-GPU machine. Each run's log (its planned memory and predicted step beside the
# measured ones) and a summary line in OUT_DIR.
# Usage: scripts/bench_streamed_h200.sh BIN_DIR OUT_DIR   (STEPS per run, default 6;
#   MICRO_BATCHES, default "8 1")
set -uo pipefail
bin=${1:-build}
out=${2:-bench-streamed}
steps=${STEPS:-6}
mkdir -p "$out"
"$bin/mop" prepare-data --random-tokens 33554432 --vocab-size 151936 --output "$out/data/random" \
  > /dev/null || exit 1
for mb in ${MICRO_BATCHES:-8 1}; do
  for g in gpu host; do
    name="q3moe_random_s16384_mb${mb}_gradients_$g"
    "$bin/mop" train --config configs/q3moe-8l.yaml --set "data.paths=[$out/data/random]" --set data.eos_id=-1 \
      --set data.seq_len=16384 --set train.global_batch_size="$mb" --set train.micro_batch_size=1 \
      --set train.steps="$steps" --set optim.state_placement=host --set optim.gradients="$g" \
      --set train.machine=configs/machines/h200-1gpu.yaml \
      --set checkpoint.dir="$out/ckpt_$name" --set checkpoint.overwrite=true --set checkpoint.save_final=false \
      > "$out/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc | $(grep -E 'step +[0-9]+/' "$out/$name.log" | tail -n 1 | sed 's/.*| loss/loss/')" \
      | tee -a "$out/summary.txt"
    rm -rf "$out/ckpt_$name"
  done
done
