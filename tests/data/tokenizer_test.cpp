// The byte-level BPE tokenizer against the Hugging Face `tokenizers` package: every text in the
// fixtures' expected.json (scripts/make_tokenizer_fixtures.py) encodes to exactly its ids and
// decodes back; unsupported tokenizer.json parts and missing files are UserErrors naming them.
#include <filesystem>
#include <string>
#include <vector>

#include "catch.h"
#include "ckpt/json.h"
#include "data/tokenizer.h"
#include "data_test_util.h"
#include "test_util.h"

using namespace mop;
namespace fs = std::filesystem;

namespace {
const fs::path kFixtures = fs::path(MOP_SOURCE_DIR) / "tests/data/fixtures/tokenizer";

// The smallest tokenizer.json this class accepts, with `value` replacing the member `key`.
std::string minimal_json(const std::string& key, const std::string& value) {
  Json root = parse_json(R"({"version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [], "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "post_processor": null, "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}})",
                         "minimal");
  root[key] = parse_json(value, "part");
  return root.dump();
}
}  // namespace

TEST_CASE("tokenizer matches the tokenizers package on the fixtures", "[cpu][data]") {
  for (const char* kind : {"gpt2", "qwen2", "llama3"}) {
    const fs::path dir = kFixtures / kind;
    const Tokenizer tok = Tokenizer::load(dir / "tokenizer.json");
    const Json expected = read_json_file(dir / "expected.json");
    REQUIRE(expected.size() >= 25);
    int num_checked = 0;
    for (const Json& c : expected.as_array()) {
      const std::string& text = c.at("text").as_string();
      std::vector<int32_t> want;
      for (const Json& id : c.at("ids").as_array()) want.push_back(int32_t(id.as_int64()));
      INFO(kind << ": \"" << text << "\"");
      const std::vector<int32_t> got = tok.encode(text);
      CHECK(got == want);
      const Json* decoded = c.find("decoded");  // present where NFC changed the text
      CHECK(tok.decode(want) == (decoded ? decoded->as_string() : text));
      // A second encode goes through the BPE cache.
      CHECK(tok.encode(text) == want);
      ++num_checked;
    }
    CHECK(num_checked == int(expected.size()));
  }
}

TEST_CASE("tokenizer ByteLevel add_prefix_space prefixes each piece between added tokens",
          "[cpu][data]") {
  Json spec = read_json_file(kFixtures / "gpt2" / "tokenizer.json");
  spec["pre_tokenizer"]["add_prefix_space"] = true;
  const Tokenizer tok = Tokenizer::from_json_text(spec.dump(), "gpt2 + add_prefix_space");
  const Json expected = read_json_file(kFixtures / "gpt2" / "expected_add_prefix_space.json");
  REQUIRE(expected.size() >= 5);
  for (const Json& c : expected.as_array()) {
    const std::string& text = c.at("text").as_string();
    std::vector<int32_t> want;
    for (const Json& id : c.at("ids").as_array()) want.push_back(int32_t(id.as_int64()));
    INFO("\"" << text << "\"");
    CHECK(tok.encode(text) == want);
  }
}

TEST_CASE("tokenizer vocab size, token ids and special-token decoding", "[cpu][data]") {
  const Tokenizer qwen = Tokenizer::load(kFixtures / "qwen2" / "tokenizer.json");
  CHECK(qwen.vocab_size() == 2000);
  CHECK(qwen.token_id("<|im_end|>") == 2);
  CHECK(qwen.token_id("<|endoftext|>") == 0);
  CHECK(!qwen.token_id("<|end_of_text|>").has_value());
  const std::vector<int32_t> ids = qwen.encode("<|im_start|>hi<|im_end|>");
  CHECK(qwen.decode(ids) == "<|im_start|>hi<|im_end|>");
  CHECK(qwen.decode(ids, /*skip_special=*/true) == "hi");
  const std::vector<int32_t> bad = {2000};
  CHECK_USER_ERROR(qwen.decode(bad), "id 2000 is not in the vocabulary");
  CHECK_USER_ERROR(qwen.encode("\xff"), "not valid UTF-8 at byte 0");

  // Half of a multi-byte character decodes to U+FFFD, as from_utf8_lossy gives it.
  const Tokenizer gpt2 = Tokenizer::load(kFixtures / "gpt2" / "tokenizer.json");
  const std::vector<int32_t> half = {*gpt2.token_id("\xc3\xa4")};  // "ä": the byte 0xE4
  CHECK(gpt2.decode(half) == "\xef\xbf\xbd");
}

TEST_CASE("tokenizer refuses what it does not implement, naming it", "[cpu][data]") {
  auto load = [](const std::string& key, const std::string& value) {
    return Tokenizer::from_json_text(minimal_json(key, value), "tokenizer.json");
  };
  CHECK(load("normalizer", "null").encode("ab") == std::vector<int32_t>{2});
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Metaspace"})"),
                   "tokenizer.json: pre_tokenizer Metaspace is not supported");
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Sequence", "pretokenizers": [
                          {"type": "ByteLevel"}, {"type": "Split", "behavior": "Isolated",
                          "pattern": {"Regex": "a"}}]})"),
                   "pre_tokenizer ByteLevel in this position");
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Sequence", "pretokenizers": [
                          {"type": "Split", "behavior": "Removed", "pattern": {"Regex": "a"}},
                          {"type": "ByteLevel"}]})"),
                   "pre_tokenizer Split behavior Removed is not supported");
  CHECK_USER_ERROR(load("model", R"({"type": "WordPiece", "vocab": {}})"),
                   "tokenizer.json: model type WordPiece is not supported (only BPE is)");
  CHECK_USER_ERROR(load("model", R"({"type": "BPE", "vocab": {"a": 0}, "merges": [],
                          "byte_fallback": true})"),
                   "model.byte_fallback true is not supported");
  CHECK_USER_ERROR(load("normalizer", R"({"type": "NFKC"})"),
                   "tokenizer.json: normalizer NFKC is not supported");
  CHECK_USER_ERROR(load("decoder", R"({"type": "Metaspace"})"), "decoder Metaspace");
  // Llama 3's post-processor: ByteLevel, then a template that prepends <|begin_of_text|>.
  CHECK_USER_ERROR(
      load("post_processor", R"({"type": "Sequence", "processors": [
                          {"type": "ByteLevel"}, {"type": "TemplateProcessing", "single": [
                          {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}}]}]})"),
      "post_processor TemplateProcessing that adds <|begin_of_text|> is not supported");
  CHECK(load("post_processor", R"({"type": "TemplateProcessing", "single": [
               {"Sequence": {"id": "A", "type_id": 0}}]})")
            .encode("ab") == std::vector<int32_t>{2});
  CHECK_USER_ERROR(load("post_processor", R"({"type": "BertProcessing"})"),
                   "post_processor BertProcessing");
  CHECK_USER_ERROR(load("added_tokens", R"([{"id": 3, "content": "<x>", "single_word": true}])"),
                   "added token '<x>' with single_word true is not supported");
  CHECK_USER_ERROR(load("truncation", R"({"max_length": 8})"), "truncation");
  CHECK_USER_ERROR(load("model", R"({"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]})"),
                   "model.merges[0]: 'a' or 'b' is not in the vocab");
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Sequence", "pretokenizers": [
                          {"type": "Split", "behavior": "Isolated", "pattern": {"Regex": "(a"}},
                          {"type": "ByteLevel"}]})"),
                   "regex does not compile");

  const std::string missing = (kFixtures / "no_such" / "tokenizer.json").string();
  CHECK_USER_ERROR(Tokenizer::load(missing), missing + ": no such file");
}
