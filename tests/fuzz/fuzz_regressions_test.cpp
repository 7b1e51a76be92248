// The fuzz targets' inputs replayed in the ordinary test build (no clang, no sanitizers): every
// file under fuzz/regressions/<target>/ (inputs that once crashed a parser) and
// fuzz/corpus/<target>/ (the seeds) must be accepted or refused with a UserError, nothing else.
// Seeds not named near_* are valid files and must be accepted.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "catch.h"
#include "fuzz/targets.h"

using namespace mop;

namespace {

namespace fs = std::filesystem;

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs every file of <dir>/<target>/ through its target; returns how many files there were.
int replay(const fs::path& dir, bool valid_seeds_accepted) {
  int num_files = 0;
  for (const FuzzTarget& target : kFuzzTargets) {
    const fs::path sub = dir / target.name;
    if (!fs::is_directory(sub)) continue;
    for (const auto& entry : fs::directory_iterator(sub)) {
      if (!entry.is_regular_file()) continue;
      const std::string name = entry.path().filename().string();
      INFO(target.name << " target, input " << entry.path().string());
      ++num_files;
      bool accepted = false;
      try {
        target.run(read_bytes(entry.path()));
        accepted = true;
      } catch (const UserError&) {
      } catch (const std::exception& e) {
        FAIL("not a UserError: " << e.what());
      }
      if (valid_seeds_accepted && !name.starts_with("near_")) CHECK(accepted);
    }
  }
  return num_files;
}

}  // namespace

TEST_CASE("fuzz: every saved crash input is now accepted or a UserError",
          "[cpu][fuzz-regressions]") {
  replay(fs::path(MOP_SOURCE_DIR) / "fuzz" / "regressions", false);
}

TEST_CASE("fuzz: the seed corpus replays: valid seeds accepted, near-valid ones no crash",
          "[cpu][fuzz-regressions]") {
  const int num_files = replay(fs::path(MOP_SOURCE_DIR) / "fuzz" / "corpus", true);
  CHECK(num_files >= 6);
}
