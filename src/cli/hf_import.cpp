// `mop import-hf`: a Hugging Face Qwen3-MoE or Mixtral directory → a trainer checkpoint at step 0.
// Every tensor the config implies must be present with its exact shape, and every tensor present
// must be one the model uses, so nothing is silently dropped or left at its initial value.
#include <algorithm>
#include <cstdio>
#include <map>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/file_io.h"
#include "ckpt/json.h"
#include "cli/hf_interop.h"
#include "core/error.h"
#include "data/tokenizer_files.h"
#include "ops/ops.h"

namespace mop {

namespace fs = std::filesystem;

namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Tensor shaped(float* data, const std::vector<int64_t>& shape) {
  Tensor t(data, DType::F32, {});
  t.ndim = int(shape.size());
  for (int d = 0; d < t.ndim; ++d) t.shape[size_t(d)] = shape[size_t(d)];
  return t;
}

}  // namespace

HfImportResult import_hf(const std::string& hf_dir, const std::string& out,
                         uint64_t max_file_bytes) {
  std::error_code ec;
  MOP_USER_CHECK(fs::is_directory(hf_dir, ec), "import-hf: ", hf_dir, ": not a directory");
  const fs::path cfg_path = fs::path(hf_dir) / "config.json";
  MOP_USER_CHECK(fs::is_regular_file(cfg_path, ec), hf_dir,
                 ": no config.json (not a Hugging Face model directory?)");
  HfImportResult r;
  r.imported = hf_config_to_mop(read_json_file(cfg_path), cfg_path.string());
  Config& cfg = r.imported.config;
  MOP_USER_CHECK(list_checkpoints(out).empty(), "--out ", out,
                 ": already holds checkpoints; import into a new directory");
  cfg.checkpoint.dir = out;
  const std::string cls(hf_arch_class(r.imported.arch));

  HfTensorFiles files(hf_dir);
  r.layout = files.detect_layout();
  ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  const std::vector<HfTensorSpec> specs = hf_tensor_specs(layout, r.imported.arch, r.layout);

  // Everything is checked before anything is written: each tensor the config implies, with its
  // shape and a float dtype, and no tensor the model would drop.
  std::map<std::string, bool> used;
  int64_t largest = 0;
  for (const HfTensorSpec& spec : specs) {
    const SafetensorsTensor* t = files.find(spec.name);
    MOP_USER_CHECK(t, hf_dir, ": no tensor '", spec.name, "' (a ", cls, " with this config.json, ",
                   hf_layout_name(r.layout), " experts, has one)");
    const std::string file = files.file_of(spec.name).string();
    MOP_USER_CHECK(t->dtype == DType::F32 || t->dtype == DType::BF16 || t->dtype == DType::F64,
                   file, ": tensor '", spec.name, "' is ", dtype_name(t->dtype),
                   "; expected a float tensor");
    MOP_USER_CHECK(t->shape == spec.shape, file, ": tensor '", spec.name, "' has shape ",
                   shape_str(t->shape), "; config.json implies ", shape_str(spec.shape));
    used[spec.name] = true;
    r.num_params += spec.numel();
    for (const HfView& part : spec.parts) largest = std::max(largest, numel_of(part.shape));
  }
  for (const std::string& name : files.names())
    MOP_USER_CHECK(used.count(name) || hf_tensor_ignorable(name, cfg.model.tie_embeddings),
                   files.file_of(name).string(), ": tensor '", name, "' is not part of a ", cls,
                   " that mop can represent (biases, extra modules?)");

  // A trainer checkpoint at step 0, as save_checkpoint writes it, with zero Adam moments (an AdamW
  // update count of 0: the first step is a fresh start from these weights). The fp32 weights go
  // into files of at most max_file_bytes, converted one file at a time, so memory holds one
  // file's values rather than the whole model's; the trainer finds tensors by name in any
  // model*.safetensors file.
  std::vector<std::vector<size_t>> groups{{}};
  uint64_t group_bytes = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const uint64_t bytes = uint64_t(specs[i].numel()) * sizeof(float);
    if (!groups.back().empty() && group_bytes + bytes > max_file_bytes) {
      groups.emplace_back();
      group_bytes = 0;
    }
    groups.back().push_back(i);
    group_bytes += bytes;
  }
  const SafetensorsMetadata meta{{"format", "pt"}, {"producer", "mop " MOP_VERSION}};
  std::unique_ptr<Ops> host = make_cpu_ops();
  const std::optional<TokenizerFiles> tokenizer = TokenizerFiles::in_directory(hf_dir);
  if (tokenizer) tokenizer->check_fits(cfg.model.vocab_size);
  CheckpointWriter w = CheckpointWriter::begin(out, 0);
  if (tokenizer) tokenizer->write_into(w.dir());
  r.tokenizer = tokenizer.has_value();
  for (size_t g = 0; g < groups.size(); ++g) {
    int64_t numel = 0;
    for (size_t i : groups[g]) numel += specs[i].numel();
    std::vector<float> values(static_cast<size_t>(numel));
    std::vector<SafetensorsEntry> entries;
    float* dst = values.data();
    for (size_t i : groups[g]) {
      // A Hugging Face tensor is its parts (checkpoint tensors of ours) back to back.
      const SafetensorsTensor* t = files.find(specs[i].name);
      const char* src = static_cast<const char*>(t->data);
      for (const HfView& part : specs[i].parts) {
        Tensor d = shaped(dst, part.shape);
        host->copy(d.view({d.numel()}), Tensor(const_cast<char*>(src), t->dtype, {d.numel()}));
        entries.push_back({part.name, d});
        src += size_t(d.numel()) * dtype_size(t->dtype);
        dst += d.numel();
      }
    }
    const std::string name = hf_shard_name(int(g), int(groups.size()));
    w.add_file(name, write_safetensors(w.file(name), entries, meta));
  }
  std::vector<SafetensorsEntry> moments;
  std::vector<float> zeros(static_cast<size_t>(largest), 0.0f);
  for (const HfView& v : layout.hf_views()) {
    moments.push_back({v.name + ".exp_avg", shaped(zeros.data(), v.shape)});
    moments.push_back({v.name + ".exp_avg_sq", shaped(zeros.data(), v.shape)});
  }
  w.add_file("optimizer.safetensors",
             write_safetensors(w.file("optimizer.safetensors"), moments, meta));
  Manifest m;
  m.config = dump_config(cfg);
  m.state["consumed_samples"] = 0;
  m.state["optimizer_updates"] = 0;
  m.state["seed"] = uint64_t(cfg.train.seed);
  m.state["data_fingerprint"] = 0;
  m.state["world_size"] = 1;
  m.state["imported_from"] = fs::absolute(hf_dir).lexically_normal().string();
  m.state["hf_architecture"] = cls;
  m.state["hf_layout"] = hf_layout_name(r.layout);
  r.checkpoint_dir = w.commit(std::move(m)).string();

  r.yaml_path = (fs::path(out) / "model.yaml").string();
  write_file_atomic(r.yaml_path, hf_config_yaml_fragment(cfg, "imported from " + hf_dir + " (" +
                                                                  cls + ") by mop import-hf"));
  return r;
}

