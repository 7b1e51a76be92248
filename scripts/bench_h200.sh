#!/usr/bin/env bash
# The GPU measurements of README: [gpu] parity tests, kernel benchmarks (each validates first),
# and q3moe-8l training throughput at sequence 4096 and 16384 (32,768 tokens per step).
# Usage: scripts/bench_h200.sh BIN_DIR OUT_DIR   (BIN_DIR holds mop, mop_tests, mop_bench)
set -uo pipefail
bin=${1:-build}
out=${2:-bench-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
export MOP_BINARY="$bin/mop"
"$bin/mop_tests" "[gpu]" > "$out/gpu_tests.log" 2>&1; echo "gpu tests: exit $?" | tee -a "$out/summary.txt"
"$bin/mop_bench" > "$out/bench.log" 2>&1; echo "mop_bench: exit $?" | tee -a "$out/summary.txt"
for seq in 4096 16384; do
  gbs=$((32768 / seq))
  "$bin/mop" train --config configs/q3moe-8l.yaml --set data.seq_len=$seq \
    --set train.global_batch_size=$gbs --set train.steps=${STEPS:-12} \
    > "$out/q3moe_s$seq.log" 2>&1
  echo "q3moe-8l seq $seq: exit $?" | tee -a "$out/summary.txt"
done
