// TokenizerFiles: which files go with a tokenizer.json, beside shards and in directories.
#include <filesystem>
#include <fstream>
#include <string>

#include "catch.h"
#include "core/error.h"
#include "data/tokenizer_files.h"
#include "test_util.h"

using namespace mop;
using test::TempDir;

namespace {
void put(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }
}  // namespace

TEST_CASE("tokenizer files: the companions of a tokenizer.json travel with it", "[cpu][data]") {
  TempDir d;
  put(d / "tokenizer.json", "{\"main\": 1}");
  put(d / "tokenizer_config.json", "{\"config\": 2}");
  put(d / "other.json", "{}");
  auto t = TokenizerFiles::in_directory(d.path);
  REQUIRE(t);
  REQUIRE(t->files.size() == 2);
  CHECK(t->files[0] == std::pair<std::string, std::string>{"tokenizer.json", "{\"main\": 1}"});
  CHECK(t->files[1] == std::pair<std::string, std::string>{"tokenizer_config.json", "{\"config\": 2}"});

  // Beside shards: <prefix>.tokenizer.json and <prefix>.tokenizer_config.json; a .bin name means
  // its prefix.
  t->write_beside_data(d / "kjv.bin");
  CHECK(std::filesystem::exists(d / "kjv.tokenizer.json"));
  CHECK(std::filesystem::exists(d / "kjv.tokenizer_config.json"));
  auto back = TokenizerFiles::beside_data(d / "kjv");
  REQUIRE(back);
  CHECK(back->files == t->files);
  CHECK(back->source == d / "kjv.tokenizer.json");
  // A file of another name has no companions; written into a directory it is tokenizer.json.
  put(d / "mine.json", "{\"mine\": 3}");
  auto named = TokenizerFiles::read(d / "mine.json", "data.tokenizer");
  REQUIRE(named.files.size() == 1);
  TempDir out;
  named.write_into(out.path);
  auto in_out = TokenizerFiles::in_directory(out.path);
  REQUIRE(in_out);
  CHECK(in_out->tokenizer_json() == "{\"mine\": 3}");

  TokenizerFiles::remove_beside_data(d / "kjv");
  CHECK_FALSE(TokenizerFiles::beside_data(d / "kjv"));
  CHECK_FALSE(std::filesystem::exists(d / "kjv.tokenizer_config.json"));
  CHECK_FALSE(TokenizerFiles::in_directory(out.path / "nowhere"));
  CHECK_THROWS_WITH(TokenizerFiles::read(d / "none.json", "data.tokenizer"),
                    Catch::Matchers::Contains("data.tokenizer") && Catch::Matchers::Contains("none.json: not found"));
}
