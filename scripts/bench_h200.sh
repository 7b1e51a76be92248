#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md: [gpu] parity tests, kernel benchmarks (each validates first),
# and q3moe-8l training throughput at sequence 4096 and 16384 (32,768 tokens per step) — on
# uniformly random tokens over the whole vocabulary first (balanced routing, what the FSDP2
# baseline trains on), then on the byte-level KJV corpus beside it — and the FSDP2 baseline on the
# same machine right after, where torch and transformers are installed.
# Usage: scripts/bench_h200.sh BIN_DIR OUT_DIR   (BIN_DIR holds mop, mop_tests, mop_bench)
#   PARTS  which parts to run (default "tests kernels random kjv fsdp2")
#   STEPS  training steps per run (default 12; the log's last steps are the steady state)
#   RUNS   the q3moe-8l runs, SEQ:MICRO each (default "4096:4 4096:1 16384:1")
#   MOP_SET  extra `mop train` options for every run (e.g. "--set parallel.shard=slice")
set -uo pipefail
bin=${1:-build}
out=${2:-bench-out}
parts=${PARTS:-tests kernels random kjv fsdp2}
steps=${STEPS:-12}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
export MOP_BINARY="$bin/mop"
has() { [[ " $parts " == *" $1 "* ]]; }

# The GPU's SM clock and power while a part runs (nvidia-smi every 200 ms; the medians over the
# samples with the GPU busy): training holds the H200 at its 700 W cap, below the clock the short
# kernel benchmarks run at, so kernel rates measured alone overstate those inside a step.
smi_start() {
  nvidia-smi --query-gpu=clocks.sm,power.draw,utilization.gpu --format=csv,noheader,nounits \
    -lms 200 > "$1" 2> /dev/null &
  smi_pid=$!
}
smi_stop() {
  kill "$smi_pid" 2> /dev/null
  wait "$smi_pid" 2> /dev/null
  local median='{a[NR] = $1} END {if (NR) print a[int((NR + 1) / 2)]}'
  local c p
  c=$(awk -F', *' '$3 > 50 {print $1}' "$1" | sort -n | awk "$median")
  p=$(awk -F', *' '$3 > 50 {print $2}' "$1" | sort -n | awk "$median")
  [ -n "$c" ] && echo " | SM clock $c MHz, power $p W (medians while busy)"
}

if has tests; then
  "$bin/mop_tests" "[gpu]" > "$out/gpu_tests.log" 2>&1; echo "gpu tests: exit $?" | tee -a "$out/summary.txt"
fi
if has kernels; then
  smi_start "$out/smi_bench.csv"
  "$bin/mop_bench" > "$out/bench.log" 2>&1
  rc=$?
  echo "mop_bench: exit $rc$(smi_stop "$out/smi_bench.csv")" | tee -a "$out/summary.txt"
fi

# train DATA SEQ MICRO [mop train options]: one q3moe-8l run with micro-batches of MICRO
# sequences, its log in OUT/q3moe_DATA_sSEQ_mbMICRO.log.
train() {
  local data=$1 seq=$2 micro=$3
  shift 3
  local name="q3moe_${data}_s${seq}_mb$micro"
  smi_start "$out/smi_$name.csv"
  "$bin/mop" train --config configs/q3moe-8l.yaml --set data.seq_len="$seq" \
    --set train.global_batch_size=$((32768 / seq)) --set train.micro_batch_size="$micro" \
    --set train.steps="$steps" --set checkpoint.dir="$out/ckpt_$name" --set checkpoint.overwrite=true \
    "$@" ${MOP_SET:-} > "$out/$name.log" 2>&1
  local rc=$?
  echo "q3moe-8l $data seq $seq micro-batch $micro: exit $rc | $(grep -E 'step +[0-9]+/' "$out/$name.log" | tail -n 1 | sed 's/.*| loss/loss/')$(smi_stop "$out/smi_$name.csv")" \
    | tee -a "$out/summary.txt"
}
# At 4K, micro-batches of 4 sequences (1,024 rows per expert: the experts' fp32 weight-gradient
# accumulation costs a quarter as much per token as with one; 118 GiB) and of 1 beside; at 16K 1.
runs=${RUNS:-"4096:4 4096:1 16384:1"}

if has random; then
  # 64M ids over Qwen's 151,936-token vocabulary (int32), enough for every run here.
  "$bin/mop" prepare-data --random-tokens 67108864 --vocab-size 151936 --output "$out/data/random" \
    > /dev/null || exit 1
  for r in $runs; do
    train random "${r%:*}" "${r#*:}" --set "data.paths=[$out/data/random]" --set data.eos_id=-1
  done
fi
if has kjv; then
  [ -f data/kjv.bin ] || echo "kjv: data/kjv.bin missing (scripts/setup.sh prepares it)" | tee -a "$out/summary.txt"
  for r in $runs; do train kjv "${r%:*}" "${r#*:}"; done
fi
if has fsdp2; then
  if python3 -c "import torch, transformers" 2> /dev/null; then
    for run in "4096 6" "16384 5 --checkpointing"; do
      set -- $run
      smi_start "$out/smi_fsdp2_s$1.csv"
      python3 scripts/fsdp2_baseline.py --seq "$1" --steps "$2" ${3:-} > "$out/fsdp2_s$1.log" 2>&1
      echo "$(tail -n 1 "$out/fsdp2_s$1.log")$(smi_stop "$out/smi_fsdp2_s$1.csv")" | tee -a "$out/summary.txt"
    done
  else
    echo "fsdp2: torch or transformers not installed; baseline skipped" | tee -a "$out/summary.txt"
  fi
fi
