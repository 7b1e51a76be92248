// Checkpoint manifest (manifest.json): what a resume needs besides the tensors — format version,
// step, the resolved config, free-form trainer state, and every file's size and SHA-256 — and
// verification of a checkpoint directory against it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/json.h"

namespace mop {

inline constexpr std::string_view kManifestName = "manifest.json";

struct ManifestFile {
  std::string name;  // a plain file name inside the checkpoint directory
  uint64_t bytes = 0;
  std::string sha256;  // 64 lower-case hex digits
};

struct Manifest {
  // Bumped when a reader of the old format would misread the new one.
  static constexpr int64_t kFormatVersion = 1;

  int64_t format_version = kFormatVersion;
  int64_t step = 0;
  std::string mop_version = MOP_VERSION;  // the writer's; informational
  std::string config;                     // the resolved config text, to check a resume against
  // Trainer-owned and free-form (the data cursor, consumed samples, RNG seeds, the plan, ...), so
  // the trainer adds fields without touching this file. Must be an object.
  Json state = Json::object();
  std::vector<ManifestFile> files;  // every file of the checkpoint but manifest.json, by name

  Json to_json() const;
  // `where` names the manifest in errors. A missing or ill-typed field, a bad file entry or a
  // format newer than kFormatVersion is a UserError.
  static Manifest from_json(const Json& j, std::string_view where);
};

// Reads <dir>/manifest.json. Errors read "checkpoint <dir>: manifest.json: <problem>".
Manifest read_manifest(const std::filesystem::path& dir);

// Re-reads every file the manifest lists and checks its size and SHA-256; the first mismatch is a
// UserError "checkpoint <dir>: <file>: SHA-256 mismatch (file corrupt or modified)" (or a size
// or missing-file message). Returns the manifest.
Manifest verify_checkpoint(const std::filesystem::path& dir);

}  // namespace mop
