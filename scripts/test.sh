#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite: CPU tests, multi-rank tests on CPU ranks, the
# command-line tests; [gpu] tests report "skipped" where there is no GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
build_dir=${MOP_BUILD_DIR:-build}
cd "$build_dir"
ctest --output-on-failure -j "$(nproc)" "$@"
