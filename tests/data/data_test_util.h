// Helpers for the data tests: a self-deleting temporary directory, little-endian byte builders
// (independent of the writer under test), a hand-built Megatron .idx, and a UserError matcher.
#pragma once

#include "test_util.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "catch.h"
#include "core/error.h"
#include "core/rng.h"

namespace mop::test {

// A fresh directory under the system temp dir, removed with everything in it at scope exit.

inline void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  REQUIRE(f.good());
}

inline void write_text(const std::string& path, const std::string& text) {
  write_file(path, std::vector<uint8_t>(text.begin(), text.end()));
}

// Appends `v` as `bytes` little-endian bytes, by shifts (so it does not depend on the host).
inline void put_le(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(uint8_t(v >> (8 * i)));
}

// An .idx built byte by byte from the format description.
struct IdxSpec {
  std::string magic = std::string("MMIDIDX\0\0", 9);
  uint64_t version = 1;
  int dtype_code = 8;
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers;
  std::vector<int64_t> documents;
  int64_t num_sequences = -1;  // header count; -1: lengths.size()
  int64_t num_documents = -1;  // header count; -1: documents.size()

  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> b(magic.begin(), magic.end());
    put_le(b, version, 8);
    put_le(b, uint64_t(dtype_code), 1);
    put_le(b, uint64_t(num_sequences < 0 ? int64_t(lengths.size()) : num_sequences), 8);
    put_le(b, uint64_t(num_documents < 0 ? int64_t(documents.size()) : num_documents), 8);
    for (int32_t v : lengths) put_le(b, uint64_t(uint32_t(v)), 4);
    for (int64_t v : pointers) put_le(b, uint64_t(v), 8);
    for (int64_t v : documents) put_le(b, uint64_t(v), 8);
    return b;
  }
};

// Tokens as `bytes`-wide little-endian integers (negative values two's complement).
inline std::vector<uint8_t> token_bytes(const std::vector<int64_t>& tokens, int bytes) {
  std::vector<uint8_t> b;
  for (int64_t t : tokens) put_le(b, uint64_t(t), bytes);
  return b;
}

}  // namespace mop::test

