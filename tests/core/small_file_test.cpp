// read_small_file: the whole-file reader every config, JSON and tokenizer read goes through —
// not-found, not-a-regular-file (a FIFO refused without waiting for a writer) and the size cap,
// each a UserError naming the file; memory-mapped and hashed files are stat'ed first as well.
#include <sys/stat.h>

#include <fstream>

#include "catch.h"
#include "ckpt/json.h"
#include "ckpt/safetensors.h"
#include "ckpt/sha256.h"
#include "config/config.h"
#include "core/small_file.h"
#include "data/tokenizer.h"
#include "test_util.h"

using namespace mop;
namespace fs = std::filesystem;

namespace {
void write_text(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}
}  // namespace

TEST_CASE("read_small_file: reads a file whole, names what it refuses", "[cpu][core]") {
  test::TempDir tmp;
  const fs::path ok = tmp.path / "ok.json";
  write_text(ok, std::string("{\"a\": 1}\n\0tail", 14));
  CHECK(read_small_file(ok, "config file", 64) == std::string("{\"a\": 1}\n\0tail", 14));
  CHECK(read_small_file(ok, "", 14).size() == 14);  // exactly the cap is allowed

  const std::string missing = (tmp.path / "none.yaml").string();
  CHECK_USER_ERROR(read_small_file(missing, "config file", 64),
                   "config file " + missing + ": not found");
  CHECK_USER_ERROR(read_small_file(tmp.path / "none" / "x.json", "", 64), "x.json: not found");
  CHECK_USER_ERROR(read_small_file(ok / "x.json", "", 64), "x.json: not found");  // ENOTDIR
  CHECK_USER_ERROR(read_small_file(tmp.path, "tokenizer", 64),
                   "tokenizer " + tmp.path.string() + ": is not a regular file (a directory)");
  CHECK_USER_ERROR(read_small_file("/dev/null", "", 64),
                   "/dev/null: is not a regular file (a character device)");
  // A FIFO with no writer: open(2) would wait forever; the stat refuses it first.
  const fs::path fifo = tmp.path / "fifo.yaml";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_USER_ERROR(read_small_file(fifo, "config file", 64),
                   "fifo.yaml: is not a regular file (a FIFO)");
}

TEST_CASE("read_small_file: a file over the cap is refused by its size, before it is read",
          "[cpu][core]") {
  test::TempDir tmp;
  const fs::path big = tmp.path / "big.json";
  write_text(big, std::string(15, 'x'));
  CHECK_USER_ERROR(read_small_file(big, "manifest", 14),
                   "manifest " + big.string() + ": 15 bytes, over the 14 bytes cap for this file");
  // A sparse file of 65 MiB: refused by its stat size (nothing is allocated or read).
  const fs::path sparse = tmp.path / "sparse.yaml";
  { std::ofstream(sparse, std::ios::binary); }
  fs::resize_file(sparse, 65 * kMiB);
  CHECK_USER_ERROR(read_small_file(sparse, "config file", kConfigFileCap),
                   "sparse.yaml: 65 MiB, over the 64 MiB cap for this file");
  CHECK(size_str(12) == "12 bytes");
  CHECK(size_str(kMiB + kMiB / 2) == "1.5 MiB (1572864 bytes)");
}

TEST_CASE("read_small_file: the readers of configs, JSON and tokenizers go through it",
          "[cpu][core]") {
  // Mapped and hashed files (safetensors, token shards, manifest entries) are stat'ed first too.
  test::TempDir tmp;
  const fs::path fifo = tmp.path / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_USER_ERROR(load_config(fifo.string(), {}), "is not a regular file (a FIFO)");
  CHECK_USER_ERROR(SafetensorsFile(fifo), "fifo: is not a regular file (a FIFO)");
  CHECK_USER_ERROR(sha256_file(fifo), "fifo: is not a regular file (a FIFO)");
  CHECK_USER_ERROR(read_json_file(fifo), "fifo: is not a regular file (a FIFO)");
  CHECK_USER_ERROR(Tokenizer::load(fifo), "tokenizer " + fifo.string() + ": is not a regular file");
  CHECK_USER_ERROR(Tokenizer::load(tmp.path), "is not a regular file (a directory)");
  const fs::path sparse = tmp.path / "tokenizer.json";
  { std::ofstream(sparse, std::ios::binary); }
  fs::resize_file(sparse, kTokenizerFileCap + 1);
  CHECK_USER_ERROR(Tokenizer::load(sparse), "over the 128 MiB cap");
}
