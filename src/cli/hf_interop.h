// `mop import-hf` and `mop export-hf`: Hugging Face Qwen3-MoE / Mixtral model directories to and
// from trainer checkpoints. An import is a checkpoint at step 0 (fp32 master weights, zero Adam
// moments, manifest with the mapped config) that `mop train --resume` fine-tunes; an export is
// config.json plus safetensors shards that transformers' from_pretrained loads. Import then export
// gives back the same tensors, byte for byte (names, dtypes, values).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ckpt/hf_config.h"
#include "model/hf_tensors.h"

namespace mop {

struct HfImportResult {
  std::string checkpoint_dir;  // <out>/step_0
  std::string yaml_path;       // <out>/model.yaml: the model/moe sections for a training config
  HfImportedConfig imported;
  HfLayout layout = HfLayout::PerExpert;
  int64_t num_params = 0;
  bool tokenizer = false;  // hf_dir's tokenizer.json (and companions) copied into step_0
};
// Reads `hf_dir` (config.json and safetensors; tokenizer.json, tokenizer_config.json and
// special_tokens_map.json when there) and writes <out>/step_0, the fp32 weights in files
// of at most max_file_bytes (model.safetensors, or model-00001-of-0000N.safetensors). `out` must
// not hold checkpoints yet.
HfImportResult import_hf(const std::string& hf_dir, const std::string& out,
                         uint64_t max_file_bytes = 5'000'000'000);

struct HfExportOptions {
  std::optional<HfArch> arch;  // default: default_hf_arch(config)
  HfLayout layout = HfLayout::PerExpert;
  DType dtype = DType::BF16;  // BF16 or F32
  uint64_t max_shard_bytes = 5'000'000'000;
};
struct HfExportResult {
  std::string checkpoint_dir;
  HfArch arch = HfArch::Qwen3Moe;
  HfShardStats shards;
  bool tokenizer = false;  // the checkpoint's tokenizer files copied too
};
// Writes config.json, the safetensors files and the checkpoint's tokenizer files into `out` (which must not hold a model yet) from a
// step_N directory or a checkpoint.dir (its latest).
HfExportResult export_hf(const std::string& checkpoint, const std::string& out,
                         const HfExportOptions& options);

// "5GB", "500MB", "2GiB", "123456" (bytes) → bytes; UserError naming `flag` otherwise.
uint64_t parse_byte_size(const std::string& text, const std::string& flag);

struct ImportHfArgs {
  std::string dir, out;
};
int cmd_import_hf(const ImportHfArgs& args);

struct ExportHfArgs {
  std::string checkpoint, out;
  std::string dtype = "bf16";         // bf16 | fp32
  std::string arch = "auto";          // auto | qwen3_moe | mixtral
  std::string layout = "per-expert";  // per-expert | fused
  std::string max_shard_size = "5GB";
};
int cmd_export_hf(const ExportHfArgs& args);

}  // namespace mop
