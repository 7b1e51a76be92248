// Trainer checkpoint tensors for export and scoring (see hf_checkpoint_reader.h): tensors are
// looked up by name in every model*.safetensors file, whatever rank layout wrote them.
#include "cli/hf_checkpoint_reader.h"

#include <algorithm>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/manifest.h"
#include "core/error.h"

namespace mop {

namespace fs = std::filesystem;

std::string resolve_checkpoint_path(const std::string& path, const std::string& flag) {
  std::error_code ec;
  if (fs::is_regular_file(fs::path(path) / kManifestName, ec)) return path;
  std::optional<fs::path> found = resolve_resume(path, ResumeMode::Auto);
  MOP_USER_CHECK(found.has_value(), flag, " ", path, ": no checkpoint found there");
  return found->string();
}

CheckpointTensors::CheckpointTensors(const std::string& dir) : dir_(dir) {
  Manifest m = verify_checkpoint(dir);
  config_ = load_config_text(m.config, {}, dir + "/manifest.json config");
  std::vector<fs::path> paths;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (name.starts_with("model") && name.ends_with(".safetensors")) paths.push_back(e.path());
  }
  MOP_USER_CHECK(!paths.empty(), "checkpoint ", dir, ": no model*.safetensors");
  std::sort(paths.begin(), paths.end());
  for (const fs::path& p : paths) files_.emplace_back(p);
}

const SafetensorsTensor& CheckpointTensors::at(const HfView& v) const {
  for (const SafetensorsFile& f : files_) {
    const SafetensorsTensor* t = f.find(v.name);
    if (!t) continue;
    MOP_USER_CHECK(t->dtype == DType::F32, f.path().string(), ": tensor '", v.name, "' is ",
                   dtype_name(t->dtype), ", expected f32");
    MOP_USER_CHECK(t->shape == v.shape, f.path().string(), ": tensor '", v.name, "' has shape ",
                   shape_str(t->shape), ", the checkpoint's config implies ", shape_str(v.shape));
    return *t;
  }
  throw_user_error("checkpoint ", dir_, ": no tensor '", v.name, "'");
}

}  // namespace mop
