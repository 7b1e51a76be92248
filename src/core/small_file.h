// read_small_file: the one way the engine reads a file whole (configs, JSON, the checkpoint's
// `latest` pointer, tokenizer files, score inputs). The path is checked with stat before it is
// opened, and the read has a cap, so a wrong path — a data shard, /dev/zero, a FIFO, a directory —
// is one UserError naming the file, not an allocation the size of the disk or a hang on a pipe.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace mop {

inline constexpr uint64_t kMiB = uint64_t(1) << 20;
// YAML configs, config.json, manifest.json, safetensors indexes, machine files, `latest`: real
// ones are bytes to a few MB (the index of a trillion-parameter model is about 5 MB).
inline constexpr uint64_t kConfigFileCap = 64 * kMiB;
// tokenizer.json and its companions: real ones are 2 to 35 MB (Llama 3 9 MB, Gemma 3 33 MB).
inline constexpr uint64_t kTokenizerFileCap = 128 * kMiB;
// What `mop score` reads (--tokens, --text) and metrics.jsonl on resume: text that grows with the
// user's data or the run, held in memory whole; larger inputs go through prepare-data.
inline constexpr uint64_t kTextFileCap = 1024 * kMiB;

// Reads `path` whole. `what` names the file for the user ("config file", "tokenizer"; may be
// empty), and every error starts with it and the path:
//   "<what> <path>: not found"
//   "<what> <path>: is not a regular file (a directory)"
//   "<what> <path>: 80.0 MiB (83886080 bytes), over the 64 MiB cap for this file"
std::string read_small_file(const std::filesystem::path& path, std::string_view what, uint64_t cap);

// The size of `path` by stat(2), which never blocks (open(2) of a FIFO waits for a writer); the
// same "not found" and "is not a regular file (a FIFO)" UserErrors as read_small_file.
uint64_t regular_file_size(const std::filesystem::path& path, std::string_view what);

// "12 bytes", "80.0 MiB (83886080 bytes)": a size as error messages show it.
std::string size_str(uint64_t bytes);

}  // namespace mop
