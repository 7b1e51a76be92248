// `mop export-hf`: a trainer checkpoint → a Hugging Face model directory (config.json, safetensors
// shards, index) in the Qwen3-MoE or Mixtral layout, bf16 (rounded to nearest even, as torch's
// .to(torch.bfloat16)) or fp32 (the master weights unchanged).
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "ckpt/file_io.h"
#include "cli/hf_checkpoint_reader.h"
#include "cli/hf_interop.h"
#include "core/error.h"
#include "data/tokenizer_files.h"
#include "ops/ops.h"

namespace mop {

namespace fs = std::filesystem;

uint64_t parse_byte_size(const std::string& text, const std::string& flag) {
  // Decimal units as transformers' max_shard_size ("5GB" = 5·10⁹), binary ones with an i.
  static const std::pair<const char*, double> kUnits[] = {{"", 1},
                                                          {"B", 1},
                                                          {"KB", 1e3},
                                                          {"MB", 1e6},
                                                          {"GB", 1e9},
                                                          {"TB", 1e12},
                                                          {"KiB", 1024.0},
                                                          {"MiB", 1048576.0},
                                                          {"GiB", 1073741824.0},
                                                          {"TiB", 1099511627776.0}};
  size_t pos = 0;
  double value = -1;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  std::string unit = text.substr(pos);
  for (const auto& [name, scale] : kUnits)
    if (pos > 0 && unit == name && value > 0 && std::isfinite(value * scale) &&
        value * scale < 1.8e19)
      return uint64_t(value * scale);
  throw_user_error(flag, ": '", text,
                   "' is not a size (e.g. 5GB, 500MB, 2GiB, or a number of bytes)");
}

HfExportResult export_hf(const std::string& checkpoint, const std::string& out,
                         const HfExportOptions& o) {
  MOP_CHECK(o.dtype == DType::BF16 || o.dtype == DType::F32, "export dtype ", dtype_name(o.dtype));
  HfExportResult r;
  r.checkpoint_dir = resolve_checkpoint_path(checkpoint, "export-hf: checkpoint");
  CheckpointTensors ckpt(r.checkpoint_dir);
  const Config& cfg = ckpt.config();
  r.arch = o.arch.value_or(default_hf_arch(cfg));
  Json hf_config = mop_config_to_hf(cfg, r.arch, o.dtype == DType::BF16 ? "bfloat16" : "float32");

  // Never mix with an earlier model: transformers would prefer a stale index over a new single
  // file, and another model's tokenizer files beside ours (or in place of the ones this checkpoint
  // lacks) would make a mixed tokenizer.
  static const char* const kTokenizerFiles[] = {"tokenizer.json",  "tokenizer_config.json", "special_tokens_map.json",
                                                "added_tokens.json", "vocab.json",          "merges.txt",
                                                "vocab.txt",       "tokenizer.model",       "generation_config.json"};
  std::error_code ec;
  if (fs::is_directory(out, ec))
    for (const fs::directory_entry& e : fs::directory_iterator(out, ec)) {
      std::string name = e.path().filename().string();
      const bool tokenizer = std::find(std::begin(kTokenizerFiles), std::end(kTokenizerFiles), name) !=
                             std::end(kTokenizerFiles);
      MOP_USER_CHECK(name != "config.json" && !name.ends_with(".safetensors") &&
                         name != "model.safetensors.index.json" && !tokenizer,
                     "--out ", out, ": already holds a model (", name,
                     "); export into a new directory");
    }

  ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  std::unique_ptr<Ops> host = make_cpu_ops();
  r.shards = write_hf_shards(out, hf_tensor_specs(layout, r.arch, o.layout), o.dtype,
                             o.max_shard_bytes, [&](const HfTensorSpec& spec, Tensor dst) {
                               char* p = static_cast<char*>(dst.data);
                               for (const HfView& part : spec.parts) {
                                 const SafetensorsTensor& t = ckpt.at(part);
                                 const int64_t n = t.numel();
                                 host->copy(Tensor(p, o.dtype, {n}),
                                            Tensor(const_cast<void*>(t.data), DType::F32, {n}));
                                 p += size_t(n) * dtype_size(o.dtype);
                               }
                             });
  write_file_durable(fs::path(out) / "config.json", hf_config.dump(2));
  if (const std::optional<TokenizerFiles> t = TokenizerFiles::in_directory(r.checkpoint_dir)) {
    t->write_into(out);
    r.tokenizer = true;
  }
  return r;
}

int cmd_export_hf(const ExportHfArgs& args) {
  HfExportOptions o;
  if (args.arch != "auto") {
    o.arch = parse_hf_arch(args.arch);
    MOP_USER_CHECK(o.arch, "--arch: '", args.arch, "' is not one of auto, qwen3_moe, mixtral");
  }
  std::optional<HfLayout> layout = parse_hf_layout(args.layout);
  MOP_USER_CHECK(layout, "--layout: '", args.layout, "' is not one of per-expert, fused");
  o.layout = *layout;
  MOP_USER_CHECK(args.dtype == "bf16" || args.dtype == "fp32", "--dtype: '", args.dtype,
                 "' is not one of bf16, fp32");
  o.dtype = args.dtype == "bf16" ? DType::BF16 : DType::F32;
  o.max_shard_bytes = parse_byte_size(args.max_shard_size, "--max-shard-size");
  HfExportResult r = export_hf(args.checkpoint, args.out, o);
  std::printf(
      "exported %s as %s (%s, %s experts): %d safetensors file(s), %.2f MB of tensors, "
      "config.json%s in %s\n",
      r.checkpoint_dir.c_str(), std::string(hf_arch_class(r.arch)).c_str(), args.dtype.c_str(),
      args.layout.c_str(), r.shards.num_shards, double(r.shards.total_bytes) / 1e6,
      r.tokenizer ? " and the tokenizer" : "", args.out.c_str());
  return 0;
}

}  // namespace mop
