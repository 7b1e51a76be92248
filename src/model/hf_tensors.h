// Hugging Face checkpoint tensors: the names and layouts of Qwen3-MoE and Mixtral checkpoints in
// terms of ours (ModelLayout::hf_views, which already carry Qwen3-MoE's per-expert names), reading
// a model directory (one *.safetensors file, or shards listed by model.safetensors.index.json), and
// writing one the way transformers' save_pretrained does (shards + index when over a size).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/hf_config.h"
#include "ckpt/safetensors.h"
#include "model/model_spec.h"

namespace mop {

// How experts are stored. PerExpert: one tensor per expert and projection — the published
// checkpoints, and what save_pretrained writes by default in transformers 4.x and 5.x. Fused:
// transformers 5's in-memory layout (save_pretrained(save_original_format=False)),
// `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2F, H] (each expert's gate rows, then its up
// rows) and `mlp.experts.down_proj` [E, H, F], router `mlp.gate.weight` for both architectures.
enum class HfLayout : uint8_t { PerExpert, Fused };

std::string_view hf_layout_name(HfLayout layout);  // "per-expert" | "fused"
std::optional<HfLayout> parse_hf_layout(std::string_view name);

// One tensor of a Hugging Face checkpoint: the concatenation, in order, of `parts` (checkpoint
// tensors of ours). Every mapping is a rename or a concatenation along the leading dims, never a
// transpose, so conversion is a copy per part.
struct HfTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<HfView> parts;
  int64_t numel() const;
};

// The tensors of `layout` (the whole model: experts_local == experts) as `arch` names them.
std::vector<HfTensorSpec> hf_tensor_specs(const ModelLayout& layout, HfArch arch,
                                          HfLayout hf_layout);

// Names a Hugging Face checkpoint may hold that the model does not need: the LM head of a model
// with tied embeddings (the same values as the embedding), rotary inv_freq buffers of old exports.
bool hf_tensor_ignorable(std::string_view name, bool tied_embeddings);

// The tensors of a model directory: the files model.safetensors.index.json's weight_map names, or
// without an index every *.safetensors file in it. A tensor in two files, a file the index names
// that is missing, or a tensor missing from its file is a UserError naming the path.
class HfTensorFiles {
 public:
  explicit HfTensorFiles(const std::filesystem::path& dir);

  const SafetensorsTensor* find(std::string_view name) const;  // nullptr when absent
  const std::filesystem::path& file_of(std::string_view name) const;
  std::vector<std::string> names() const;
  // Fused when the checkpoint has an `mlp.experts.gate_up_proj` tensor, else per-expert.
  HfLayout detect_layout() const;

 private:
  std::filesystem::path dir_;
  std::vector<SafetensorsFile> files_;
  struct Entry {
    size_t file;
    const SafetensorsTensor* tensor;
  };
  std::map<std::string, Entry, std::less<>> tensors_;
};

// safetensors file names of a checkpoint of `num_shards` files: "model.safetensors" for one,
// "model-00001-of-00003.safetensors", ... otherwise (save_pretrained's names).
std::string hf_shard_name(int shard_idx, int num_shards);

struct HfShardStats {
  int num_shards = 0;
  uint64_t total_bytes = 0;  // tensor bytes (the index's metadata.total_size)
};

// Writes `specs` into `dir` as `dtype` (BF16 or F32): tensors are packed into shards in order,
// starting a new shard when the next tensor would pass max_shard_bytes (a tensor larger than that
// gets a shard of its own), as save_pretrained splits them; with more than one shard also
// model.safetensors.index.json. fill(spec, dst) writes a tensor's values into dst (host, `dtype`,
// spec.numel() elements); one shard's tensors are held in memory at a time.
HfShardStats write_hf_shards(const std::filesystem::path& dir,
                             const std::vector<HfTensorSpec>& specs, DType dtype,
                             uint64_t max_shard_bytes,
                             const std::function<void(const HfTensorSpec&, Tensor)>& fill);

}  // namespace mop
