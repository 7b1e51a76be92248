// The BPE tokenizer against the Hugging Face `tokenizers` package: every text in the fixtures'
// expected.json (scripts/make_tokenizer_fixtures.py) encodes to exactly its ids, with and without
// the post-processor's special tokens, and decodes to exactly the package's text; SentencePiece
// byte fallback, unk fusing, Metaspace variants and byte-token decoding likewise; unsupported
// tokenizer.json parts and missing files are UserErrors naming them.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
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

std::vector<int32_t> ids_of(const Json& j) {
  std::vector<int32_t> ids;
  for (const Json& id : j.as_array()) ids.push_back(int32_t(id.as_int64()));
  return ids;
}

// A string member of `c`, or `fallback` when the fixture left it out (it equals the fallback).
std::string str_or(const Json& c, const char* key, const std::string& fallback) {
  const Json* v = c.find(key);
  return v ? v->as_string() : fallback;
}
}  // namespace

TEST_CASE("tokenizer matches the tokenizers package on the fixtures", "[cpu][data]") {
  for (const char* kind : {"gpt2", "qwen2", "llama3", "llama2", "metaspace"}) {
    const fs::path dir = kFixtures / kind;
    const Tokenizer tok = Tokenizer::load(dir / "tokenizer.json");
    const Json expected = read_json_file(dir / "expected.json");
    REQUIRE(expected.size() >= 25);
    int num_checked = 0;
    for (const Json& c : expected.as_array()) {
      const std::string& text = c.at("text").as_string();
      const std::vector<int32_t> want = ids_of(c.at("ids"));
      const Json* special = c.find("ids_special");
      const std::vector<int32_t> want_special = special ? ids_of(*special) : want;
      INFO(kind << ": \"" << text << "\"");
      const std::vector<int32_t> got = tok.encode(text);
      CHECK(got == want);
      CHECK(tok.encode(text, /*add_special_tokens=*/true) == want_special);
      // Absent fields equal their defaults (see the script).
      const std::string decoded = str_or(c, "decoded", text);
      const std::string decoded_skip = str_or(c, "decoded_skip", decoded);
      CHECK(tok.decode(want) == decoded);
      CHECK(tok.decode(want, /*skip_special=*/true) == decoded_skip);
      CHECK(tok.decode(want_special) == str_or(c, "decoded_special", decoded));
      CHECK(tok.decode(want_special, true) == str_or(c, "decoded_special_skip", decoded_skip));
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

TEST_CASE("tokenizer post-processor templates add their tokens with add_special_tokens",
          "[cpu][data]") {
  // Llama 3: Sequence[ByteLevel, TemplateProcessing("<|begin_of_text|> $A")].
  const Tokenizer llama3 = Tokenizer::load(kFixtures / "llama3" / "tokenizer.json");
  const int32_t bot = *llama3.token_id("<|begin_of_text|>");
  CHECK(llama3.prefix_ids() == std::vector<int32_t>{bot});
  CHECK(llama3.suffix_ids().empty());
  CHECK(llama3.encode("", true) == std::vector<int32_t>{bot});
  // Llama 2 / Mixtral: "<s> $A"; the metaspace fixture: "<s> $A </s>".
  const Tokenizer llama2 = Tokenizer::load(kFixtures / "llama2" / "tokenizer.json");
  CHECK(llama2.prefix_ids() == std::vector<int32_t>{1});
  CHECK(llama2.suffix_ids().empty());
  const Tokenizer meta = Tokenizer::load(kFixtures / "metaspace" / "tokenizer.json");
  CHECK(meta.prefix_ids() == std::vector<int32_t>{*meta.token_id("<s>")});
  CHECK(meta.suffix_ids() == std::vector<int32_t>{*meta.token_id("</s>")});
  std::vector<int32_t> wrapped = meta.prefix_ids();
  for (int32_t id : meta.encode("In the beginning")) wrapped.push_back(id);
  wrapped.push_back(meta.suffix_ids()[0]);
  CHECK(meta.encode("In the beginning", true) == wrapped);
  // No post-processor: nothing to add.
  const Tokenizer gpt2 = Tokenizer::load(kFixtures / "gpt2" / "tokenizer.json");
  CHECK(gpt2.prefix_ids().empty());
  CHECK(gpt2.encode("In the", true) == gpt2.encode("In the"));

  // In a Sequence a later template wraps the earlier one; the pair template is not used.
  const Tokenizer nested = Tokenizer::from_json_text(
      minimal_json("post_processor", R"({"type": "Sequence", "processors": [
        {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "x", "type_id": 0}},
          {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "y", "type_id": 0}}],
         "pair": [{"Sequence": {"id": "B", "type_id": 0}}],
         "special_tokens": {"x": {"id": "x", "ids": [0], "tokens": ["a"]},
                            "y": {"id": "y", "ids": [1, 0], "tokens": ["b", "a"]}}},
        {"type": "ByteLevel", "trim_offsets": false},
        {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "z", "type_id": 0}},
          {"Sequence": {"id": "A", "type_id": 1}}],
         "special_tokens": {"z": {"id": "z", "ids": [2], "tokens": ["ab"]}}}]})"),
      "nested");
  CHECK(nested.prefix_ids() == std::vector<int32_t>{2, 0});
  CHECK(nested.suffix_ids() == std::vector<int32_t>{1, 0});
  CHECK(nested.encode("ab", true) == std::vector<int32_t>{2, 0, 2, 1, 0});
  CHECK(nested.encode("ab") == std::vector<int32_t>{2});
}

