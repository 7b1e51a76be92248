// safetensors: write → read round trips over every dtype (scalars and empty tensors included),
// exact bytes against a file built from the spec and against one the official library wrote,
// and a UserError for every kind of corrupt file.
#include <cstring>
#include <vector>

#include "catch.h"
#include "ckpt/safetensors.h"
#include "ckpt_test_util.h"
#include "test_util.h"

using namespace mop;

namespace {

// A safetensors file from its parts: u64 little-endian header length (`n` overrides it), header,
// data.
std::string raw_file(const std::string& header, const std::string& data, int64_t n = -1) {
  uint64_t len = n < 0 ? header.size() : uint64_t(n);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(len >> (8 * i));
  return out + header + data;
}

template <class T>
std::string le_bytes(std::initializer_list<T> values) {
  std::string s;
  for (T v : values) s.append(reinterpret_cast<const char*>(&v), sizeof v);
  return s;
}

// A host buffer with a distinct byte pattern per tensor, so a swapped or shifted tensor shows.
struct Buffer {
  std::vector<uint64_t> storage;
  Tensor t;
  Buffer(DType dtype, std::initializer_list<int64_t> dims, uint8_t seed) {
    t = Tensor(nullptr, dtype, dims);
    storage.assign(t.bytes() / 8 + 1, 0);
    t.data = storage.data();
    auto* p = static_cast<uint8_t*>(t.data);
    for (size_t i = 0; i < t.bytes(); ++i) p[i] = uint8_t(seed * 31 + i * 7);
  }
};

}  // namespace

TEST_CASE("safetensors: dtype names both ways", "[cpu][ckpt]") {
  for (DType t : {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64, DType::U8,
                  DType::U16, DType::U32})
    CHECK(dtype_from_safetensors(safetensors_dtype(t)) == t);
  CHECK(safetensors_dtype(DType::BF16) == "BF16");
  CHECK(!dtype_from_safetensors("F16"));
  CHECK(!dtype_from_safetensors("f32"));
}

TEST_CASE("safetensors: write then read every dtype, scalar and empty tensors", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  std::vector<Buffer> bufs;
  bufs.emplace_back(DType::F32, std::initializer_list<int64_t>{2, 3}, 1);
  bufs.emplace_back(DType::F64, std::initializer_list<int64_t>{5}, 2);
  bufs.emplace_back(DType::BF16, std::initializer_list<int64_t>{3, 1, 2}, 3);
  bufs.emplace_back(DType::I32, std::initializer_list<int64_t>{7}, 4);
  bufs.emplace_back(DType::I64, std::initializer_list<int64_t>{2, 2}, 5);
  bufs.emplace_back(DType::U8, std::initializer_list<int64_t>{13}, 6);
  bufs.emplace_back(DType::U16, std::initializer_list<int64_t>{3}, 7);
  bufs.emplace_back(DType::U32, std::initializer_list<int64_t>{1, 1, 1, 2}, 8);
  bufs.emplace_back(DType::F32, std::initializer_list<int64_t>{}, 9);          // scalar
  bufs.emplace_back(DType::F32, std::initializer_list<int64_t>{0}, 10);        // empty
  bufs.emplace_back(DType::I64, std::initializer_list<int64_t>{2, 0, 3}, 11);  // empty, 3-d
  const char* names[] = {"w.f32", "w.f64", "w.bf16", "i32",   "i64",   "u8",
                         "u16",   "u32",   "scalar", "empty", "empty3"};
  std::vector<SafetensorsEntry> entries;
  for (size_t i = 0; i < bufs.size(); ++i) entries.push_back({names[i], bufs[i].t});
  SafetensorsMetadata meta{{"format", "pt"}, {"note", "quote \" newline \n é"}};

  const auto path = tmp / "model.safetensors";
  FileDigest d = write_safetensors(path, entries, meta);
  CHECK(d.bytes == std::filesystem::file_size(path));
  CHECK(d.sha256 == sha256_file(path).sha256);

  SafetensorsFile f(path);
  CHECK(f.metadata() == meta);
  REQUIRE(f.tensors().size() == entries.size());
  for (const SafetensorsEntry& e : entries) {
    INFO(e.name);
    const SafetensorsTensor& t = f.at(e.name);
    CHECK(t.dtype == e.tensor.dtype);
    CHECK(t.shape ==
          std::vector<int64_t>(e.tensor.shape.begin(), e.tensor.shape.begin() + e.tensor.ndim));
    CHECK(t.numel() == e.tensor.numel());
    REQUIRE(t.bytes == e.tensor.bytes());
    CHECK(std::memcmp(t.data, e.tensor.data, t.bytes) == 0);
    // Widest dtypes first and a header padded to 8 bytes keep every tensor naturally aligned.
    CHECK(reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) == 0);
    Tensor v = f.view(e.name);
    CHECK(same_shape(v, e.tensor));
    CHECK(v.data == t.data);
  }
  // The reference order: I64, F64, F32, U32, I32, BF16, U16, U8; by name within a dtype.
  const std::string header = ckpt_test::read_bytes(path).substr(8, 1000);
  std::vector<size_t> pos;
  for (const char* n :
       {"empty3", "i64", "w.f64", "empty", "scalar", "w.f32", "u32", "i32", "w.bf16", "u16", "u8"})
    pos.push_back(header.find(std::string(1, '"').append(n).append("\":{")));
  CHECK(std::is_sorted(pos.begin(), pos.end()));
  CHECK(header.find("{\"__metadata__\":{\"format\":\"pt\",\"note\":") == 0);
  CHECK_USER_ERROR(f.at("nope"), "model.safetensors: no tensor 'nope'");
  CHECK(f.find("nope") == nullptr);
}

