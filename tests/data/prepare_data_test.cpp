// prepare_data: text files → byte-level Megatron dataset, in both document split modes; random
// token shards for benchmarks.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "catch.h"
#include "ckpt/json.h"
#include "data/prepare_data.h"
#include "data/tokenizer.h"
#include "data/token_shard.h"
#include "data_test_util.h"
#include "test_util.h"

using namespace mop;
using test::TempDir;

namespace {
// Bytes of `text` as token ids, then EOS.
std::vector<uint32_t> doc(const std::string& text) {
  std::vector<uint32_t> t(text.begin(), text.end());
  for (uint32_t& v : t) v &= 0xff;
  t.push_back(kByteEosId);
  return t;
}

std::vector<uint32_t> concat(const std::vector<std::vector<uint32_t>>& docs) {
  std::vector<uint32_t> all;
  for (const auto& d : docs) all.insert(all.end(), d.begin(), d.end());
  return all;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<uint32_t> read_all(const TokenShard& shard) {
  std::vector<uint32_t> out(size_t(shard.num_tokens()));
  shard.read(0, shard.num_tokens(), out.data(), kByteVocabSize);
  return out;
}

const std::string kA = "Hello\nworld\n\n\nSecond para\r\nline2\r\n";
const std::string kB = "  \n\xc3\xa9t\xc3\xa9\n \t\nB2";
}  // namespace

TEST_CASE("prepare_data: one document per file", "[cpu][data]") {
  TempDir dir;
  test::write_text(dir / "a.txt", kA);
  test::write_text(dir / "b.txt", kB);
  PrepareDataOptions o;
  o.inputs = {dir / "a.txt", dir / "b.txt"};
  o.output = dir / "out/nested/bytes";  // parent directories are created
  PrepareDataStats stats = prepare_data(o);
  CHECK(stats.num_documents == 2);
  CHECK(stats.num_tokens == int64_t(kA.size() + kB.size() + 2));
  CHECK(stats.num_input_bytes == int64_t(kA.size() + kB.size()));
  CHECK(stats.bin_path == dir / "out/nested/bytes.bin");
  CHECK(stats.num_output_bytes == int64_t(std::filesystem::file_size(stats.bin_path) +
                                          std::filesystem::file_size(stats.idx_path)));

  TokenShard shard = TokenShard::open_megatron(o.output);
  CHECK(shard.dtype() == TokenDType::U16);
  CHECK(read_all(shard) == concat({doc(kA), doc(kB)}));
  CHECK(shard.document_boundaries() ==
        std::vector<int64_t>{0, int64_t(kA.size() + 1), stats.num_tokens});
}

TEST_CASE("prepare_data: blank lines separate documents", "[cpu][data]") {
  TempDir dir;
  test::write_text(dir / "a.txt", kA);
  test::write_text(dir / "b.txt", kB);
  PrepareDataOptions o;
  o.inputs = {dir / "a.txt", dir / "b.txt"};
  o.output = dir / "bytes.bin";  // a file name works as the prefix too
  o.split = parse_doc_split("blank-line");
  PrepareDataStats stats = prepare_data(o);
  // Inner line breaks stay (CRLF included); the break after a block's last line goes; lines of
  // only spaces/tabs count as blank; documents never span files.
  std::vector<std::vector<uint32_t>> docs = {doc("Hello\nworld"), doc("Second para\r\nline2"),
                                             doc("\xc3\xa9t\xc3\xa9"), doc("B2")};
  CHECK(stats.num_documents == 4);
  TokenShard shard = TokenShard::open_megatron(dir / "bytes");
  CHECK(read_all(shard) == concat(docs));
  CHECK(shard.document_boundaries() == std::vector<int64_t>{0, 12, 31, 37, 40});
  CHECK(stats.num_tokens == 40);
}

TEST_CASE("prepare_data: bad inputs are UserErrors", "[cpu][data]") {
  TempDir dir;
  test::write_text(dir / "ok.txt", "text\n");
  test::write_text(dir / "empty.txt", "");
  test::write_text(dir / "blank.txt", "\n  \n\r\n");
  PrepareDataOptions o;
  o.output = dir / "out";
  CHECK_USER_ERROR(prepare_data(o), "at least one input file");
  o.inputs = {dir / "ok.txt", dir / "missing.txt"};
  CHECK_USER_ERROR(prepare_data(o), (dir / "missing.txt") + ": not found");
  o.inputs = {dir / "empty.txt"};
  CHECK_USER_ERROR(prepare_data(o), (dir / "empty.txt") + ": is empty");
  o.inputs = {dir / "ok.txt", dir / "blank.txt"};
  o.split = DocSplit::BlankLine;
  CHECK_USER_ERROR(prepare_data(o), (dir / "blank.txt") + ": no documents (only blank lines)");
  // Nothing half-written is left behind.
  CHECK(!std::filesystem::exists(dir / "out.bin"));
  CHECK(!std::filesystem::exists(dir / "out.bin.tmp"));
  CHECK_USER_ERROR(parse_doc_split("paragraph"),
                   "document split must be file or blank-line (got \"paragraph\")");
  test::write_text(dir / "file_not_dir", "x");
  o.inputs = {dir / "ok.txt"};
  o.output = dir / "file_not_dir/out";
  CHECK_USER_ERROR(prepare_data(o), "cannot create directory " + (dir / "file_not_dir"));
}

TEST_CASE("prepare_random_tokens: uniform ids over the vocabulary, reproducible by seed",
          "[cpu][data]") {
  TempDir dir;
  RandomTokensOptions o;
  o.output = dir / "rand/a";
  o.num_tokens = 300001;
  o.vocab_size = 151936;  // beyond uint16: int32 ids, as Megatron stores Qwen's vocabulary
  o.document_tokens = 100000;
  o.seed = 7;
  const PrepareDataStats st = prepare_random_tokens(o);
  CHECK(st.num_documents == 4);
  CHECK(st.num_tokens == 300001);
  TokenShard a = TokenShard::open_megatron(o.output);
  CHECK(a.dtype() == TokenDType::I32);
  CHECK(a.document_boundaries() == std::vector<int64_t>{0, 100000, 200000, 300000, 300001});
  std::vector<uint32_t> ids(300001);
  a.read(0, 300001, ids.data(), o.vocab_size);  // throws on an id outside [0, V)
  // Uniform: 64 equal ranges of the vocabulary get 300001/64 ≈ 4688 ids each; a draw that is
  // skewed by a few percent (modulo bias of a 16-bit draw, a byte-level range) falls outside ±6σ.
  std::vector<int64_t> bins(64, 0);
  for (uint32_t v : ids) ++bins[size_t(uint64_t(v) * 64 / uint64_t(o.vocab_size))];
  const double expect = 300001.0 / 64, sigma = std::sqrt(expect);
  for (int64_t b : bins) CHECK(std::abs(double(b) - expect) < 6 * sigma);
  CHECK(*std::max_element(ids.begin(), ids.end()) > uint32_t(o.vocab_size - 100));

  // The same seed writes the same file; another seed another one; a small vocabulary uint16.
  o.output = dir / "rand/b";
  prepare_random_tokens(o);
  CHECK(file_bytes(dir / "rand/a.bin") == file_bytes(dir / "rand/b.bin"));
  o.output = dir / "rand/c";
  o.seed = 8;
  prepare_random_tokens(o);
  CHECK(file_bytes(dir / "rand/a.bin") != file_bytes(dir / "rand/c.bin"));
  o.output = dir / "rand/small";
  o.vocab_size = 257;
  o.num_tokens = 10;
  prepare_random_tokens(o);
  CHECK(TokenShard::open_megatron(o.output).dtype() == TokenDType::U16);

  o.num_tokens = 0;
  CHECK_THROWS_WITH(prepare_random_tokens(o), Catch::Contains("--random-tokens 0: must be at least 1"));
  o.num_tokens = 5;
  o.vocab_size = 1;
  CHECK_THROWS_WITH(prepare_random_tokens(o), Catch::Contains("--vocab-size 1: must be in"));
}

TEST_CASE("prepare_data with a tokenizer: its ids and its EOS per document, text and JSON lines",
          "[cpu][data]") {
  TempDir dir;
  const std::string tok_path = std::string(MOP_SOURCE_DIR) + "/tests/data/fixtures/tokenizer/qwen2/tokenizer.json";
  const Tokenizer tok = Tokenizer::load(tok_path);
  const int32_t eos = *tok.token_id("<|endoftext|>");
  const std::vector<std::string> docs = {"In the beginning God created the heaven and the earth.",
                                         "混合专家 😀👍🏽 naïve café\tdon't",
                                         "And the earth was without form, and void."};
  test::write_text(dir / "a.txt", docs[0] + "\n\n" + docs[1] + "\n\n\n" + docs[2] + "\n");
  std::string jsonl;
  for (const std::string& d : docs) jsonl += "{\"id\": 1, \"text\": " + Json(d).dump() + "}\n\n";
  test::write_text(dir / "a.jsonl", jsonl);
  std::vector<uint32_t> want;
  for (const std::string& d : docs) {
    for (int32_t id : tok.encode(d)) want.push_back(uint32_t(id));
    want.push_back(uint32_t(eos));
  }
  for (int json = 0; json < 2; ++json) {
    INFO((json ? "json lines" : "blank-line text"));
    PrepareDataOptions o;
    o.inputs = {dir / (json ? "a.jsonl" : "a.txt")};
    o.output = dir / (json ? "j" : "t");
    o.split = DocSplit::BlankLine;
    o.tokenizer = tok_path;
    if (json) o.json_key = "text";
    const PrepareDataStats st = prepare_data(o);
    CHECK(st.num_documents == 3);
    CHECK(st.eos_id == eos);
    CHECK(st.vocab_size == tok.vocab_size());
    TokenShard shard = TokenShard::open_megatron(o.output);
    CHECK(shard.dtype() == TokenDType::U16);  // the smallest that holds 2,000+ ids
    std::vector<uint32_t> got(size_t(shard.num_tokens()));
    shard.read(0, shard.num_tokens(), got.data());
    CHECK(got == want);
    CHECK(shard.document_boundaries().size() == 4);
  }
  // A template tokenizer (Llama 3's <|begin_of_text|> $A): each document starts with its BOS, as
  // Megatron's preprocess_data.py writes it through a Hugging Face tokenizer; the tokenizer is
  // copied beside the shards.
  {
    const std::string llama = std::string(MOP_SOURCE_DIR) + "/tests/data/fixtures/tokenizer/llama3/tokenizer.json";
    const Tokenizer lt = Tokenizer::load(llama);
    const uint32_t bos = uint32_t(*lt.token_id("<|begin_of_text|>")), end = uint32_t(*lt.token_id("<|end_of_text|>"));
    std::vector<uint32_t> with_bos;
    for (const std::string& d : docs) {
      with_bos.push_back(bos);
      for (int32_t id : lt.encode(d)) with_bos.push_back(uint32_t(id));
      with_bos.push_back(end);
    }
    PrepareDataOptions o;
    o.inputs = {dir / "a.txt"};
    o.output = dir / "llama";
    o.split = DocSplit::BlankLine;
    o.tokenizer = llama;
    prepare_data(o);
    TokenShard shard = TokenShard::open_megatron(o.output);
    std::vector<uint32_t> got(size_t(shard.num_tokens()));
    shard.read(0, shard.num_tokens(), got.data());
    CHECK(got == with_bos);
    std::ifstream a(llama, std::ios::binary), b(dir / "llama.tokenizer.json", std::ios::binary);
    CHECK(std::string(std::istreambuf_iterator<char>(a), {}) == std::string(std::istreambuf_iterator<char>(b), {}));
  }
  // Errors name the problem: an EOS the tokenizer lacks, a line without the key, --json-key alone.
  PrepareDataOptions o;
  o.inputs = {dir / "a.jsonl"};
  o.output = dir / "x";
  o.tokenizer = tok_path;
  o.eos_token = "</nope>";
  CHECK_THROWS_WITH(prepare_data(o), Catch::Contains("--eos-token </nope>: not a token of"));
  o.eos_token.clear();
  o.json_key = "body";
  CHECK_THROWS_WITH(prepare_data(o), Catch::Contains("a.jsonl:1: no string \"body\" (--json-key)"));
  o.tokenizer.clear();
  CHECK_THROWS_WITH(prepare_data(o), Catch::Contains("--json-key needs --tokenizer"));
}
