#!/usr/bin/env bash
# Progressive expert growth against a fixed expert count, over the same tokens: CONFIG as given
# (its moe.num_experts throughout) and grown by doubling from FROM experts (moe.growth_from) with
# the copies' optimizer moments copied, and started at zero. Prints each run's wall-clock, final
# held-out loss, tokens/s per stage, and the loss bump at each boundary (10-step means before and
# after) with the steps until the mean is back below the one before.
# Usage: scripts/growth_compare.sh MOP CONFIG FROM OUT RUNS [--set overrides...]
#   RUNS: a comma-separated subset of fixed,copy,fresh (the table covers every run under OUT, so
#   runs can be made by separate invocations); scripts/growth_cpu.sh and growth_h200.sh call it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mop=$1 config=$2 from=$3 out=$4 runs=$5
shift 5
mkdir -p "$out"
run() {  # run NAME OVERRIDES...
  local name=$1
  shift
  local sets=(--set "checkpoint.dir=$out/$name")
  for s in "$@"; do sets+=(--set "$s"); done
  rm -rf "${out:?}/$name" "$out/$name.log"
  local t0 t1
  t0=$(date +%s.%N)
  "$mop" train --config "$config" "${sets[@]}" > "$out/$name.log" 2>&1
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" "BEGIN { print b - a }" > "$out/$name.wall"
}
extra=()
while [ $# -gt 0 ]; do
  [ "$1" = --set ] && shift
  extra+=("$1")
  shift
done
for r in ${runs//,/ }; do
  case $r in
    fixed) run fixed "${extra[@]}" ;;
    copy) run growth-copy "moe.growth_from=$from" moe.growth_optimizer=copy "${extra[@]}" ;;
    fresh) run growth-fresh "moe.growth_from=$from" moe.growth_optimizer=fresh "${extra[@]}" ;;
    *) echo "growth_compare.sh: unknown run '$r' (fixed, copy, fresh)" >&2; exit 2 ;;
  esac
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
print("| run | wall-clock | final held-out loss | tokens/s per stage | loss bump at each boundary (10-step means) → steps to recover |")
print("|---|---|---|---|---|")
for name in ["fixed", "growth-copy", "growth-fresh"]:
    if not os.path.exists(f"{out}/{name}.wall"):
        continue
    wall = float(open(f"{out}/{name}.wall").read())
    m = {}
    for line in open(f"{out}/{name}/metrics.jsonl"):
        j = json.loads(line)
        m[j["step"]] = j
    steps = sorted(m)
    val = [m[s]["val_loss"] for s in steps if "val_loss" in m[s]]
    # stages from the log's growth lines: "growth: stage k of n: E experts ... for steps a–b"
    stages = []
    for line in open(f"{out}/{name}.log"):
        if "growth: stage" in line:
            a, b = line.split("for steps ")[1].split(",")[0].split("–")
            stages.append((int(a), int(b)))
    if not stages:
        stages = [(1, steps[-1])]
    tps = []
    for a, b in stages:
        sec = sum(m[s]["step_seconds"] for s in range(a, b + 1))
        tok = sum(m[s]["tokens"] for s in range(a, b + 1))
        tps.append(f"{tok / sec:,.0f}")
    bumps = []
    loss = [m[s]["loss"] for s in steps]
    for a, _ in stages[1:]:
        i = a - 1  # index of the first step after the boundary
        before = sum(loss[max(0, i - 10):i]) / min(10, i)
        after = sum(loss[i:i + 10]) / 10
        if after <= before:
            bumps.append(f"{before:.3f} → {after:.3f} (none)")
            continue
        back = next((k for k in range(i + 10, len(loss)) if sum(loss[k - 9:k + 1]) / 10 <= before), None)
        bumps.append(f"{before:.3f} → {after:.3f} ({back - i + 1 if back is not None else 'never'})")
    print(f"| {name} | {wall:.1f} s | {val[-1]:.4f} | {' / '.join(tps)} | {'; '.join(bumps) or '—'} |")
PY
