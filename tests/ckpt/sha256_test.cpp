// SHA-256 against the FIPS 180-4 example vectors, padding boundaries, incremental updates in odd
// chunk sizes, and the streaming file hash.
#include <string>

#include "catch.h"
#include "ckpt/sha256.h"
#include "ckpt_test_util.h"
#include "test_util.h"

using namespace mop;

TEST_CASE("sha256: NIST FIPS 180-4 vectors", "[cpu][ckpt]") {
  CHECK(sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // 448 bits: the length field no longer fits in the first block, so padding takes a second one.
  CHECK(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(sha256_hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnop"
                   "qklmnopqrlmnopqrs"
                   "mnopqrstnopqrstu") ==
        "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  CHECK(sha256_hex(std::string(1000000, 'a')) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("sha256: lengths around the 56- and 64-byte padding boundaries", "[cpu][ckpt]") {
  // Reference digests from Python's hashlib.
  const std::pair<size_t, const char*> cases[] = {
      {55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
      {56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
      {57, "f13b2d724659eb3bf47f2dd6af1accc87b81f09f59f2b75e5c0bed6589dfe8c6"},
      {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
      {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
      {65, "635361c48bb9eab14198e76ea8ab7f1a41685d6ad62aa9146d301d4f17eb0ae0"},
      {119, "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb"},
      {120, "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c"},
      {128, "6836cf13bac400e9105071cd6af47084dfacad4e5e302c94bfed24e013afb73e"},
  };
  for (auto [n, hex] : cases) {
    INFO("length " << n);
    CHECK(sha256_hex(std::string(n, 'a')) == hex);
  }
}

TEST_CASE("sha256: incremental updates in odd chunks equal one update", "[cpu][ckpt]") {
  std::string data;
  for (int i = 0; i < 256000; ++i) data += char(i % 256);  // bytes 0..255, 1000 times
  Sha256 h;
  const size_t chunks[] = {1, 63, 64, 65, 0, 7, 4096, 127, 100000};
  size_t pos = 0;
  for (size_t k = 0; pos < data.size(); ++k) {
    size_t n = std::min(chunks[k % std::size(chunks)], data.size() - pos);
    h.update(data.data() + pos, n);
    pos += n;
  }
  CHECK(h.bytes_hashed() == data.size());
  std::string hex = h.finish_hex();
  CHECK(hex == "b57b64b198d5d59ce5a22a9b9f25e72a7d081476d432051aa923f3dbebb90934");  // hashlib
  CHECK(hex == sha256_hex(data));
  CHECK_THROWS_AS(h.update("x"), Error);
  h.reset();
  h.update("abc");
  CHECK(h.finish_hex() == sha256_hex("abc"));
}

TEST_CASE("sha256: file hash streams the whole file", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  // Larger than the 4 MiB read block and not a multiple of it.
  std::string data(9 * 1024 * 1024 + 13, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = char((i * 2654435761u) >> 13);
  ckpt_test::write_bytes(tmp / "blob", data);
  FileDigest d = sha256_file(tmp / "blob");
  CHECK(d.bytes == data.size());
  CHECK(d.sha256 == sha256_hex(data));
  ckpt_test::write_bytes(tmp / "empty", "");
  CHECK(sha256_file(tmp / "empty").sha256 == sha256_hex(""));
  CHECK_USER_ERROR(sha256_file(tmp / "missing"), "missing: not found");
}