TEST_CASE("safetensors: writer output matches the format byte for byte", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  float w[2] = {1.5f, -2.0f};
  uint8_t b[3] = {1, 2, 255};
  std::vector<SafetensorsEntry> entries = {{"b", Tensor(b, DType::U8, {3})},
                                           {"a.w", Tensor(w, DType::F32, {2, 1})}};
  write_safetensors(tmp / "x.safetensors", entries, {{"k", "v"}});
  std::string header =
      R"({"__metadata__":{"k":"v"},"a.w":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  CHECK(ckpt_test::read_bytes(tmp / "x.safetensors") ==
        raw_file(header, le_bytes({1.5f, -2.0f}) + "\x01\x02\xff"));
  // No tensors, no metadata: the smallest valid file.
  write_safetensors(tmp / "empty.safetensors", {});
  CHECK(ckpt_test::read_bytes(tmp / "empty.safetensors") == raw_file("{}      ", ""));
  CHECK(SafetensorsFile(tmp / "empty.safetensors").tensors().empty());
  CHECK_USER_ERROR(write_safetensors(tmp / "no_dir/x.safetensors", entries),
                        "cannot create");
}

TEST_CASE("safetensors: a file built by hand from the spec reads back", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  // Unpadded header, members in an order no writer of ours produces, escaped names.
  std::string header =
      R"({"b":{"shape":[],"dtype":"I64","data_offsets":[8,16]},)"
      R"("a\u002ex":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("z":{"dtype":"BF16","shape":[1,1],"data_offsets":[16,18]},"__metadata__":{"who":"hand"}})";
  std::string data =
      le_bytes({0.25f, -3.0f}) + le_bytes({int64_t(-9000000000)}) + le_bytes({uint16_t(0x3f80)});
  ckpt_test::write_bytes(tmp / "h.safetensors", raw_file(header, data));
  SafetensorsFile f(tmp / "h.safetensors");
  CHECK(f.metadata().at("who") == "hand");
  const SafetensorsTensor& a = f.at("a.x");
  CHECK(a.dtype == DType::F32);
  CHECK(a.shape == std::vector<int64_t>{2});
  CHECK(static_cast<const float*>(a.data)[0] == 0.25f);
  CHECK(static_cast<const float*>(a.data)[1] == -3.0f);
  const SafetensorsTensor& b = f.at("b");
  CHECK(b.shape.empty());
  int64_t bv;
  std::memcpy(&bv, b.data, 8);  // an unpadded header leaves the data unaligned
  CHECK(bv == -9000000000);
  Tensor z = f.view("z");
  CHECK(z.ndim == 2);
  bf16 zv;
  std::memcpy(&zv, z.data, 2);
  CHECK(bf16_to_float(zv) == 1.0f);
}

