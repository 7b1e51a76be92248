#!/usr/bin/env bash
# Two builds of mop on one machine, one run right after the other: q3moe-8l on uniformly random
# tokens (scripts/bench_h200.sh's runs), alternating A, B, A, B … per sequence length, so a
# before/after comparison of a change sees the same GPU, clock and power cap. Each run's log and
# the summary lines land in OUT_DIR/A and OUT_DIR/B.
# Usage: scripts/compare_h200.sh BIN_A BIN_B OUT_DIR   (each BIN_* holds a mop binary)
#   RUNS     SEQ:MICRO runs (default "4096:4 16384:1"), PAIRS pairs of each (default 2),
#   STEPS    training steps per run (default 12; the steady state is the last steps),
#   SET_A, SET_B  extra `mop train` options of each side (one binary, two settings: pass the
#            same BIN twice).
set -uo pipefail
a=${1:?BIN_A} b=${2:?BIN_B} out=${3:?OUT_DIR}
pairs=${PAIRS:-2}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for r in ${RUNS:-"4096:4 16384:1"}; do
  for i in $(seq "$pairs"); do
    for side in A B; do
      bin=$a set=${SET_A:-}
      [ "$side" = B ] && bin=$b set=${SET_B:-}
      echo "== $side ($bin) $r, pair $i" | tee -a "$out/summary.txt"
      MOP_SET=$set PARTS=random RUNS=$r STEPS=${STEPS:-12} bash "$here/bench_h200.sh" "$bin" "$out/$side" \
        | tee -a "$out/summary.txt"
      # Keep each run's log (bench_h200.sh names it by data and shape only).
      for f in "$out/$side"/q3moe_*.log; do [[ $f == *.pair*.log ]] || mv "$f" "${f%.log}.pair$i.log"; done
      rm -rf "$out/$side"/ckpt_*
    done
  done
done
