#!/usr/bin/env bash
# Progressive expert growth on one H200 (docs/growth.md): q3moe-8l's geometry
# (configs/q3moe-8l.yaml, 128 experts) on byte-level KJV with a 2% held-out split, 640 steps of
# 32,768 tokens (4 micro-batches of 4K), all state on the GPU; fixed 128 experts against grown
# 8 → 16 → 32 → 64 → 128 (moe.growth_from: 8, moments copied). One run fits a 10-minute call:
# Usage: scripts/growth_h200.sh [path/to/mop] fixed|copy|fresh[,...] [extra --set overrides...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mop=${1:-build/mop}
runs=${2:-fixed,copy}
shift 2 || shift $#
exec scripts/growth_compare.sh "$mop" configs/q3moe-8l.yaml 8 runs/growth-h200 "$runs" \
  --set train.steps=640 --set train.micro_batch_size=4 --set data.valid_fraction=0.02 \
  --set train.eval_interval=640 --set train.eval_batches=5 --set log.interval=1 --set optim.warmup_steps=20 "$@"
