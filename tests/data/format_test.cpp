// Token shard formats: Megatron .bin/.idx (writer round trip, hand-built files, a fixture written
// by an independent numpy writer, every corruption case) and flat uint16/uint32 files.
#include <string>
#include <vector>

#include "catch.h"
#include "data/indexed_dataset_writer.h"
#include "data/token_shard.h"
#include "data_test_util.h"
#include "test_util.h"

using namespace mop;
using test::IdxSpec;
using test::TempDir;

namespace {
std::vector<uint32_t> read_all(const TokenShard& shard, int64_t vocab_size = kNoVocabLimit) {
  std::vector<uint32_t> out(size_t(shard.num_tokens()));
  shard.read(0, shard.num_tokens(), out.data(), vocab_size);
  return out;
}

// A valid uint16 dataset of 3 sequences in 2 documents (the first split into two sentences, as
// preprocess_data.py --split-sentences writes it): tokens 10 11 12 | 20 21 | 30 31 32 33.
struct HandBuilt {
  IdxSpec idx;
  std::vector<int64_t> tokens = {10, 11, 12, 20, 21, 30, 31, 32, 33};
  HandBuilt() {
    idx.dtype_code = 8;
    idx.lengths = {3, 2, 4};
    idx.pointers = {0, 6, 10};
    idx.documents = {0, 2, 3};
  }
  void write(const TempDir& dir, const std::string& name, std::vector<uint8_t> idx_bytes = {},
             std::vector<uint8_t> bin_bytes = {}) const {
    test::write_file(dir / (name + ".idx"), idx_bytes.empty() ? idx.bytes() : idx_bytes);
    test::write_file(dir / (name + ".bin"),
                     bin_bytes.empty() ? test::token_bytes(tokens, 2) : bin_bytes);
  }
};
}  // namespace

TEST_CASE("megatron writer round trip in every integer dtype", "[cpu][data]") {
  TempDir dir;
  struct Case {
    TokenDType dtype;
    uint32_t max_token;
  };
  for (Case c :
       {Case{TokenDType::U16, 65535}, Case{TokenDType::I32, 2147483647}, Case{TokenDType::U8, 255},
        Case{TokenDType::I16, 32767}, Case{TokenDType::I64, 4294967295u}}) {
    DYNAMIC_SECTION(token_dtype_name(c.dtype)) {
      std::string prefix = dir / std::string(token_dtype_name(c.dtype));
      std::vector<std::vector<uint32_t>> docs = {{1, 2, 3}, {}, {c.max_token, 0}, {7}};
      IndexedDatasetWriter writer(prefix, c.dtype);
      for (const auto& d : docs) writer.add_document(d);
      writer.finish();
      CHECK(writer.num_documents() == 4);
      CHECK(writer.num_tokens() == 6);
      // Header + 4 lengths + 4 pointers + 5 document indices.
      CHECK(std::filesystem::file_size(prefix + ".idx") == 34 + 4 * 4 + 8 * 4 + 8 * 5);
      CHECK(!std::filesystem::exists(prefix + ".bin.tmp"));

      for (std::string name : {prefix, prefix + ".bin", prefix + ".idx"}) {
        TokenShard shard = TokenShard::open_megatron(name);
        CHECK(shard.is_megatron());
        CHECK(shard.dtype() == c.dtype);
        CHECK(shard.path() == prefix + ".bin");
        CHECK(read_all(shard) == std::vector<uint32_t>{1, 2, 3, c.max_token, 0, 7});
        CHECK(shard.document_boundaries() == std::vector<int64_t>{0, 3, 3, 5, 6});
      }
    }
  }
}

TEST_CASE("megatron writer picks Megatron's dtype and leaves nothing on abandon", "[cpu][data]") {
  CHECK(megatron_dtype_for_vocab(50257) == TokenDType::U16);
  CHECK(megatron_dtype_for_vocab(65499) == TokenDType::U16);
  CHECK(megatron_dtype_for_vocab(65500) == TokenDType::I32);
  CHECK(megatron_dtype_for_vocab(151936) == TokenDType::I32);
  TempDir dir;
  {
    IndexedDatasetWriter writer(dir / "abandoned", TokenDType::U16);
    writer.add_document(std::vector<uint32_t>{1, 2});
  }
  CHECK(std::filesystem::is_empty(dir.path));
  CHECK_USER_ERROR(IndexedDatasetWriter(dir / "no/such/dir/x", TokenDType::U16),
                   "cannot write " + (dir / "no/such/dir/x.bin"));
}

