// Helpers for checkpoint tests: a temporary directory removed on scope exit, raw file bytes in
// and out, and a matcher-free "throws UserError whose message contains" check.
#pragma once

#include "test_util.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "catch.h"
#include "core/error.h"

namespace mop::ckpt_test {

using mop::test::TempDir;


inline void write_bytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  REQUIRE(f.good());
}

inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  REQUIRE(f.good());
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace mop::ckpt_test

