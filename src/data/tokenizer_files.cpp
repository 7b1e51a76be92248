// TokenizerFiles (see tokenizer_files.h).
#include "data/tokenizer_files.h"

#include <array>
#include <string_view>

#include "ckpt/file_io.h"
#include "core/error.h"
#include "core/small_file.h"
#include "data/megatron_format.h"
#include "data/tokenizer.h"

#include <spdlog/spdlog.h>

namespace mop {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kMain = "tokenizer.json";
constexpr std::array<std::string_view, 2> kCompanions = {"tokenizer_config.json", "special_tokens_map.json"};

// Path prefix for a main file named "<stem>tokenizer.json" (stem "dir/" or "data/kjv."); nullopt
// for other names (they have no companions).
std::optional<std::string> stem_of(const fs::path& main) {
  const std::string s = main.string();
  if (!s.ends_with(kMain)) return std::nullopt;
  return s.substr(0, s.size() - kMain.size());
}

std::string join(std::string stem, std::string_view name) {
  stem.append(name.data(), name.size());
  return stem;
}

// The shard prefix as megatron_paths resolves it ("data/kjv", also for "data/kjv.bin").
std::string data_stem(const std::string& prefix) { return megatron_paths(prefix).prefix + "."; }

}  // namespace

TokenizerFiles TokenizerFiles::read(const fs::path& tokenizer_json, const std::string& what) {
  TokenizerFiles t;
  t.source = tokenizer_json.string();
  t.files.emplace_back(std::string(kMain),
                       read_small_file(tokenizer_json, what, kTokenizerFileCap));
  std::error_code ec;
  if (const auto stem = stem_of(tokenizer_json))
    for (std::string_view name : kCompanions) {
      const fs::path p = join(*stem, name);
      if (fs::exists(fs::symlink_status(p, ec)))
        t.files.emplace_back(std::string(name), read_small_file(p, what, kTokenizerFileCap));
    }
  return t;
}

std::optional<TokenizerFiles> TokenizerFiles::in_directory(const fs::path& dir) {
  std::error_code ec;
  const fs::path main = dir / kMain;
  if (!fs::exists(fs::symlink_status(main, ec))) return std::nullopt;
  return read(main, "tokenizer");
}

std::optional<TokenizerFiles> TokenizerFiles::beside_data(const std::string& prefix) {
  std::error_code ec;
  const fs::path main = join(data_stem(prefix), kMain);
  if (!fs::is_regular_file(main, ec)) return std::nullopt;
  return read(main, "data tokenizer");
}

void TokenizerFiles::write_into(const fs::path& dir) const {
  for (const auto& [name, content] : files) write_file_durable(dir / name, content);
}

void TokenizerFiles::write_beside_data(const std::string& prefix) const {
  const std::string stem = data_stem(prefix);
  for (const auto& [name, content] : files) write_file_atomic(join(stem, name), content);
}

Tokenizer TokenizerFiles::load() const { return Tokenizer::from_json_text(tokenizer_json(), source); }

void TokenizerFiles::check_fits(int64_t model_vocab) const {
  int64_t vocab = 0;
  try {
    vocab = load().vocab_size();
  } catch (const UserError& e) {
    spdlog::warn("{} (it is kept with the checkpoints, but mop generate and score cannot use it)", e.what());
    return;
  }
  MOP_USER_CHECK(vocab <= model_vocab, "tokenizer ", source, " has ", vocab,
                 " ids, more than model.vocab_size ", model_vocab);
}

void TokenizerFiles::remove_beside_data(const std::string& prefix) {
  const std::string stem = data_stem(prefix);
  std::error_code ec;
  fs::remove(join(stem, kMain), ec);
  for (std::string_view name : kCompanions) fs::remove(join(stem, name), ec);
}

}  // namespace mop
