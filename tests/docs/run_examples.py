#!/usr/bin/env python3
"""Runs the command examples of README.md and docs/*.md, so that they cannot rot.

Every fenced block that opens with ```bash must be marked by an HTML comment on the line directly
before its opening fence:

  <!-- example: run -->      run as written
  <!-- example: ci -->       the test command itself (scripts/test.sh): not run, it is what runs this
  <!-- example: gpu -->      needs an NVIDIA GPU (an H200 recipe, minutes to hours): run as written
                             only where `nvidia-smi -L` lists one and MOP_GPU_EXAMPLES=1 asks for it
  <!-- example: cluster -->  needs several GPUs, nodes or Slurm: never run here
  <!-- example: download --> downloads from the network (a package, a published model's files):
                             never run here, where the network may not be reachable
  <!-- example: variant
  commands that run instead (a small version of the block)
  -->

A bash block without a marker is an error, so that a new example cannot be added unrun. Blocks
marked run or variant run with `bash -euo pipefail -c` in the repository root, with the directory
of the mop binary first on PATH (a bare `mop` works), and `./build/mop` works too: where
REPO/build/mop does not exist, a symlink to the binary is made there for the run and removed after.
Examples write under the ignored runs/, checkpoints/ and data/; the KJV corpus data/kjv.{bin,idx}
and data/kjv.txt are what scripts/setup.sh prepares.

Usage: run_examples.py [REPO_ROOT [BIN_DIR]] [--list] [--only TEXT]
  REPO_ROOT  default: this script's ../..      BIN_DIR  the mop binary's directory (default REPO_ROOT/build)
  --list     print each block and its kind; run nothing
  --only     run only the blocks whose file:line contains TEXT
Exit 1 when a block is unmarked or badly marked, or when one that ran failed (its output's tail is
shown)."""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time

KINDS = ("run", "ci", "gpu", "cluster", "download", "variant")
MARK = re.compile(r"^<!--\s*example:\s*(\S+)\s*-->\s*$")
VARIANT_OPEN = re.compile(r"^<!--\s*example:\s*variant\s*$")
BLOCK_TIMEOUT_S = 600
TAIL_LINES = 40


class Block:
    def __init__(self, path, line, kind, body, commands):
        self.path, self.line, self.kind, self.body, self.commands = path, line, kind, body, commands

    def where(self, root):
        return f"{os.path.relpath(self.path, root)}:{self.line}"


def parse(path, root):
    """The bash blocks of one Markdown file, and the errors of their markers."""
    lines = open(path, encoding="utf-8").read().split("\n")
    blocks, errors, i = [], [], 0
    rel = os.path.relpath(path, root)
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped.startswith("```"):
            i += 1
            continue
        opening = i  # a fence opens here; the next fence line closes it
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        if re.match(r"^```bash\s*$", stripped):
            body = "\n".join(lines[opening + 1:end]) + "\n"
            kind, commands, error = marker(lines, opening)
            if error:
                errors.append(f"{rel}:{opening + 1}: {error}")
            else:
                blocks.append(Block(path, opening + 1, kind, body, commands))
        i = end + 1
    return blocks, errors


def marker(lines, opening):
    """(kind, the commands to run, error) from the comment right before the fence at `opening`."""
    if opening == 0:
        return None, None, "a ```bash block without an <!-- example: KIND --> marker on the line before it"
    before = lines[opening - 1].strip()
    m = MARK.match(before)
    if m:
        kind = m.group(1)
        if kind not in KINDS or kind == "variant":
            return None, None, (f"unknown example kind '{kind}' (run, ci, gpu, cluster, download, or a "
                                "variant comment of several lines)")
        return kind, None, None
    if before == "-->":
        j = opening - 2
        while j >= 0 and not lines[j].strip().startswith("<!--"):
            j -= 1
        if j >= 0 and VARIANT_OPEN.match(lines[j].strip()):
            commands = "\n".join(lines[j + 1:opening - 1]).strip()
            if not commands:
                return None, None, "an empty variant: give the commands that run instead"
            return "variant", commands + "\n", None
    return None, None, "a ```bash block without an <!-- example: KIND --> marker on the line before it"