TEST_CASE(
    "safetensors: a file from the official library reads identically and we write it identically",
    "[cpu][ckpt]") {
  const std::filesystem::path fixture =
      std::filesystem::path(MOP_SOURCE_DIR) / "tests/ckpt/fixtures/reference.safetensors";
  SafetensorsFile f(fixture);
  CHECK(f.metadata() == SafetensorsMetadata{{"source", "make_reference_safetensors.py"}});
  REQUIRE(f.tensors().size() == 9);
  auto values = [&](const char* name, DType dtype, std::vector<int64_t> shape) {
    const SafetensorsTensor& t = f.at(name);
    CHECK(t.dtype == dtype);
    CHECK(t.shape == shape);
    return t.data;
  };
  auto* emb = static_cast<const float*>(values("model.embed_tokens.weight", DType::F32, {3, 4}));
  for (int i = 0; i < 12; ++i) CHECK(emb[i] == i * 0.5f - 2);
  auto* head = static_cast<const double*>(values("lm_head.weight", DType::F64, {2, 3}));
  for (int i = 0; i < 6; ++i) CHECK(head[i] == i / 4.0);
  CHECK(*static_cast<const int64_t*>(values("step", DType::I64, {})) == 40);
  auto* ids = static_cast<const int32_t*>(values("ids", DType::I32, {3}));
  CHECK((ids[0] == 1 && ids[1] == -2 && ids[2] == 3));
  auto* by = static_cast<const uint8_t*>(values("bytes", DType::U8, {5}));
  for (int i = 0; i < 5; ++i) CHECK(by[i] == i);
  auto* u16 = static_cast<const uint16_t*>(values("u16", DType::U16, {3}));
  CHECK((u16[0] == 0 && u16[1] == 1 && u16[2] == 65535));
  auto* u32 = static_cast<const uint32_t*>(values("u32", DType::U32, {2}));
  CHECK((u32[0] == 7 && u32[1] == 4000000000u));
  values("empty", DType::F32, {0, 3});
  CHECK(f.at("empty").bytes == 0);
  auto* norm = static_cast<const bf16*>(values("norm.weight", DType::BF16, {3}));
  CHECK((bf16_to_float(norm[0]) == 1.0f && bf16_to_float(norm[1]) == -2.0f &&
         bf16_to_float(norm[2]) == 0.5f));

  // Our writer, given the same tensors and metadata, produces the very same bytes.
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : f.tensors()) entries.push_back({name, f.view(name)});
  ckpt_test::TempDir tmp;
  FileDigest d = write_safetensors(tmp / "ours.safetensors", entries, f.metadata());
  CHECK(ckpt_test::read_bytes(tmp / "ours.safetensors") == ckpt_test::read_bytes(fixture));
  CHECK(d.sha256 == sha256_file(fixture).sha256);
}

