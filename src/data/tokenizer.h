// Hugging Face BPE tokenizers read from a tokenizer.json, of two kinds: byte-level (GPT-2, Llama 3,
// Qwen2/Qwen3) and SentencePiece-style with byte fallback (Llama 2, Mistral, Mixtral; in the legacy
// Prepend/Replace-normalizer form and the newer Metaspace form). encode() gives exactly the ids the
// `tokenizers` package gives (added tokens, normalizers, pre-tokenizers, BPE by merge rank, byte
// fallback, the post-processor's template) and decode() its text. Everything the file configures
// is checked at load; a part this class does not implement is a UserError naming it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mop {

class Tokenizer {
 public:
  // Reads and checks a tokenizer.json; a missing file, invalid JSON or an unsupported part is a
  // UserError naming the path.
  static Tokenizer load(const std::filesystem::path& path);
  // The same from the file's text; `source` names it in errors.
  static Tokenizer from_json_text(std::string_view text, std::string_view source);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Ids for `text` (UTF-8; invalid UTF-8 is a UserError): what `tokenizers`'
  // Tokenizer.encode(text, add_special_tokens=...).ids returns. Without special tokens (the
  // default) these are the text's ids only; with them the post-processor's single-sequence
  // template is applied: prefix_ids() + the text's ids + suffix_ids(). Thread-safe.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // Text for `ids` as Tokenizer.decode(ids, skip_special_tokens=skip_special) gives it, through
  // the file's decoder (none: the tokens joined by spaces). Bytes that are not valid UTF-8 become
  // U+FFFD as the package does it: the ByteLevel decoder one per maximal invalid sequence, the
  // ByteFallback decoder one per <0xXX> token of a run that is not valid UTF-8 as a whole. An id
  // outside the vocabulary is a UserError (the package drops it).
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;
  // One more than the largest id of the vocabulary and the added tokens (the embedding rows a
  // model needs).
  int64_t vocab_size() const;
  // The id of a token (an added token such as "<|endoftext|>" / "<|im_end|>" / "<s>", or a
  // vocabulary entry as the file spells it: "Ġthe", "▁the", "<0x0A>"); nullopt when there is none.
  std::optional<int32_t> token_id(std::string_view token) const;
  // The ids the post-processor's single-sequence template (TemplateProcessing) puts before and
  // after the text's ids: Llama 3's <|begin_of_text|>, Llama 2's and Mixtral's <s>. Empty when the
  // tokenizer has no template.
  const std::vector<int32_t>& prefix_ids() const;
  const std::vector<int32_t>& suffix_ids() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mop