def has_gpu():
    if not shutil.which("nvidia-smi"):
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(line.startswith("GPU ") for line in out.splitlines())


def run(script, root, env):
    """(ok, seconds, output) of one script under bash -euo pipefail in the repository root."""
    start = time.monotonic()
    try:
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=root, env=env,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=BLOCK_TIMEOUT_S)
        ok, out = p.returncode == 0, p.stdout.decode("utf-8", "replace")
        if not ok:
            out += f"\n[exit status {p.returncode}]"
    except subprocess.TimeoutExpired as e:
        ok = False
        out = (e.stdout or b"").decode("utf-8", "replace") + f"\n[killed after {BLOCK_TIMEOUT_S} s]"
    return ok, time.monotonic() - start, out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("repo", nargs="?", default=os.path.join(here, "..", ".."))
    ap.add_argument("bin_dir", nargs="?")
    ap.add_argument("--list", action="store_true", help="print each block and its kind; run nothing")
    ap.add_argument("--only", help="run only the blocks whose file:line contains this text")
    a = ap.parse_args()
    root = os.path.abspath(a.repo)
    bin_dir = os.path.abspath(a.bin_dir or os.path.join(root, "build"))

    files = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    blocks, errors = [], []
    for path in files:
        if os.path.isfile(path):
            b, e = parse(path, root)
            blocks += b
            errors += e
    for e in errors:
        print(f"error: {e}")
    if errors:
        print(f"{len(errors)} unmarked or badly marked block(s); see tests/docs/run_examples.py for the markers")
        return 1

    if a.list:
        for b in blocks:
            print(f"{b.where(root)}  {b.kind}")
            shown = b.commands if b.kind == "variant" else b.body
            for line in shown.rstrip("\n").split("\n"):
                print(f"    {line}")
        return 0

    if a.only:
        blocks = [b for b in blocks if a.only in b.where(root)]
    if not os.path.isfile(os.path.join(bin_dir, "mop")):
        print(f"error: no mop binary in {bin_dir}")
        return 1
    # The GPU recipes are measurements that take minutes to hours: only when asked for.
    want_gpu = os.environ.get("MOP_GPU_EXAMPLES") == "1"
    gpu = want_gpu and any(b.kind == "gpu" for b in blocks) and has_gpu()
    env = dict(os.environ)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")

    # ./build/mop in the examples: a symlink to the binary for the run where there is none.
    made_dir = made_link = None
    build = os.path.join(root, "build")
    if not os.path.exists(os.path.join(build, "mop")):
        if not os.path.isdir(build):
            os.makedirs(build)
            made_dir = build
        made_link = os.path.join(build, "mop")
        os.symlink(os.path.join(bin_dir, "mop"), made_link)

    passed = failed = skipped = 0
    total_start = time.monotonic()
    try:
        for b in blocks:
            where = b.where(root)
            if b.kind == "ci":
                print(f"not run (the test command itself, which runs this): {where}")
                skipped += 1
                continue
            if b.kind == "cluster":
                print(f"not run (needs several GPUs or nodes, or Slurm): {where}")
                skipped += 1
                continue
            if b.kind == "download":
                print(f"not run (downloads from the network): {where}")
                skipped += 1
                continue
            if b.kind == "gpu" and not gpu:
                why = "MOP_GPU_EXAMPLES=1 not set" if not want_gpu else "no GPU"
                print(f"skipped ({why}): {where}")
                skipped += 1
                continue
            script = b.commands if b.kind == "variant" else b.body
            print(f"{where}  {b.kind} ...", flush=True)
            ok, seconds, out = run(script, root, env)
            print(f"{where}  {b.kind}  {'ok' if ok else 'FAILED'}  {seconds:.1f} s", flush=True)
            if ok:
                passed += 1
            else:
                failed += 1
                tail = out.rstrip("\n").split("\n")[-TAIL_LINES:]
                print(f"--- the last {len(tail)} lines of its output:")
                print("\n".join(tail))
                print("---")
    finally:
        if made_link:
            os.remove(made_link)
        if made_dir:
            os.rmdir(made_dir)
    print(f"examples: {time.monotonic() - total_start:.1f} s")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