TEST_CASE("safetensors: every corruption is a UserError naming the file and the problem",
          "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  const auto path = tmp / "bad.safetensors";
  auto expect = [&](const std::string& bytes, const std::string& part) {
    ckpt_test::write_bytes(path, bytes);
    CHECK_USER_ERROR(SafetensorsFile(path), part);
    CHECK_USER_ERROR(SafetensorsFile(path), "bad.safetensors");
  };
  const std::string ok_header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string ok_data(8, '\x11');
  ckpt_test::write_bytes(path, raw_file(ok_header, ok_data));
  REQUIRE_NOTHROW(SafetensorsFile(path));

  auto tensor = [](const std::string& body) { return "{\"a\":{" + body + "}}"; };
  SECTION("length and framing") {
    expect("", "file too short (0 bytes)");
    expect(std::string("\x05\0\0", 3), "file too short (3 bytes)");
    expect(raw_file(ok_header, ok_data, int64_t(ok_header.size() + 9)),
           "runs past the end of the file");
    expect(raw_file(ok_header, ok_data, int64_t(1) << 62), "runs past the end of the file");
    expect(raw_file(ok_header, ok_data).substr(0, 8 + ok_header.size() + 7),
           "run past the data buffer");
    expect(raw_file(ok_header, ""), "run past the data buffer");
    expect(raw_file("[1]", ""), "header is not a JSON object");
    expect(raw_file("", ""), "header is not a JSON object");
  }
  SECTION("JSON") {
    expect(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", ok_data),
           "invalid JSON");
    expect(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],}})", ok_data),
           "invalid JSON");
    expect(raw_file(ok_header + "xx", ok_data), "invalid JSON");
    expect(
        raw_file(
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
            ok_data),
        "duplicate key");
  }
  SECTION("fields") {
    expect(raw_file(tensor(R"("dtype":"F33","shape":[2],"data_offsets":[0,8])"), ok_data),
           "tensor 'a': unknown dtype 'F33'");
    expect(raw_file(tensor(R"("dtype":"F16","shape":[4],"data_offsets":[0,8])"), ok_data),
           "dtype F16 is not supported");
    expect(raw_file(tensor(R"("dtype":1,"shape":[2],"data_offsets":[0,8])"), ok_data),
           "dtype: expected a string");
    expect(raw_file(tensor(R"("shape":[2],"data_offsets":[0,8])"), ok_data),
           "missing field 'dtype'");
    expect(raw_file(tensor(R"("dtype":"F32","data_offsets":[0,8])"), ok_data),
           "missing field 'shape'");
    expect(raw_file(tensor(R"("dtype":"F32","shape":[2])"), ok_data),
           "missing field 'data_offsets'");
    expect(raw_file(tensor(R"("dtype":"F32","shape":"2","data_offsets":[0,8])"), ok_data),
           "shape: expected an array");
    expect(raw_file(tensor(R"("dtype":"F32","shape":[-2],"data_offsets":[0,8])"), ok_data),
           "negative dimension");
    expect(raw_file(tensor(R"("dtype":"F32","shape":[2.0],"data_offsets":[0,8])"), ok_data),
           "expected an integer");
    expect(raw_file(tensor(R"("dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8])"),
                    ok_data),
           "too many elements");
    // Empty, but numel() would overflow int64 multiplying 2 × 2^62 before it reaches the 0.
    expect(
        raw_file(tensor(R"("dtype":"F32","shape":[2,4611686018427387904,0],"data_offsets":[0,0])"),
                 ""),
        "too many elements");
    expect(raw_file(tensor(R"("dtype":"F32","shape":[2],"data_offsets":[0])"), ok_data),
           "data_offsets must be [begin, end]");
    expect(raw_file(tensor(R"("dtype":"F32","shape":[2],"data_offsets":[0,-8])"), ok_data),
           "non-negative integer");
    expect(raw_file(R"({"__metadata__":{"k":1}})", ""), "__metadata__: k: expected a string");
    expect(raw_file(R"({"__metadata__":[]})", ""), "__metadata__: expected an object");
    expect(raw_file(R"({"a":[]})", ""), "tensor 'a': expected an object");
  }
  SECTION("sizes and offsets") {
    expect(raw_file(tensor(R"("dtype":"F32","shape":[3],"data_offsets":[0,8])"), ok_data),
           "shape [3] of F32 needs 3 × 4 bytes but data_offsets [0, 8] hold 8");
    expect(raw_file(tensor(R"("dtype":"F64","shape":[2],"data_offsets":[0,8])"), ok_data),
           "needs 2 × 8 bytes");
    expect(raw_file(tensor(R"("dtype":"F32","shape":[2],"data_offsets":[8,0])"), ok_data),
           "end before they begin");
    expect(raw_file(tensor(R"("dtype":"F32","shape":[2],"data_offsets":[4,12])"), ok_data),
           "run past the data buffer (8 bytes");
    expect(
        raw_file(
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            std::string(12, '\0')),
        "tensors 'a' and 'b' overlap");
    expect(
        raw_file(
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}})",
            ok_data),
        "tensors 'a' and 'b' overlap");
    expect(raw_file(tensor(R"("dtype":"F32","shape":[2],"data_offsets":[4,12])"),
                    std::string(12, '\0')),
           "4 unused bytes in the data buffer before tensor 'a'");
    expect(raw_file(ok_header, ok_data + "xyz"), "3 bytes after the last tensor");
  }
}

TEST_CASE("safetensors: view refuses tensors of more than 4 dims", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  ckpt_test::write_bytes(
      tmp / "d5.safetensors",
      raw_file(R"({"a":{"dtype":"U8","shape":[1,1,1,1,2],"data_offsets":[0,2]}})", "\x01\x02"));
  SafetensorsFile f(tmp / "d5.safetensors");
  CHECK(f.at("a").shape.size() == 5);
  CHECK_USER_ERROR(f.view("a"), "tensor 'a' has 5 dims (at most 4 supported)");
}
