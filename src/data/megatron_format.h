// The Megatron-LM indexed dataset (.bin + .idx), as megatron.core.datasets.indexed_dataset and
// tools/preprocess_data.py write it: path resolution, dtype codes, and MegatronIndex, a validated
// read-only view of an .idx file. Layout (all little-endian, no padding):
//   "MMIDIDX\0\0" | u64 version = 1 | u8 dtype code | u64 num_sequences | u64 num_document_indices
//   | i32 lengths[num_sequences] | i64 byte pointers[num_sequences] | i64 document_indices[...]
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/mapped_file.h"
#include "data/token_dtype.h"

namespace mop {

inline constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kMegatronVersion = 1;
// Bytes before the lengths array: magic 9 + version 8 + dtype code 1 + two u64 counts.
inline constexpr size_t kMegatronHeaderBytes = 9 + 8 + 1 + 8 + 8;
// Megatron's DType.optimal_dtype: uint16 below this vocabulary size, int32 from it on.
inline constexpr int64_t kMegatronUint16VocabLimit = 65500;

// Megatron's numeric dtype code (1 uint8, 3 int16, 4 int32, 5 int64, 8 uint16). Throws UserError
// naming `idx_path` for the codes that cannot hold token ids (2 int8, 6 float64, 7 float32) and for
// unknown codes.
TokenDType megatron_dtype_from_code(int code, const std::string& idx_path);
// The code written for `dtype`; MOP_CHECKs that Megatron has one (uint32 has none).
uint8_t megatron_code(TokenDType dtype);
// uint16 for vocab_size < 65500, else int32 (the dtype Megatron's preprocess_data picks).
TokenDType megatron_dtype_for_vocab(int64_t vocab_size);

// "data/kjv", "data/kjv.bin" and "data/kjv.idx" all name the dataset with prefix "data/kjv".
struct MegatronPaths {
  std::string prefix, bin, idx;
};
MegatronPaths megatron_paths(std::string_view path);

// A mapped, fully validated .idx. The constructor checks magic, version, dtype, that the file
// size matches the counts exactly, that sequences are contiguous in index order and end exactly
// at the end of the .bin (`bin_bytes`), and that document indices run from 0 to num_sequences
// without decreasing. Any violation is a UserError naming the file and what is wrong.
class MegatronIndex {
 public:
  MegatronIndex(const std::string& idx_path, uint64_t bin_bytes, const std::string& bin_path);

  const std::string& path() const { return file_.path(); }
  TokenDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return num_sequences_; }
  // Megatron's document_indices has one more entry than there are documents (it starts with 0).
  int64_t num_document_indices() const { return num_document_indices_; }
  int64_t num_tokens() const { return num_tokens_; }

  // The arrays start at unaligned offsets (34 is not a multiple of 4), hence memcpy.
  int32_t sequence_length(int64_t i) const { return load<int32_t>(lengths_offset() + 4 * i); }
  int64_t sequence_pointer(int64_t i) const { return load<int64_t>(pointers_offset() + 8 * i); }
  int64_t document_index(int64_t i) const { return load<int64_t>(documents_offset() + 8 * i); }

 private:
  template <class T>
  T load(size_t offset) const {
    T v;
    std::memcpy(&v, file_.data() + offset, sizeof(T));
    return v;
  }
  size_t lengths_offset() const { return kMegatronHeaderBytes; }
  size_t pointers_offset() const { return kMegatronHeaderBytes + 4 * size_t(num_sequences_); }
  size_t documents_offset() const { return pointers_offset() + 8 * size_t(num_sequences_); }
  void validate_header();
  void validate_sequences(uint64_t bin_bytes, const std::string& bin_path);
  void validate_documents() const;

  MappedFile file_;
  TokenDType dtype_ = TokenDType::U16;
  int64_t num_sequences_ = 0, num_document_indices_ = 0, num_tokens_ = 0;
};

}  // namespace mop
