#!/usr/bin/env bash
# Progressive expert growth against a fixed expert count on the CPU, over the same tokens:
# configs/growth-cpu.yaml as given (32 experts throughout), then grown 4 → 8 → 16 → 32
# (moe.growth_from: 4) with the copies' optimizer moments copied, and started at zero. Prints
# each run's wall-clock, final held-out loss, tokens/s per stage, and the loss bump at each
# boundary (10-step means before and after) with the steps until the mean is back below the one
# before. Usage: scripts/growth_cpu.sh [path/to/mop] [extra --set overrides...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mop=${1:-build/mop}
shift || true
out=runs/growth-cpu
rm -rf "$out"
mkdir -p "$out"
run() {  # run NAME OVERRIDES...
  local name=$1
  shift
  local sets=(--set "checkpoint.dir=$out/$name")
  for s in "$@"; do sets+=(--set "$s"); done
  local t0 t1
  t0=$(date +%s.%N)
  "$mop" train --config configs/growth-cpu.yaml "${sets[@]}" > "$out/$name.log" 2>&1
  t1=$(date +%s.%N)
  echo "$name $(echo "$t1 - $t0" | bc)" >> "$out/wall.txt"
}
run fixed "$@"
run growth-copy moe.growth_from=4 moe.growth_optimizer=copy "$@"
run growth-fresh moe.growth_from=4 moe.growth_optimizer=fresh "$@"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
wall = dict(l.split() for l in open(f"{out}/wall.txt"))
print("| run | wall-clock | final held-out loss | tokens/s per stage | loss bump at each boundary (10-step means) → steps to recover |")
print("|---|---|---|---|---|")
for name in ["fixed", "growth-copy", "growth-fresh"]:
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
        before = sum(loss[i - 10:i]) / 10
        after = sum(loss[i:i + 10]) / 10
        back = next((k for k in range(i + 10, len(loss)) if sum(loss[k - 9:k + 1]) / 10 <= before), None)
        bumps.append(f"{before:.3f} → {after:.3f} ({back - i + 1 if back is not None else 'never'})")
    print(f"| {name} | {float(wall[name]):.1f} s | {val[-1]:.4f} | {' / '.join(tps)} | {'; '.join(bumps) or '—'} |")
PY
