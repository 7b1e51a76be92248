// Helpers for end-to-end tests that run the `mop` binary: a scratch directory, a small byte-level
// corpus, running a command and capturing its exit code and output, reading metrics.jsonl.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ckpt/json.h"
#include "core/rng.h"
#include "data/prepare_data.h"
#include "test_util.h"

namespace mop::test {


struct RunResult {
  int code = -1;
  std::string output;  // stdout and stderr
};

inline RunResult run_command(const std::string& cmd) {
  RunResult r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// The mop binary: $MOP_BINARY when set; else the one beside this test binary (build/mop next to
// build/tests/mop_tests, or in the same folder when the binaries were copied together), so a
// build folder that moved still finds its own; else the build path compiled in.
inline std::string mop_binary() {
  const char* env = std::getenv("MOP_BINARY");
  if (env && *env) return env;
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec)
    for (const std::filesystem::path& p : {self.parent_path().parent_path() / "mop", self.parent_path() / "mop"})
      if (std::filesystem::is_regular_file(p, ec)) return p.string();
  return MOP_BINARY;
}

inline RunResult run_mop(const std::string& args) {
  return run_command("OMP_NUM_THREADS=2 " + mop_binary() + " " + args);
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Deterministic pseudo-English text (~bytes long), with blank lines between paragraphs.
inline std::string sample_corpus(size_t bytes) {
  const char* words[] = {"the", "moe", "expert", "router", "token", "and", "of", "to", "layer",
                         "attention", "in", "a", "gradient", "step", "is", "loss"};
  std::string s;
  for (uint64_t i = 0; s.size() < bytes; ++i) {
    s += words[philox_u64(3, 4, i) % 16];
    s += (i % 97 == 96) ? ".\n\n" : (i % 13 == 12) ? ".\n" : " ";
  }
  return s;
}

// A byte-level shard of sample_corpus(bytes) in `dir` (corpus.txt → corpus.bin/.idx); returns the
// shard's prefix for data.paths.
inline std::string prepare_corpus(const TempDir& dir, size_t bytes) {
  write_text(dir / "corpus.txt", sample_corpus(bytes));
  PrepareDataOptions po;
  po.inputs = {dir / "corpus.txt"};
  po.output = dir / "corpus";
  prepare_data(po);
  return dir / "corpus";
}

// Every line of a metrics.jsonl file, parsed.
inline std::vector<Json> read_metrics(const std::string& path) {
  std::vector<Json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(parse_json(line, path));
  return out;
}

}  // namespace mop::test
