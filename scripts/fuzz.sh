#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ (clang, AddressSanitizer and UBSan, CPU only; only the
# parsers are compiled) and runs each for SECONDS (default 60) from its seed corpus, with bounded
# input size, memory and time per input. Fails when a target found a crash, a leak, a timeout or an
# out-of-memory; the input is kept as fuzz/regressions/<target>/<kind>-<sha1>, which
# tests/fuzz/fuzz_regressions_test.cpp replays once it is committed with the fix.
#   scripts/fuzz.sh [SECONDS] [TARGET...]     (targets: json safetensors manifest tokenizer config
#                                              megatron_idx; default all)
#   MOP_FUZZ_BUILD_DIR  build directory (default: build-fuzz); it keeps the grown corpus between runs
# The libraries (yaml-cpp, spdlog, PCRE2, ICU) are scripts/setup.sh's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=${1:-60}
shift $(($# > 0 ? 1 : 0))
targets=("$@")
((${#targets[@]})) || targets=(json safetensors manifest tokenizer config megatron_idx)
build_dir=${MOP_FUZZ_BUILD_DIR:-build-fuzz}

say() { echo "[fuzz] $*"; }

# Largest input per target: a few times the largest seed.
max_len() {
  case $1 in
    tokenizer) echo 8192 ;;
    megatron_idx) echo 1024 ;;
    *) echo 4096 ;;
  esac
}

apt_install() {
  command -v apt-get > /dev/null || { echo "[fuzz] need $*, and there is no apt-get" >&2; exit 1; }
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  say "installing $*"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" > /dev/null
}

# 1. clang and its libFuzzer runtime: Debian 12's clang is 14 (libclang-rt-14-dev), Ubuntu 24.04's
# 18 (libclang-rt-18-dev). A one-line fuzzer that links proves both are there.
command -v clang++ > /dev/null || apt_install clang
links_a_fuzzer() {
  local tmp
  tmp=$(mktemp -d)
  echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' > "$tmp/probe.cpp"
  clang++ -fsanitize=fuzzer,address,undefined "$tmp/probe.cpp" -o "$tmp/probe" > /dev/null 2>&1
  local rc=$?
  rm -rf "$tmp"
  return $rc
}
if ! links_a_fuzzer; then
  version=$(clang++ --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n 1)
  apt_install "libclang-rt-${version}-dev"
  links_a_fuzzer || { echo "[fuzz] clang++ $version cannot link a libFuzzer target" >&2; exit 1; }
fi

# 2. Build.
if [ ! -f "$build_dir/build.ninja" ]; then
  say "configuring $build_dir"
  cmake -S . -B "$build_dir" -G Ninja -DMOP_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
fi
say "building in $build_dir"
start=$SECONDS
if ! cmake --build "$build_dir" > "$build_dir/build.log" 2>&1; then
  tail -n 40 "$build_dir/build.log" >&2
  echo "[fuzz] build failed; full log in $build_dir/build.log" >&2
  exit 1
fi
say "built in $((SECONDS - start)) s"

# 3. Run, with the target's dictionary (fuzz/<target>.dict). New inputs go to
# $build_dir/corpus/<target>, read again next time with the seeds and the kept inputs; findings to
# $build_dir/artifacts/<target>/.
failed=()
for t in "${targets[@]}"; do
  [ -x "$build_dir/${t}_fuzz" ] || { echo "[fuzz] no target $t" >&2; exit 1; }
  work="$build_dir/corpus/$t" artifacts="$build_dir/artifacts/$t"
  rm -rf "$artifacts"
  mkdir -p "$work" "$artifacts"
  log="$build_dir/$t.log"
  say "$t: ${seconds} s (log: $log)"
  rc=0
  # The kept inputs run first with the seeds, under the sanitizers.
  dirs=("$work" "fuzz/corpus/$t")
  [ ! -d "fuzz/regressions/$t" ] || dirs+=("fuzz/regressions/$t")
  UBSAN_OPTIONS=print_stacktrace=1 "$build_dir/${t}_fuzz" "${dirs[@]}" \
    -max_total_time="$seconds" -max_len="$(max_len "$t")" -rss_limit_mb=2048 -timeout=10 \
    -dict="fuzz/$t.dict" -artifact_prefix="$artifacts/" -print_final_stats=1 > "$log" 2>&1 || rc=$?
  grep -E "^stat::number_of_executed_units|^#[0-9]+ *DONE" "$log" | sed "s/^/[fuzz] $t: /" || true
  found=$(find "$artifacts" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' \
    -o -name 'oom-*' \) 2> /dev/null)
  if [ "$rc" -ne 0 ] || [ -n "$found" ]; then
    failed+=("$t")
    grep -E -A 30 "^==[0-9]+==|^fuzz: |runtime error|ERROR: libFuzzer" "$log" | head -n 60 >&2 || tail -n 40 "$log" >&2
    mkdir -p "fuzz/regressions/$t"
    for f in $found; do
      cp "$f" "fuzz/regressions/$t/"
      echo "[fuzz] $t: kept fuzz/regressions/$t/$(basename "$f"); reproduce:" \
        "$build_dir/${t}_fuzz fuzz/regressions/$t/$(basename "$f")" >&2
    done
    [ -n "$found" ] || echo "[fuzz] $t exited with $rc and saved no input; see $log" >&2
  fi
done
if ((${#failed[@]})); then
  echo "[fuzz] FAILED: ${failed[*]}; fix the parser (bad input must be a UserError), commit the" \
    "inputs under fuzz/regressions/ with the fix" >&2
  exit 1
fi
say "no crash in ${targets[*]}"
