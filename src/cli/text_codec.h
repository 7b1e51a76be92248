// How `mop generate` and `mop score --text` turn text into a checkpoint's token ids and back: with
// the tokenizer saved in the checkpoint (data/tokenizer_files.h), or as bytes for a byte-level
// model without one (vocab ≥ 257, ids 0–255 the bytes, 256 the end of a document).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"
#include "data/tokenizer.h"

namespace mop {

class TextCodec {
 public:
  // For the step_N directory `dir` whose resolved config is `cfg`. UserError when it has no
  // tokenizer and is not byte-level, or when its tokenizer cannot be read.
  static TextCodec for_checkpoint(const std::string& dir, const Config& cfg);

  // Ids of `text`; with the tokenizer's post-processor tokens (BOS) as transformers'
  // tokenizer(text) gives them. Bytes for a byte-level model.
  std::vector<int32_t> encode(std::string_view text) const;
  // Text of `ids`, special tokens skipped (the end-of-document id of a byte-level model too).
  std::string decode(std::span<const int32_t> ids) const;
  // "tokenizer <path>" or "bytes", for messages.
  const std::string& describe() const { return what_; }

 private:
  std::optional<Tokenizer> tok_;
  std::string what_;
};

}  // namespace mop
