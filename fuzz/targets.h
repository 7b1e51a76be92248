// The fuzz targets' entry points: each takes one input's bytes, parses them the way mop reads that
// kind of file, and exercises what it got. A UserError is the expected answer to bad input; any
// other exception, a sanitizer report, a hang or a huge allocation is a bug. The libFuzzer
// binaries (fuzz/<name>_fuzz.cpp, built with -DMOP_FUZZ=ON; scripts/fuzz.sh) and the regression
// test over fuzz/regressions/ and fuzz/corpus/ (tests/fuzz/fuzz_regressions_test.cpp) share them.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string_view>
#include <typeinfo>

#include "core/error.h"

namespace mop {

void fuzz_json(std::string_view bytes);          // JSON text (ckpt/json.h)
void fuzz_safetensors(std::string_view bytes);   // a .safetensors file image (ckpt/safetensors.h)
void fuzz_manifest(std::string_view bytes);      // a checkpoint's manifest.json (ckpt/manifest.h)
void fuzz_tokenizer(std::string_view bytes);     // a tokenizer.json (data/tokenizer.h)
void fuzz_config(std::string_view bytes);        // a YAML config (config/config.h)
void fuzz_megatron_idx(std::string_view bytes);  // u64 LE .bin size, then a Megatron .idx

struct FuzzTarget {
  const char* name;  // fuzz/corpus/<name>/, fuzz/regressions/<name>/, build-fuzz/<name>_fuzz
  void (*run)(std::string_view);
};

inline constexpr FuzzTarget kFuzzTargets[] = {
    {"json", fuzz_json},         {"safetensors", fuzz_safetensors},
    {"manifest", fuzz_manifest}, {"tokenizer", fuzz_tokenizer},
    {"config", fuzz_config},     {"megatron_idx", fuzz_megatron_idx},
};

// Runs `f`, whose input was accepted before (a value written back out and read again): a
// UserError there is a bug, so it becomes an internal error.
template <class F>
auto accepted_again(const char* what, F&& f) {
  try {
    return f();
  } catch (const UserError& e) {
    MOP_UNREACHABLE(what, " was refused: ", e.what());
  }
}

// libFuzzer's entry point body: UserError is a pass; anything else is printed and aborts, which
// libFuzzer reports as a crash and saves the input of.
inline int run_fuzz_input(void (*run)(std::string_view), const uint8_t* data, size_t size) {
  try {
    run(std::string_view(reinterpret_cast<const char*>(data), size));
  } catch (const UserError&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: %s: %s\n", typeid(e).name(), e.what());
    std::abort();
  }
  return 0;
}

}  // namespace mop

// Each fuzz/<name>_fuzz.cpp ends with MOP_FUZZ_MAIN(fuzz_<name>): libFuzzer's entry point in the
// fuzz build (-DMOP_LIBFUZZER), nothing in the test binary.
#ifdef MOP_LIBFUZZER
#define MOP_FUZZ_MAIN(fn)                                                   \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { \
    return ::mop::run_fuzz_input(::mop::fn, data, size);                    \
  }
#else
#define MOP_FUZZ_MAIN(fn)
#endif
