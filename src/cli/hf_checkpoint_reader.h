// Read-only access to a trainer checkpoint's master weights without building an optimizer: the
// checkpoint directory a path names (a step_N directory, or a checkpoint.dir and its latest), its
// verified manifest and config, and its fp32 tensors by checkpoint name in model.safetensors or the
// expert-parallel shards model-ep*-of-*.safetensors. Used by export-hf and score.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "config/config.h"
#include "model/model_spec.h"

namespace mop {

// `path` itself when it holds manifest.json, else the checkpoint its `latest` (or highest step)
// names; UserError "<flag> <path>: no checkpoint found there" otherwise.
std::string resolve_checkpoint_path(const std::string& path, const std::string& flag);

class CheckpointTensors {
 public:
  // Verifies sizes and SHA-256 of every file (UserError on a mismatch) and maps the model files.
  explicit CheckpointTensors(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const Config& config() const { return config_; }
  // The fp32 tensor of checkpoint view `v`; UserError when it is missing or has another dtype or
  // shape than the config implies.
  const SafetensorsTensor& at(const HfView& v) const;

 private:
  std::string dir_;
  Config config_;
  std::vector<SafetensorsFile> files_;
};

}  // namespace mop
