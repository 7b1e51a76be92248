#!/usr/bin/env bash
# Progressive expert growth against a fixed expert count on the CPU (docs/growth.md, "Progressive expert
# growth"): configs/growth-cpu.yaml as given (32 experts throughout), then grown 4 → 8 → 16 → 32
# with the copies' moments copied, and started at zero (scripts/growth_compare.sh).
# Usage: scripts/growth_cpu.sh [path/to/mop] [extra --set overrides...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mop=${1:-build/mop}
shift || true
exec scripts/growth_compare.sh "$mop" configs/growth-cpu.yaml 4 runs/growth-cpu fixed,copy,fresh "$@"
