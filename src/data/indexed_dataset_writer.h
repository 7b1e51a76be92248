// IndexedDatasetWriter: writes a Megatron-LM indexed dataset (<prefix>.bin + <prefix>.idx) that
// Megatron's own reader and MegatronIndex accept. One Megatron sequence per document, as
// preprocess_data.py writes without --split-sentences. Used by `mop prepare-data` and the tests.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string_view>
#include <vector>

#include "data/megatron_format.h"

namespace mop {

class IndexedDatasetWriter {
 public:
  // `prefix` may also be given as either file name. `dtype` must have a Megatron code (not uint32);
  // megatron_dtype_for_vocab() picks the one Megatron would. Output goes to *.tmp files that
  // finish() renames, so a failed or abandoned write never leaves a valid-looking dataset.
  IndexedDatasetWriter(std::string_view prefix, TokenDType dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Appends tokens to the current document (streaming large documents in pieces is fine).
  // Every token must fit the dtype (a MOP_CHECK: the caller chose the dtype from its vocabulary).
  void add_tokens(std::span<const uint32_t> tokens);
  // Closes the current document (possibly empty).
  void end_document();
  void add_document(std::span<const uint32_t> tokens) {
    add_tokens(tokens);
    end_document();
  }
  // Writes the .idx and moves both files into place. Tokens added after the last end_document()
  // are a MOP_CHECK failure.
  void finish();

  const MegatronPaths& paths() const { return paths_; }
  TokenDType dtype() const { return dtype_; }
  int64_t num_documents() const { return int64_t(lengths_.size()); }
  int64_t num_tokens() const { return num_tokens_; }
  // Bytes of the finished .bin and .idx together (valid after finish()).
  int64_t num_bytes_written() const { return num_bytes_written_; }

 private:
  void write(std::FILE* f, const std::string& what, const void* data, size_t bytes);

  MegatronPaths paths_;
  TokenDType dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  std::vector<uint8_t> encode_buffer_;
  int64_t num_tokens_ = 0, document_tokens_ = 0, num_bytes_written_ = 0;
  bool finished_ = false;
};

}  // namespace mop
