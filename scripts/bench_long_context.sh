#!/usr/bin/env bash
# Long-context benchmark (docs/long-context.md): q3moe-8l, one
# sequence per optimizer step, uniformly random tokens over the whole vocabulary, recompute on,
# everything else the plan's choice for the machine (MoE/FFN chunks, which layers keep their
# attention, which saved tensors go to host memory, where the optimizer state lives).
#
#   scripts/bench_long_context.sh BUILD_DIR OUT_DIR [TOKENS:LAYERS:STEPS ...]
#
# Default runs: 131072:8:4 262144:8:3 524288:8:3 1048576:4:1 (one 8-layer step at 1M tokens is
# about ten minutes; `mop plan` gives its prediction). Each run's log is OUT_DIR/long_<S>_<L>l.log
# (OUT_DIR/long_<S>_<L>l_<TAG>.log with MOP_BENCH_TAG=TAG). MOP_BENCH_SET="key=value ..." adds
# --set overrides to every run (e.g. train.attention_tile=0 for whole-sequence attention).
set -u
if [ $# -lt 2 ]; then
  echo "usage: $0 BUILD_DIR OUT_DIR [TOKENS:LAYERS:STEPS ...]" >&2
  exit 2
fi
bin=$1 out=$2
shift 2
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(131072:8:4 262144:8:3 524288:8:3 1048576:4:1)
mkdir -p "$out"
data=${MOP_BENCH_DATA:-/tmp/mop_random_tokens.bin}
[ -f "$data" ] || python3 -c "import numpy as np; np.random.default_rng(0).integers(0, 151936, size=8_000_000, dtype=np.uint32).tofile('$data')"
machine=()
[ -n "${MOP_MACHINE:-}" ] && machine=(--machine "$MOP_MACHINE")
extra=()
for kv in ${MOP_BENCH_SET:-}; do extra+=(--set "$kv"); done
tag=${MOP_BENCH_TAG:+_$MOP_BENCH_TAG}
for run in "${runs[@]}"; do
  IFS=: read -r seq layers steps <<< "$run"
  log="$out/long_${seq}_${layers}l${tag}.log"
  # Generous limit: steps × (the plan's step time at H200 rates) plus start-up.
  timeout "${MOP_BENCH_TIMEOUT:-590}" "$bin/mop" train --config configs/q3moe-8l.yaml "${machine[@]}" \
    --set "data.paths=[$data]" --set data.format=flat --set data.flat_dtype=uint32 --set data.eos_id=-1 \
    --set data.seq_len="$seq" --set model.num_layers="$layers" --set train.steps="$steps" \
    --set train.global_batch_size=1 --set train.recompute=true --set optim.state_placement=auto \
    --set train.lm_head_chunk=1024 --set log.interval=1 --set checkpoint.dir="/tmp/mop_long_$seq" \
    --set checkpoint.save_final=false --set checkpoint.overwrite=true "${extra[@]}" > "$log" 2>&1
  echo "$seq tokens, $layers layers, $steps steps${MOP_BENCH_SET:+ (${MOP_BENCH_SET})}: exit $?" | tee -a "$out/summary.txt"
  grep -E "attention:|activations:|memory|step +[0-9]+/|model .*MFU" "$log" | tail -9 | tee -a "$out/summary.txt"
done
