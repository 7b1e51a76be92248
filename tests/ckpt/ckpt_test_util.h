// Helpers for checkpoint tests: a temporary directory removed on scope exit, raw file bytes in
// and out, and a matcher-free "throws UserError whose message contains" check.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "catch.h"
#include "core/error.h"

namespace mop::ckpt_test {

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "mop_ckpt_test_XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::filesystem::path operator/(const std::string& name) const { return path / name; }
};

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

// The message of the UserError `fn` throws ("" and a failed check if it throws none).
template <class Fn>
std::string user_error_message(Fn&& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  FAIL_CHECK("expected a UserError");
  return "";
}

}  // namespace mop::ckpt_test

// The UserError message of `expr` contains `part`; on failure both are printed.
#define CKPT_CHECK_USER_ERROR(expr, part)                                               \
  do {                                                                                  \
    std::string mop_msg_ = ::mop::ckpt_test::user_error_message([&] { (void)(expr); }); \
    INFO("message: " << mop_msg_);                                                      \
    CHECK(mop_msg_.find(part) != std::string::npos);                                    \
  } while (0)
