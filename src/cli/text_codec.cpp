// TextCodec (see text_codec.h).
#include "cli/text_codec.h"

#include "core/error.h"
#include "data/prepare_data.h"
#include "data/tokenizer_files.h"

namespace mop {

TextCodec TextCodec::for_checkpoint(const std::string& dir, const Config& cfg) {
  TextCodec c;
  if (std::optional<TokenizerFiles> files = TokenizerFiles::in_directory(dir)) {
    c.tok_.emplace(files->load());
    c.what_ = "tokenizer " + files->source;
    MOP_USER_CHECK(c.tok_->vocab_size() <= cfg.model.vocab_size, c.what_, " has ", c.tok_->vocab_size(),
                   " ids, more than the model's vocab_size ", cfg.model.vocab_size);
    return c;
  }
  MOP_USER_CHECK(cfg.model.vocab_size >= kByteVocabSize && cfg.data.eos_id == kByteEosId, "checkpoint ",
                 dir, " has no tokenizer.json and is not a byte-level model (vocab_size ",
                 cfg.model.vocab_size, ", data.eos_id ", cfg.data.eos_id, "): train with data.tokenizer "
                 "or data from `mop prepare-data --tokenizer`, or give token ids (mop score --tokens)");
  c.what_ = "bytes";
  return c;
}

std::vector<int32_t> TextCodec::encode(std::string_view text) const {
  if (tok_) return tok_->encode(text, /*add_special_tokens=*/true);
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = int32_t(uint8_t(text[i]));
  return ids;
}

std::string TextCodec::decode(std::span<const int32_t> ids) const {
  std::string s;
  if (tok_) {
    // A model's vocabulary may be padded past the tokenizer's: such ids decode to nothing.
    std::vector<int32_t> known;
    for (int32_t id : ids)
      if (id >= 0 && id < tok_->vocab_size()) known.push_back(id);
    return tok_->decode(known, /*skip_special=*/true);
  }
  for (int32_t id : ids)
    if (id >= 0 && id < 256) s.push_back(char(id));
  return s;
}

}  // namespace mop
