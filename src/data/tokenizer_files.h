// The tokenizer that goes with token data and checkpoints: a Hugging Face tokenizer.json and its
// companions (tokenizer_config.json, special_tokens_map.json), carried from `mop prepare-data`
// (written beside the shards as <prefix>.tokenizer.json, ...) or `mop import-hf` into every
// checkpoint, so that generate, score and export-hf encode and decode with the ids the model was
// trained on.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mop {

class Tokenizer;

struct TokenizerFiles {
  std::string source;  // the tokenizer.json it was read from, for messages
  // (name in a checkpoint or model directory, content); tokenizer.json first.
  std::vector<std::pair<std::string, std::string>> files;

  bool empty() const { return files.empty(); }
  const std::string& tokenizer_json() const { return files.front().second; }

  // Reads `tokenizer_json` and, when its name ends in "tokenizer.json", the companions whose
  // names end in "tokenizer_config.json" / "special_tokens_map.json" with the same stem
  // (dir/tokenizer.json → dir/tokenizer_config.json; data/kjv.tokenizer.json →
  // data/kjv.tokenizer_config.json). A missing tokenizer.json is a UserError naming `what`.
  static TokenizerFiles read(const std::filesystem::path& tokenizer_json, const std::string& what);
  // The tokenizer of a checkpoint or Hugging Face model directory (its tokenizer.json), if any.
  static std::optional<TokenizerFiles> in_directory(const std::filesystem::path& dir);
  // The tokenizer `mop prepare-data` wrote beside the shards of output prefix `prefix`, if any.
  static std::optional<TokenizerFiles> beside_data(const std::string& prefix);

  // Writes the files into `dir` under their directory names (tokenizer.json, ...), durably.
  void write_into(const std::filesystem::path& dir) const;
  // Writes them beside the shards of `prefix` (<prefix>.tokenizer.json, ...).
  void write_beside_data(const std::string& prefix) const;
  // Removes those of an earlier run (shards rewritten without a tokenizer must not keep one).
  static void remove_beside_data(const std::string& prefix);

  // The tokenizer itself (data/tokenizer.h); UserError if that cannot read it.
  Tokenizer load() const;
  // UserError when the tokenizer has more ids than `model_vocab` (model.vocab_size). One that
  // data/tokenizer.h cannot read is only warned about: it is still carried for Hugging Face tools.
  void check_fits(int64_t model_vocab) const;
};

}  // namespace mop
