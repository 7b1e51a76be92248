// Checkpoint directory protocol. A checkpoint is <root>/step_<N>/ holding its files and
// manifest.json. It is written into <root>/step_<N>.tmp/, made durable, renamed into place, and
// then <root>/latest (a one-line file naming the directory) is replaced atomically. A directory
// is complete iff it has manifest.json, which is written last; a crash at any point leaves the
// previous checkpoints and `latest` usable.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/manifest.h"
#include "ckpt/sha256.h"

namespace mop {

// "step_40".
std::string checkpoint_dir_name(int64_t step);
// 40 for "step_40"; nullopt for anything else ("step_40.tmp", "step_x", "latest", ...).
std::optional<int64_t> parse_checkpoint_dir_name(std::string_view name);
// <root>/step_<N>.tmp: where every rank writes its files for step N (rank 0 calls begin() first).
std::filesystem::path checkpoint_tmp_dir(const std::filesystem::path& root, int64_t step);
// Has manifest.json.
bool is_complete_checkpoint(const std::filesystem::path& dir);

struct CheckpointInfo {
  int64_t step = 0;
  std::filesystem::path dir;
};
// Complete step_<N> directories under root, by ascending step (empty if root does not exist).
std::vector<CheckpointInfo> list_checkpoints(const std::filesystem::path& root);

class CheckpointWriter {
 public:
  // Creates <root>/step_<step>.tmp/ afresh (a stale one left by a crashed write is removed) and
  // root itself if needed.
  static CheckpointWriter begin(const std::filesystem::path& root, int64_t step);

  const std::filesystem::path& dir() const { return tmp_dir_; }  // write files here
  std::filesystem::path file(std::string_view name) const { return tmp_dir_ / name; }
  int64_t step() const { return step_; }

  // Records the digest of a file already written into dir() (write_safetensors returns it), so
  // commit() need not read the file again. Files not recorded are hashed at commit.
  void add_file(const std::string& name, FileDigest digest);

  // Lists every file in dir() into the manifest (sizes, SHA-256), sets its step, writes
  // manifest.json, fsyncs the files and the directory, renames step_<N>.tmp → step_<N> (an
  // existing step_<N> is replaced: swapped atomically where the file system supports it), fsyncs
  // root, and points `latest` at it. Returns <root>/step_<N>.
  std::filesystem::path commit(Manifest manifest);

 private:
  CheckpointWriter(std::filesystem::path root, int64_t step, std::filesystem::path tmp_dir)
      : root_(std::move(root)), step_(step), tmp_dir_(std::move(tmp_dir)) {}

  std::filesystem::path root_;
  int64_t step_ = 0;
  std::filesystem::path tmp_dir_;
  std::map<std::string, FileDigest> digests_;
  bool committed_ = false;
};

enum class ResumeMode {
  Auto,  // root_or_path is the checkpoint root
  Path,  // root_or_path is one checkpoint directory
};

// Auto: the directory `latest` names if it is complete, else the highest complete step_<N>
// (with a warning when `latest` was unusable), else nullopt (a fresh start; also when root does
// not exist). Path: that directory; UserError if it is missing or incomplete
// ("checkpoint ckpt/step_40: no manifest.json (incomplete checkpoint?)").
std::optional<std::filesystem::path> resolve_resume(const std::filesystem::path& root_or_path,
                                                    ResumeMode mode);

// Deletes the oldest complete checkpoints so that keep_last remain, never the one `latest` names
// (which may make one more remain) and never a .tmp directory; keep_last = 0 keeps all. Returns
// the directories removed, oldest first.
std::vector<std::filesystem::path> prune_checkpoints(const std::filesystem::path& root,
                                                     int keep_last);

// Removes what interrupted work leaves in `root`: step_N.tmp directories (a save that was killed)
// and step_N directories without a manifest (a prune cut short), but never the one `latest`
// names. Only for the run that holds the directory, at its start. Returns what was removed.
std::vector<std::filesystem::path> remove_checkpoint_leftovers(const std::filesystem::path& root);

}  // namespace mop