TEST_CASE("tokenizer byte fallback writes characters outside the vocabulary as <0xXX> tokens",
          "[cpu][data]") {
  for (const char* kind : {"llama2", "metaspace"}) {
    INFO(kind);
    const Tokenizer tok = Tokenizer::load(kFixtures / kind / "tokenizer.json");
    std::vector<bool> is_byte_token(size_t(tok.vocab_size()), false);
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      const std::optional<int32_t> id = tok.token_id(name);
      REQUIRE(id.has_value());
      is_byte_token[size_t(*id)] = true;
    }
    const Json expected = read_json_file(kFixtures / kind / "expected.json");
    int num_byte_ids = 0;
    for (const Json& c : expected.as_array()) {
      const std::string& text = c.at("text").as_string();
      const std::vector<int32_t> ids = ids_of(c.at("ids"));
      num_byte_ids += int(std::count_if(ids.begin(), ids.end(),
                                        [&](int32_t id) { return is_byte_token[size_t(id)]; }));
      // 中 (E4 B8 AD) is not in the small vocabulary: its three byte tokens stand for it.
      if (text.starts_with("中文")) {
        const std::vector<int32_t> zhong = {*tok.token_id("<0xE4>"), *tok.token_id("<0xB8>"),
                                            *tok.token_id("<0xAD>")};
        CHECK(std::search(ids.begin(), ids.end(), zhong.begin(), zhong.end()) != ids.end());
        CHECK(tok.encode(text) == ids);
      }
      // So is the rare letter Q.
      if (text.starts_with("QVX")) {
        const int32_t q = *tok.token_id("<0x51>");
        CHECK(std::count(ids.begin(), ids.end(), q) == 2);
        CHECK(tok.encode(text) == ids);
      }
    }
    CHECK(num_byte_ids > 300);  // CJK, Arabic, Devanagari, emoji, ...
  }
}

TEST_CASE("tokenizer decodes byte-token runs as the ByteFallback and Metaspace decoders do",
          "[cpu][data]") {
  for (const char* kind : {"llama2", "metaspace"}) {
    const Tokenizer tok = Tokenizer::load(kFixtures / kind / "tokenizer.json");
    const Json cases = read_json_file(kFixtures / kind / "expected_decode.json");
    REQUIRE(cases.size() >= 10);
    for (const Json& c : cases.as_array()) {
      const std::vector<int32_t> ids = ids_of(c.at("ids"));
      INFO(kind << ": " << c.at("tokens").dump());
      std::vector<int32_t> from_tokens;
      for (const Json& t : c.at("tokens").as_array())
        from_tokens.push_back(tok.token_id(t.as_string()).value_or(-1));
      CHECK(from_tokens == ids);
      CHECK(tok.decode(ids) == c.at("decoded").as_string());
      CHECK(tok.decode(ids, /*skip_special=*/true) == c.at("decoded_skip").as_string());
    }
  }
  // An invalid run is one U+FFFD per byte token (not per maximal invalid sequence).
  const Tokenizer llama2 = Tokenizer::load(kFixtures / "llama2" / "tokenizer.json");
  const std::vector<int32_t> half = {*llama2.token_id("<0xE4>"), *llama2.token_id("<0xB8>")};
  CHECK(llama2.decode(half) == "\xef\xbf\xbd\xef\xbf\xbd");
}