TEST_CASE("a hand-built .bin/.idx pair reads back", "[cpu][data]") {
  TempDir dir;
  HandBuilt hb;
  hb.write(dir, "hand");
  TokenShard shard = TokenShard::open_megatron(dir / "hand");
  CHECK(shard.dtype() == TokenDType::U16);
  CHECK(shard.num_tokens() == 9);
  CHECK(read_all(shard) == std::vector<uint32_t>{10, 11, 12, 20, 21, 30, 31, 32, 33});
  // Each Megatron sequence is a document unit.
  CHECK(shard.document_boundaries() == std::vector<int64_t>{0, 3, 5, 9});
  std::vector<uint32_t> part(3);
  shard.read(4, 3, part.data());
  CHECK(part == std::vector<uint32_t>{21, 30, 31});

  // int64 tokens (code 5), and an empty sequence.
  IdxSpec i64;
  i64.dtype_code = 5;
  i64.lengths = {2, 0, 1};
  i64.pointers = {0, 16, 16};
  i64.documents = {0, 3};
  test::write_file(dir / "wide.idx", i64.bytes());
  test::write_file(dir / "wide.bin", test::token_bytes({5, 4000000000, 9}, 8));
  TokenShard wide = TokenShard::open_megatron(dir / "wide.idx");
  CHECK(wide.dtype() == TokenDType::I64);
  CHECK(read_all(wide) == std::vector<uint32_t>{5, 4000000000u, 9});
  CHECK(wide.document_boundaries() == std::vector<int64_t>{0, 2, 2, 3});
}

TEST_CASE("a fixture from an independent numpy writer reads back", "[cpu][data]") {
  // tests/data/make_megatron_fixture.py writes these the way Megatron's _IndexWriter does.
  const std::string fixtures = std::string(MOP_SOURCE_DIR) + "/tests/data/fixtures/";
  TokenShard u16 = TokenShard::open_megatron(fixtures + "megatron_uint16");
  CHECK(u16.dtype() == TokenDType::U16);
  CHECK(read_all(u16, 50257) ==
        std::vector<uint32_t>{15496, 11, 995, 0, 40, 716, 50256, 3666, 1438, 318, 50256});
  CHECK(u16.document_boundaries() == std::vector<int64_t>{0, 4, 6, 7, 11});

  TokenShard i32 = TokenShard::open_megatron(fixtures + "megatron_int32.bin");
  CHECK(i32.dtype() == TokenDType::I32);
  CHECK(read_all(i32, 151936) == std::vector<uint32_t>{151643, 100000, 120000, 7, 151935, 0});
  CHECK(i32.document_boundaries() == std::vector<int64_t>{0, 1, 4, 6});
}

