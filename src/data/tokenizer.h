// Hugging Face byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2/Qwen3) read from a tokenizer.json:
// encode text to exactly the ids the `tokenizers` package gives (added tokens, NFC, regex split,
// byte-level alphabet, BPE by merge rank) and decode ids back to text. Everything the file
// configures is checked at load; a part this class does not implement is a UserError naming it.
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

  // Ids for `text` (UTF-8; invalid UTF-8 is a UserError), with no post-processor tokens: what
  // `tokenizers`' Tokenizer.encode(text, add_special_tokens=False).ids returns. Thread-safe.
  std::vector<int32_t> encode(std::string_view text) const;
  // Text for `ids` as Tokenizer.decode(ids, skip_special_tokens=skip_special) gives it: bytes
  // that are not valid UTF-8 become U+FFFD. An id outside the vocabulary is a UserError.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;
  // One more than the largest id of the vocabulary and the added tokens (the embedding rows a
  // model needs).
  int64_t vocab_size() const;
  // The id of a token (an added token such as "<|endoftext|>" / "<|im_end|>" / "<|end_of_text|>",
  // or a vocabulary entry in its byte-level spelling); nullopt when there is none.
  std::optional<int32_t> token_id(std::string_view token) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mop
