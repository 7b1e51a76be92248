// TokenShard: the common read-only view of one token file — a Megatron .bin/.idx pair or a flat
// array of uint16/uint32 ids — as a stream of num_tokens() ids read by range as uint32, with
// document boundaries as metadata. open_token_shard() picks the format ("auto" detects it).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/mapped_file.h"
#include "data/megatron_format.h"
#include "data/token_dtype.h"

namespace mop {

// Passed as vocab_size when only the uint32 range matters.
inline constexpr int64_t kNoVocabLimit = int64_t(std::numeric_limits<uint32_t>::max()) + 1;

class TokenShard {
 public:
  // A raw little-endian array of `dtype` (uint16 or uint32) ids. Documents end at each `eos_id`
  // (-1: the file is one document). A size that is not a multiple of the dtype is a UserError.
  static TokenShard open_flat(const std::string& path, TokenDType dtype, int64_t eos_id);
  // A Megatron dataset, named by prefix or by either file; both files must exist and validate.
  // The stream is the sequences concatenated in index order; each sequence is a document unit.
  static TokenShard open_megatron(std::string_view path);

  // The token file (.bin or flat file): the name used in messages.
  const std::string& path() const { return tokens_.path(); }
  TokenDType dtype() const { return dtype_; }
  bool is_megatron() const { return index_.has_value(); }
  int64_t num_tokens() const { return num_tokens_; }

  // Tokens [first, first + count) as uint32. A token outside [0, vocab_size) is a UserError:
  // "<path>: token 70000 at position 12345 is outside the vocabulary (vocab_size 65536)".
  // Thread-safe; never allocates.
  void read(int64_t first, int64_t count, uint32_t* out, int64_t vocab_size = kNoVocabLimit) const;
  // Full scan with the same check as read() (for `mop validate`).
  void validate_tokens(int64_t vocab_size) const;
  // Token offsets where documents start, then num_tokens(): D + 1 entries for D documents
  // (Megatron: one per sequence, from the index; flat: scans for eos_id).
  std::vector<int64_t> document_boundaries() const;

 private:
  TokenShard(MappedFile tokens, TokenDType dtype, int64_t eos_id,
             std::optional<MegatronIndex> index);
  [[noreturn]] void throw_out_of_vocab(int64_t position, int64_t token, int64_t vocab_size) const;

  MappedFile tokens_;
  TokenDType dtype_;
  int64_t eos_id_ = -1, num_tokens_ = 0;
  std::optional<MegatronIndex> index_;
};

// True when `path` names a Megatron dataset: <path>.idx exists, or path ends in .idx/.bin and the
// sibling .idx exists.
bool looks_like_megatron(std::string_view path);

// format: "auto" | "megatron" | "flat" (else UserError). flat_dtype and eos_id apply to flat files.
TokenShard open_token_shard(std::string_view path, std::string_view format, TokenDType flat_dtype,
                            int64_t eos_id);

}  // namespace mop
