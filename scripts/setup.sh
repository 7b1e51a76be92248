#!/usr/bin/env bash
# Set up a fresh Debian 12 / Ubuntu 24.04 machine for MoP and build it. Idempotent: installs only
# what is missing, fetches the cuDNN frontend and CUTLASS headers once (when nvcc is present),
# builds into build/, and prepares the default corpus (the King James Bible from Debian's
# bible-kjv packages) as data/kjv.{bin,idx}. Quiet when everything is already there.
#   MOP_BUILD_DIR  build directory (default: build)
#   MOP_CMAKE_ARGS extra CMake arguments (e.g. -DMOP_CUDA=OFF)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build_dir=${MOP_BUILD_DIR:-build}

say() { echo "[setup] $*"; }

# 1. System packages.
pkgs=(build-essential cmake ninja-build pkg-config python3 python3-pip python3-venv
      libyaml-cpp-dev libspdlog-dev libfmt-dev libcli11-dev catch2 libopenmpi-dev openmpi-bin
      libpcre2-dev libicu-dev bible-kjv bible-kjv-text)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. cuDNN frontend headers (header-only C++ API) from the nvidia-cudnn-frontend wheel.
nvcc_bin=$(command -v nvcc || true)
[ -n "$nvcc_bin" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc_bin=/usr/local/cuda/bin/nvcc; } || true
if [ -n "$nvcc_bin" ] && [ ! -f third_party/cudnn_frontend/include/cudnn_frontend.h ]; then
  say "fetching the cuDNN frontend headers into third_party/cudnn_frontend"
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" nvidia-cudnn-frontend
  python3 - "$tmp" <<'PY'
import glob, os, sys, zipfile
whl = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
out = "third_party/cudnn_frontend/include"
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        # Headers sit under include/ (at the wheel's top level or inside a package folder).
        i = ("/" + name).find("/include/")
        if i >= 0 and name.endswith((".h", ".hpp")):
            dst = os.path.join(out, name[i + len("include/"):])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "wb") as f:
                f.write(z.read(name))
PY
  rm -rf "$tmp"
  [ -f third_party/cudnn_frontend/include/cudnn_frontend.h ] || { echo "cuDNN frontend headers not found in the wheel" >&2; exit 1; }
fi

# 2b. CUTLASS / CuTe headers (header-only; the Hopper grouped expert GEMMs of
# kernels/grouped_gemm_sm90.cu) from the nvidia-cutlass wheel, which carries them under
# cutlass_library/source/include/{cutlass,cute}.
if [ -n "$nvcc_bin" ] && [ ! -f third_party/cutlass/include/cutlass/cutlass.h ]; then
  say "fetching the CUTLASS headers into third_party/cutlass"
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" nvidia-cutlass
  python3 - "$tmp" <<'PY'
import glob, os, sys, zipfile
whl = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
src, out = "cutlass_library/source/include/", "third_party/cutlass/include"
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(src) and name.endswith((".h", ".hpp", ".inl")):
            dst = os.path.join(out, name[len(src):])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "wb") as f:
                f.write(z.read(name))
PY
  rm -rf "$tmp"
  [ -f third_party/cutlass/include/cutlass/cutlass.h ] || { echo "CUTLASS headers not found in the wheel" >&2; exit 1; }
fi

# 3. Build.
if [ ! -f "$build_dir/build.ninja" ]; then
  cuda_args=()
  if [ -n "$nvcc_bin" ]; then cuda_args+=(-DCMAKE_CUDA_COMPILER="$nvcc_bin"); fi
  say "configuring $build_dir"
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${cuda_args[@]}" ${MOP_CMAKE_ARGS:-} >/dev/null
fi
if ! ninja -C "$build_dir" -n 2>/dev/null | grep -q "no work to do"; then
  say "building in $build_dir (log: $build_dir/build.log)"
  if ! cmake --build "$build_dir" > "$build_dir/build.log" 2>&1; then
    tail -n 60 "$build_dir/build.log" >&2
    echo "[setup] build failed; full log in $build_dir/build.log" >&2
    exit 1
  fi
fi

# 4. Default corpus.
if [ ! -f data/kjv.idx ]; then
  mkdir -p data
  bible gen1:1-rev22:21 > data/kjv.txt
  "$build_dir/mop" prepare-data --input data/kjv.txt --output data/kjv --split blank-line
fi
