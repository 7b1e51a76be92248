// Fuzz target: a tokenizer.json through Tokenizer::from_json_text, then a few fixed texts encoded
// (with the template's special tokens) and their ids decoded. encode may refuse only through a
// UserError (a regex that hits PCRE2's limits); its ids must be in the vocabulary and decode.
#include <vector>

#include "data/tokenizer.h"
#include "fuzz/targets.h"

namespace mop {

void fuzz_tokenizer(std::string_view bytes) {
  const Tokenizer tok = Tokenizer::from_json_text(bytes, "fuzz/tokenizer.json");
  // ASCII, whitespace runs, NFC-sensitive and multi-byte text, and the usual special tokens.
  static constexpr std::string_view kTexts[] = {
      "Hello, world! It's 12345 o'clock.",
      "  two  spaces\n\n\ttab\r\n",
      "e\xcc\x81t\xc3\xa9 \xe2\x80\x94 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x99\x82",
      "<s>ab</s><|endoftext|><|im_start|>[X]<unk>",
  };
  for (std::string_view text : kTexts) {
    std::vector<int32_t> ids;
    try {
      ids = tok.encode(text, /*add_special_tokens=*/true);
    } catch (const UserError&) {
      continue;
    }
    for (int32_t id : ids)
      MOP_CHECK(id >= 0 && id < tok.vocab_size(), "encode gave id ", id, " of ", tok.vocab_size());
    accepted_again("decoding encode's ids", [&] { return tok.decode(ids); });
    accepted_again("decoding encode's ids", [&] { return tok.decode(ids, /*skip_special=*/true); });
  }
  for (std::string_view token : {"<s>", "<|endoftext|>", "a", ""}) (void)tok.token_id(token);
}

}  // namespace mop

MOP_FUZZ_MAIN(fuzz_tokenizer)