TEST_CASE("corrupt Megatron datasets are UserErrors naming the file and the fault", "[cpu][data]") {
  TempDir dir;
  const std::string idx = dir / "x.idx", bin = dir / "x.bin";
  auto open = [&] { return TokenShard::open_megatron(dir / "x"); };
  HandBuilt good;
  good.write(dir, "x");
  REQUIRE(open().num_tokens() == 9);

  SECTION("bad magic") {
    IdxSpec s = good.idx;
    s.magic[0] = 'X';
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx + ": bad magic");
  }
  SECTION("empty index") {
    std::filesystem::resize_file(idx, 0);
    CHECK_USER_ERROR(open(), idx + ": empty file");
  }
  SECTION("header cut short") {
    std::filesystem::resize_file(idx, 20);
    CHECK_USER_ERROR(open(), idx + ": truncated: the file ends inside the 34-byte header");
  }
  SECTION("bad version") {
    IdxSpec s = good.idx;
    s.version = 2;
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx + ": unsupported version 2");
  }
  SECTION("float and int8 dtype codes") {
    IdxSpec s = good.idx;
    s.dtype_code = 7;
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx + ": unsupported dtype code 7 (float32)");
    s.dtype_code = 2;
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), "unsupported dtype code 2 (int8)");
    s.dtype_code = 6;
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), "unsupported dtype code 6 (float64)");
    s.dtype_code = 9;
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx + ": unknown dtype code 9");
  }
  SECTION("truncated index") {
    std::vector<uint8_t> b = good.idx.bytes();
    b.resize(b.size() - 8);
    good.write(dir, "x", b);
    CHECK_USER_ERROR(open(),
                     idx + ": truncated: header says 3 document indices but the file ends after 2");
    IdxSpec s = good.idx;
    s.num_sequences = 1200;
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(),
                     idx +
                         ": truncated: header says 1200 sequences but the file ends after 15 "
                         "sequence lengths");
    s.num_sequences = 6;  // 60 bytes after the header: 6 lengths, then room for 4 pointers
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), "header says 6 sequences but the file ends after 4 pointers");
  }
  SECTION("oversized index") {
    std::vector<uint8_t> b = good.idx.bytes();
    b.push_back(0);
    good.write(dir, "x", b);
    CHECK_USER_ERROR(open(), idx +
                                 ": oversized: header says 3 sequences and 3 document indices "
                                 "(94 bytes) but the file has 95 bytes");
    b.push_back(0), b.push_back(0);
    good.write(dir, "x", b);
    CHECK_USER_ERROR(open(), "multimodal");
  }
  SECTION("pointer past the end of the .bin") {
    IdxSpec s = good.idx;
    s.pointers[2] = 1000;
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx + ": pointer of sequence 2 (byte 1000) is past the end of " + bin +
                                 " (18 bytes)");
  }
  SECTION("pointers out of order") {
    IdxSpec s = good.idx;
    s.pointers = {0, 8, 6};
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx +
                                 ": sequence 1 starts at byte 8 but the sequences before it end "
                                 "at byte 6");
  }
  SECTION("negative length") {
    IdxSpec s = good.idx;
    s.lengths[1] = -2;
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx + ": sequence 1 has negative length -2");
  }
  SECTION(".bin shorter or longer than the index says") {
    std::filesystem::resize_file(bin, 16);
    CHECK_USER_ERROR(open(), idx + ": sequence 2 (4 tokens from byte 10) runs past the end of " +
                                 bin + " (16 bytes)");
    std::filesystem::resize_file(bin, 20);
    CHECK_USER_ERROR(open(), bin + ": has 20 bytes but " + idx + " describes 18");
  }
  SECTION("document indices") {
    IdxSpec s = good.idx;
    s.documents = {0, 2, 1, 3};
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx + ": document indices decrease: entry 2 is 1 after 2");
    s.documents = {0, 2};
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx + ": the last document index is 2 but there are 3 sequences");
    s.documents = {1, 3};
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx + ": document index 0 is 1, expected 0");
    s.documents = {};
    good.write(dir, "x", s.bytes());
    CHECK_USER_ERROR(open(), idx + ": has no document indices");
  }
  SECTION("missing files") {
    std::filesystem::remove(idx);
    CHECK_USER_ERROR(open(), idx + ": no such file (a Megatron dataset needs " + bin);
    good.write(dir, "x");
    std::filesystem::remove(bin);
    CHECK_USER_ERROR(open(), bin + ": no such file");
  }
}

TEST_CASE("flat token files: uint16 and uint32, EOS boundaries, odd sizes", "[cpu][data]") {
  TempDir dir;
  test::write_file(dir / "a.u16", test::token_bytes({1, 2, 0, 3, 0, 65535}, 2));
  TokenShard a = TokenShard::open_flat(dir / "a.u16", TokenDType::U16, 0);
  CHECK(!a.is_megatron());
  CHECK(read_all(a) == std::vector<uint32_t>{1, 2, 0, 3, 0, 65535});
  CHECK(a.document_boundaries() == std::vector<int64_t>{0, 3, 5, 6});
  CHECK(TokenShard::open_flat(dir / "a.u16", TokenDType::U16, -1).document_boundaries() ==
        std::vector<int64_t>{0, 6});

  test::write_file(dir / "b.u32", test::token_bytes({100000, 7, 7}, 4));
  TokenShard b = TokenShard::open_flat(dir / "b.u32", TokenDType::U32, 7);
  CHECK(read_all(b) == std::vector<uint32_t>{100000, 7, 7});
  CHECK(b.document_boundaries() == std::vector<int64_t>{0, 2, 3});

  test::write_file(dir / "odd.u16", {1, 0, 2});
  CHECK_USER_ERROR(TokenShard::open_flat(dir / "odd.u16", TokenDType::U16, -1),
                   (dir / "odd.u16") + ": size 3 bytes is not a multiple of 2 (uint16 tokens)");
  CHECK_USER_ERROR(TokenShard::open_flat(dir / "odd.u16", TokenDType::U32, -1),
                   "size 3 bytes is not a multiple of 4 (uint32 tokens)");
  CHECK_USER_ERROR(TokenShard::open_flat(dir / "missing.u16", TokenDType::U16, -1),
                   (dir / "missing.u16") + ": not found");
  CHECK_USER_ERROR(TokenShard::open_flat(dir.path.string(), TokenDType::U16, -1),
                   "is not a regular file (a directory)");
  CHECK_USER_ERROR(parse_flat_dtype("int32"), "flat token dtype must be uint16 or uint32");
  test::write_file(dir / "empty.u16", {});
  TokenShard empty = TokenShard::open_flat(dir / "empty.u16", TokenDType::U16, 0);
  CHECK(empty.num_tokens() == 0);
  CHECK(empty.document_boundaries() == std::vector<int64_t>{0});
}

