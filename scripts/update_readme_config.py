#!/usr/bin/env python3
"""Regenerates the configuration table of docs/configuration.md from `mop config-reference` (usage: BIN [FILE])."""
import subprocess
import sys

mop = sys.argv[1] if len(sys.argv) > 1 else "build/mop"
path = sys.argv[2] if len(sys.argv) > 2 else "docs/configuration.md"
table = subprocess.run([mop, "config-reference"], check=True, capture_output=True, text=True).stdout
lines = open(path, encoding="utf-8").read().split("\n")
start = lines.index("| key | type | default | meaning |")
end = start
while end < len(lines) and lines[end].startswith("|"):
    end += 1
lines[start:end] = table.rstrip("\n").split("\n")
open(path, "w", encoding="utf-8").write("\n".join(lines))