TEST_CASE("tokenizer Metaspace prepend_scheme and split variants", "[cpu][data]") {
  const Json spec = read_json_file(kFixtures / "metaspace" / "tokenizer.json");
  const Json variants = read_json_file(kFixtures / "metaspace" / "expected_variants.json");
  REQUIRE(variants.size() == 4);
  for (const Json& v : variants.as_array()) {
    Json s = spec;
    s["pre_tokenizer"] = v.at("pre_tokenizer");
    s["decoder"] = v.at("pre_tokenizer");
    const Tokenizer tok = Tokenizer::from_json_text(s.dump(), "metaspace variant");
    for (const Json& c : v.at("cases").as_array()) {
      const std::string& text = c.at("text").as_string();
      INFO(v.at("pre_tokenizer").dump() << ": \"" << text << "\"");
      const std::vector<int32_t> want = ids_of(c.at("ids"));
      CHECK(tok.encode(text) == want);
      CHECK(tok.decode(want) == c.at("decoded").as_string());
    }
  }
}

TEST_CASE("tokenizer unk: fuse_unk and the package's order of unk and byte tokens", "[cpu][data]") {
  // A vocabulary with only <0xC3>, <0xA9> (é) and <0xE2>: € (E2 82 AC) and most letters are unk.
  Json spec = read_json_file(kFixtures / "sp_unk" / "tokenizer.json");
  const Json expected = read_json_file(kFixtures / "sp_unk" / "expected.json");
  REQUIRE(expected.size() >= 10);
  const Tokenizer fused = Tokenizer::from_json_text(spec.dump(), "sp_unk");
  spec["model"]["fuse_unk"] = false;
  const Tokenizer unfused = Tokenizer::from_json_text(spec.dump(), "sp_unk, fuse_unk false");
  spec["model"]["unk_token"] = nullptr;
  const Tokenizer no_unk = Tokenizer::from_json_text(spec.dump(), "sp_unk, no unk_token");
  for (const Json& c : expected.as_array()) {
    const std::string& text = c.at("text").as_string();
    INFO("\"" << text << "\"");
    CHECK(fused.encode(text) == ids_of(c.at("ids")));
    CHECK(unfused.encode(text) == ids_of(c.at("ids_no_fuse")));
    CHECK(no_unk.encode(text) == ids_of(c.at("ids_no_unk")));
    CHECK(fused.decode(ids_of(c.at("ids"))) == c.at("decoded").as_string());
    CHECK(fused.decode(ids_of(c.at("ids")), true) == c.at("decoded_skip").as_string());
  }
  // "cé": c is unk, é falls back to bytes, and the pending unk comes after them.
  CHECK(fused.encode("cé") == std::vector<int32_t>{2, 8, 9, 0});
}