TEST_CASE("tokens outside the vocabulary name the file, position and id", "[cpu][data]") {
  TempDir dir;
  const std::string flat = dir / "big.u32";
  test::write_file(flat, test::token_bytes({1, 2, 3, 4, 5, 70000, 6}, 4));
  TokenShard shard = TokenShard::open_flat(flat, TokenDType::U32, -1);
  std::vector<uint32_t> out(7);
  shard.read(0, 5, out.data(), 65536);  // the bad token is outside this range
  const std::string expected =
      flat + ": token 70000 at position 5 is outside the vocabulary (vocab_size 65536)";
  CHECK(test::user_error_of([&] { shard.read(2, 5, out.data(), 65536); }) == expected);
  CHECK(test::user_error_of([&] { shard.validate_tokens(65536); }) == expected);
  shard.validate_tokens(70001);

  // Signed Megatron dtypes: negative ids are outside the vocabulary too.
  IdxSpec s;
  s.dtype_code = 4;
  s.lengths = {3};
  s.pointers = {0};
  s.documents = {0, 1};
  test::write_file(dir / "neg.idx", s.bytes());
  test::write_file(dir / "neg.bin", test::token_bytes({4, 5, -3}, 4));
  TokenShard neg = TokenShard::open_megatron(dir / "neg");
  CHECK(test::user_error_of([&] { neg.read(0, 3, out.data(), 100); }) ==
        (dir / "neg.bin") + ": token -3 at position 2 is outside the vocabulary (vocab_size 100)");
  CHECK_USER_ERROR(neg.validate_tokens(100), "token -3 at position 2");
}

TEST_CASE("format detection: auto, megatron, flat", "[cpu][data]") {
  TempDir dir;
  HandBuilt hb;
  hb.write(dir, "m");
  test::write_file(dir / "f.u16", test::token_bytes({1, 2, 3}, 2));
  CHECK(looks_like_megatron(dir / "m"));
  CHECK(looks_like_megatron(dir / "m.bin"));
  CHECK(looks_like_megatron(dir / "m.idx"));
  CHECK(!looks_like_megatron(dir / "f.u16"));
  CHECK(open_token_shard(dir / "m", "auto", TokenDType::U16, -1).is_megatron());
  CHECK(open_token_shard(dir / "m.bin", "auto", TokenDType::U16, -1).num_tokens() == 9);
  CHECK(!open_token_shard(dir / "f.u16", "auto", TokenDType::U16, -1).is_megatron());
  // Forced flat: the .bin read as raw uint16 (its 9 tokens, no index).
  CHECK(!open_token_shard(dir / "m.bin", "flat", TokenDType::U16, -1).is_megatron());
  CHECK_USER_ERROR(open_token_shard(dir / "f.u16", "megatron", TokenDType::U16, -1),
                   (dir / "f.u16.idx") + ": no such file");
  CHECK_USER_ERROR(open_token_shard(dir / "nope", "auto", TokenDType::U16, -1),
                   (dir / "nope") + ": no such file (expected a flat token file, or the prefix");
  CHECK_USER_ERROR(open_token_shard(dir / "m", "jsonl", TokenDType::U16, -1),
                   "data format must be auto, megatron or flat (got \"jsonl\")");
}
