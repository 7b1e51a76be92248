#!/usr/bin/env bash
# The multi-GPU measurements of docs/benchmarks.md (one host, N GPUs, NCCL_NVLS_ENABLE=0):
#   comm: the [mpi] parity tests on GPU ranks (N GPUs vs 1, bf16 tolerances; the measured
#         differences are printed as warnings) and the all-to-all benchmark (expert dispatch vs
#         NCCL's all-to-all at q3moe-8l's message sizes);
#   ep:   q3moe-8l with the experts sharded over N GPUs (attention data-parallel), 2 sequences
#         per GPU per step, at sequence 16K and 32K;
#   cp:   q3moe-8l with the sequence sharded over N GPUs (Ulysses, experts sharded too), two
#         sequences per step, at sequence 16K up to 64K;
#   cpr:  the same with train.recompute (only layer inputs kept) at 128K and 256K;
#   ring: cp with ring attention instead of Ulysses (parallel.attention.impl: ring) at 16K, 32K.
# Usage: scripts/bench_multi_gpu.sh BIN_DIR OUT_DIR [comm|ep|cp|cpr|ring ...]  (BIN_DIR: mop, mop_tests)
# Environment: STEPS (8), RUN_TIMEOUT (240 s per run), NGPU, EP_SEQS, CP_SEQS, CPR_SEQS, RING_SEQS,
# and EXTRA ("--set key=value ..." added to every training run).
set -uo pipefail
bin=${1:-build}
out=${2:-bench-out}
shift 2 || true
parts=${*:-comm ep cp cpr}
n=${NGPU:-$(nvidia-smi -L | wc -l)}
mkdir -p "$out"
export MOP_BINARY="$bin/mop" NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
run() { mpirun -np "$n" --bind-to none -x OMP_NUM_THREADS -x MOP_BINARY \
          -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH "$@"; }
train() {  # name, then --set overrides
  local name=$1; shift
  timeout "${RUN_TIMEOUT:-240}" bash -c "$(declare -f run); n=$n; run \"$bin/mop\" train \
    --config configs/q3moe-8l.yaml --set train.steps=${STEPS:-8} $* ${EXTRA:-}" > "$out/$name.log" 2>&1
  echo "$name: exit $? $(grep -E 'step +[0-9]+/' "$out/$name.log" | tail -1)" | tee -a "$out/summary.txt"
}
for part in $parts; do
  case $part in
    comm)
      MOP_TEST_DEVICE=cuda timeout 240 bash -c "$(declare -f run); n=$n; run -x MOP_TEST_DEVICE \"$bin/mop_tests\" \"[mpi]\"" > "$out/mpi_gpu.log" 2>&1
      echo "[mpi] on $n GPUs: exit $?" | tee -a "$out/summary.txt"
      timeout 120 bash -c "$(declare -f run); n=$n; run \"$bin/mop_bench\" alltoall" > "$out/alltoall.log" 2>&1
      echo "all-to-all benchmark: exit $?" | tee -a "$out/summary.txt" ;;
    ep)
      for seq in ${EP_SEQS:-16384 32768}; do
        train "ep${n}_s$seq" --set data.seq_len=$seq --set train.global_batch_size=$((2 * n)) \
          --set parallel.attention.dp=$n --set parallel.moe.ep=$n
      done ;;
    cp)
      for seq in ${CP_SEQS:-16384 32768 65536}; do
        train "cp${n}_s$seq" --set data.seq_len=$seq --set train.global_batch_size=2 \
          --set parallel.attention.cp=$n --set parallel.moe.ep=$n
      done ;;
    cpr)
      for seq in ${CPR_SEQS:-131072 262144}; do
        train "cp${n}_recompute_s$seq" --set data.seq_len=$seq --set train.global_batch_size=2 \
          --set parallel.attention.cp=$n --set parallel.moe.ep=$n --set train.recompute=true
      done ;;
    ring)
      for seq in ${RING_SEQS:-16384 32768}; do
        train "ring${n}_s$seq" --set data.seq_len=$seq --set train.global_batch_size=2 \
          --set parallel.attention.cp=$n --set parallel.moe.ep=$n --set parallel.attention.impl=ring
      done ;;
  esac
done