int cmd_import_hf(const ImportHfArgs& args) {
  HfImportResult r = import_hf(args.dir, args.out);
  const HfImportedConfig& ic = r.imported;
  // The model/moe YAML alone on stdout (`mop import-hf DIR --out CKPT > model.yaml`); what
  // happened on stderr.
  std::printf("%s",
              hf_config_yaml_fragment(ic.config, "imported from " + args.dir + " (" +
                                                     std::string(hf_arch_class(ic.arch)) + ")")
                  .c_str());
  std::fflush(stdout);
  for (const std::string& note : ic.notes) std::fprintf(stderr, "note: %s\n", note.c_str());
  std::fprintf(stderr, "imported %s (%s experts, %s, %.2fM parameters) into %s\n",
               std::string(hf_arch_class(ic.arch)).c_str(), std::string(hf_layout_name(r.layout)).c_str(),
               ic.dtype.empty() ? "dtype not stated" : ic.dtype.c_str(), double(r.num_params) / 1e6,
               r.checkpoint_dir.c_str());
  if (r.tokenizer) std::fprintf(stderr, "tokenizer copied from %s/tokenizer.json\n", args.dir.c_str());
  std::fprintf(stderr,
               "model config written to %s; fine-tune from it with a config of its model and moe sections, "
               "your data/train/optim, and checkpoint.init_from: %s with a checkpoint.dir of the run's own "
               "(or checkpoint.dir: %s with checkpoint.resume: auto; docs/hugging-face.md)\n",
               r.yaml_path.c_str(), args.out.c_str(), args.out.c_str());
  return 0;
}

}  // namespace mop