TEST_CASE("tokenizer refuses what it does not implement, naming it", "[cpu][data]") {
  auto load = [](const std::string& key, const std::string& value) {
    return Tokenizer::from_json_text(minimal_json(key, value), "tokenizer.json");
  };
  CHECK(load("normalizer", "null").encode("ab") == std::vector<int32_t>{2});
  // Without a decoder the package joins the tokens with spaces.
  CHECK(load("decoder", "null").decode(std::vector<int32_t>{2, 0}) == "ab a");
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Whitespace"})"),
                   "tokenizer.json: pre_tokenizer Whitespace is not supported");
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Sequence", "pretokenizers": [
                          {"type": "ByteLevel"}, {"type": "Split", "behavior": "Isolated",
                          "pattern": {"Regex": "a"}}]})"),
                   "pre_tokenizer ByteLevel in this position");
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Sequence", "pretokenizers": [
                          {"type": "Metaspace", "replacement": "▁"}]})"),
                   "pre_tokenizer Metaspace in this position");
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Sequence", "pretokenizers": [
                          {"type": "Split", "behavior": "Removed", "pattern": {"Regex": "a"}},
                          {"type": "ByteLevel"}]})"),
                   "pre_tokenizer Split behavior Removed is not supported");
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Metaspace", "replacement": "▁",
                          "prepend_scheme": "first", "add_prefix_space": false})"),
                   "add_prefix_space false contradicts prepend_scheme first");
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Metaspace", "replacement": "__"})"),
                   "replacement: expected one character");
  CHECK_USER_ERROR(load("model", R"({"type": "WordPiece", "vocab": {}})"),
                   "tokenizer.json: model type WordPiece is not supported (only BPE is)");
  CHECK_USER_ERROR(load("model", R"({"type": "Unigram", "unk_id": 0, "byte_fallback": true,
                          "vocab": [["<unk>", 0.0], ["a", -1.5]]})"),
                   "tokenizer.json: model type Unigram is not supported (only BPE is)");
  CHECK_USER_ERROR(load("normalizer", R"({"type": "NFKC"})"),
                   "tokenizer.json: normalizer NFKC is not supported");
  // T5 / ALBERT: SentencePiece's own normalization table.
  CHECK_USER_ERROR(load("normalizer", R"({"type": "Sequence", "normalizers": [
                          {"type": "Precompiled", "precompiled_charsmap": "AAAA"},
                          {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]})"),
                   "tokenizer.json: normalizer Precompiled is not supported");
  CHECK_USER_ERROR(load("normalizer", R"({"type": "Replace", "pattern": {"Regex": " {2,}"},
                          "content": " "})"),
                   "normalizer Replace with a Regex pattern is not supported");
  CHECK_USER_ERROR(load("decoder", R"({"type": "WordPiece", "prefix": "##"})"),
                   "tokenizer.json: decoder WordPiece is not supported");
  CHECK_USER_ERROR(load("decoder", R"({"type": "Sequence", "decoders": [{"type": "Fuse"},
                          {"type": "CTC"}]})"),
                   "tokenizer.json: decoder CTC is not supported");
  CHECK_USER_ERROR(load("post_processor", R"({"type": "TemplateProcessing", "single": [
                          {"Sequence": {"id": "A", "type_id": 0}},
                          {"Sequence": {"id": "B", "type_id": 1}}], "special_tokens": {}})"),
                   "post_processor TemplateProcessing with Sequence B in its single template is "
                   "not supported");
  CHECK_USER_ERROR(load("post_processor", R"({"type": "TemplateProcessing", "single": [
                          {"SpecialToken": {"id": "<s>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {}})"),
                   "'<s>' is not in special_tokens");
  CHECK_USER_ERROR(load("post_processor", R"({"type": "TemplateProcessing", "single": [
                          {"SpecialToken": {"id": "<s>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {
                          "<s>": {"id": "<s>", "ids": [7], "tokens": ["<s>"]}}})"),
                   "the template's id 7 is not in the vocabulary");
  CHECK(load("post_processor", R"({"type": "TemplateProcessing", "single": [
               {"Sequence": {"id": "A", "type_id": 0}}]})")
            .encode("ab", true) == std::vector<int32_t>{2});
  CHECK_USER_ERROR(load("post_processor", R"({"type": "BertProcessing"})"),
                   "post_processor BertProcessing");
  CHECK_USER_ERROR(load("added_tokens", R"([{"id": 3, "content": "<x>", "single_word": true}])"),
                   "added token '<x>' with single_word true is not supported");
  CHECK_USER_ERROR(load("truncation", R"({"max_length": 8})"), "truncation");
  CHECK_USER_ERROR(load("model", R"({"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]})"),
                   "model.merges[0]: 'a' or 'b' is not in the vocab");
  // Found by fuzz/tokenizer_fuzz.cpp: an id near INT32_MAX sized a 64 GB table; an empty token
  // (here the unk) encoded to an id that decode then called unknown.
  CHECK_USER_ERROR(
      load("model", R"({"type": "BPE", "vocab": {"a": 2147483646}, "merges": []})"),
      "model.vocab: id 2147483646 of 'a' is out of range (ids run from 0 to 16777215)");
  CHECK_USER_ERROR(load("added_tokens", R"([{"id": 16777216, "content": "<x>"}])"),
                   "added_tokens[0]: id 16777216 is out of range");
  CHECK_USER_ERROR(load("model", R"({"type": "BPE", "unk_token": "", "vocab": {"": 0, "a": 1},
                          "merges": []})"),
                   "model.vocab: id 0 is the empty string");
  CHECK_USER_ERROR(load("pre_tokenizer", R"({"type": "Sequence", "pretokenizers": [
                          {"type": "Split", "behavior": "Isolated", "pattern": {"Regex": "(a"}},
                          {"type": "ByteLevel"}]})"),
                   "regex does not compile");

  const std::string missing = (kFixtures / "no_such" / "tokenizer.json").string();
  CHECK_USER_ERROR(Tokenizer::load(missing), missing + ": not found");
}

TEST_CASE("tokenizer: a pre-tokenizer regex that backtracks past PCRE2's limits is named",
          "[cpu][data]") {
  // (a+)+$ on a run of a's that ends in a b tries 2^n ways to split the run: PCRE2 gives up at
  // its match limit (10^7 steps) in well under a second, and that is the tokenizer file's doing.
  const Tokenizer t = Tokenizer::from_json_text(
      minimal_json("pre_tokenizer", R"({"type": "Sequence", "pretokenizers": [
                     {"type": "Split", "behavior": "Isolated", "pattern": {"Regex": "(a+)+$"}},
                     {"type": "ByteLevel", "add_prefix_space": false}]})"),
      "bad/tokenizer.json");
  CHECK(t.encode("ab") == std::vector<int32_t>{2});
  CHECK_USER_ERROR(t.encode(std::string(40, 'a') + "b"),
                   "bad/tokenizer.json: pre_tokenizer Split: the regex '(a+)+$' hit PCRE2's");
}
