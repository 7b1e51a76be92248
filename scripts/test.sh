#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite: CPU tests, multi-rank tests on CPU ranks, the
# command-line tests; [gpu] tests report "skipped" where there is no GPU. Then the fuzz targets
# (scripts/fuzz.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# The Slurm test's daemons (tests/slurm/run.sh skips, saying why, where they cannot be installed).
slurm_pkgs=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${slurm_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})) && command -v apt-get > /dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "[test] installing ${missing[*]} for the Slurm test"
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null; } \
    || echo "[test] could not install Slurm; its test will be skipped"
fi
# The TensorBoard test reads mop's event files with the tensorboard package (it skips without).
if ! python3 -c "import tensorboard" 2> /dev/null; then
  echo "[test] installing tensorboard for the TensorBoard test"
  { python3 -m pip install --quiet tensorboard > /dev/null 2>&1 \
      || python3 -m pip install --quiet --user --break-system-packages tensorboard > /dev/null; } \
    || echo "[test] could not install tensorboard; its test will be skipped"
fi
build_dir=${MOP_BUILD_DIR:-build}
(cd "$build_dir" && ctest --output-on-failure -j "$(nproc)" "$@")
# The fuzz targets, MOP_FUZZ_SECONDS (default 60) each, after the full suite (not after a run
# narrowed by ctest arguments); MOP_FUZZ_SECONDS=0 leaves them out.
fuzz_seconds=${MOP_FUZZ_SECONDS:-60}
if (($# == 0)) && ((fuzz_seconds > 0)); then
  bash scripts/fuzz.sh "$fuzz_seconds"
fi
