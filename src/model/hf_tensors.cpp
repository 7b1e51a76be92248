// Hugging Face tensor names and files (see hf_tensors.h): the name mapping is built from
// ModelLayout::hf_views, so it follows the model's parameters wherever they change.
#include "model/hf_tensors.h"

#include <algorithm>
#include <cstdio>

#include "ckpt/file_io.h"
#include "ckpt/json.h"
#include "core/error.h"
#include "runtime/memory.h"

namespace mop {

namespace fs = std::filesystem;

namespace {

// Mixtral's names for the per-expert projections (w1 gate, w3 up, w2 down).
std::string mixtral_expert_weight(std::string_view projection) {
  if (projection == "gate_proj.weight") return "w1.weight";
  if (projection == "up_proj.weight") return "w3.weight";
  MOP_CHECK(projection == "down_proj.weight", "unexpected expert tensor ", projection);
  return "w2.weight";
}

}  // namespace

std::string_view hf_layout_name(HfLayout layout) {
  return layout == HfLayout::PerExpert ? "per-expert" : "fused";
}

std::optional<HfLayout> parse_hf_layout(std::string_view name) {
  if (name == "per-expert") return HfLayout::PerExpert;
  if (name == "fused") return HfLayout::Fused;
  return std::nullopt;
}

int64_t HfTensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::vector<HfTensorSpec> hf_tensor_specs(const ModelLayout& layout, HfArch arch,
                                          HfLayout hf_layout) {
  MOP_CHECK(layout.dims.experts_local == layout.dims.experts,
            "HF tensors need the whole model's layout");
  std::vector<HfTensorSpec> out;
  std::map<std::string, size_t> fused;  // fused tensor name → index in out
  for (const HfView& v : layout.hf_views()) {
    const ParamDef& def = layout.params[size_t(v.param)];
    const std::string layer = "model.layers." + std::to_string(def.layer) + ".";
    if (def.kind == ParamKind::Experts && hf_layout == HfLayout::Fused) {
      // Our fused parameters are exactly transformers 5's: [E, 2F, H] gate rows then up rows per
      // expert, and [E, H, F]; the per-expert views come in expert order.
      std::string name = layer + (def.name.ends_with("gate_up_proj") ? "mlp.experts.gate_up_proj"
                                                                     : "mlp.experts.down_proj");
      auto [it, fresh] = fused.try_emplace(name, out.size());
      if (fresh) out.push_back({name, def.shape, {}});
      out[it->second].parts.push_back(v);
    } else if (def.kind == ParamKind::Experts && arch == HfArch::Mixtral) {
      // v.name = <layer>mlp.experts.<j>.<projection>
      std::string rest = v.name.substr(layer.size() + std::string_view("mlp.experts.").size());
      size_t dot = rest.find('.');
      out.push_back({layer + "block_sparse_moe.experts." + rest.substr(0, dot) + "." +
                         mixtral_expert_weight(std::string_view(rest).substr(dot + 1)),
                     v.shape,
                     {v}});
    } else if (def.kind == ParamKind::Router && arch == HfArch::Mixtral &&
               hf_layout == HfLayout::PerExpert) {
      out.push_back({layer + "block_sparse_moe.gate.weight", v.shape, {v}});
    } else {
      out.push_back({v.name, v.shape, {v}});
    }
  }
  return out;
}

bool hf_tensor_ignorable(std::string_view name, bool tied_embeddings) {
  return (tied_embeddings && name == "lm_head.weight") || name.ends_with("rotary_emb.inv_freq");
}

HfTensorFiles::HfTensorFiles(const fs::path& dir) : dir_(dir) {
  std::error_code ec;
  MOP_USER_CHECK(fs::is_directory(dir, ec), dir.string(), ": not a directory");
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    const std::string where = index.string();
    Json j = read_json_file(index);
    std::map<std::string, size_t> file_idx;
    for (const auto& [name, file] : j.at("weight_map", where).as_object(where + ": weight_map")) {
      const std::string& fname = file.as_string(where + ": weight_map." + name);
      auto [it, fresh] = file_idx.try_emplace(fname, files_.size());
      if (fresh) {
        const fs::path as_path(fname);
        MOP_USER_CHECK(as_path.filename() == as_path && fname != "." && fname != "..", where,
                       ": weight_map: '", name, "': ", fname,
                       " is not a file name (a file of the directory itself)");
        MOP_USER_CHECK(fs::is_regular_file(dir / fname, ec), where, ": weight_map names ", fname,
                       ", which is not in ", dir.string());
        files_.emplace_back(dir / fname);
      }
      MOP_USER_CHECK(files_[it->second].find(name), where, ": weight_map puts '", name, "' in ",
                     fname, ", which has no such tensor");
      tensors_.emplace(name, Entry{it->second, nullptr});
    }
  } else {
    std::vector<fs::path> paths;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec))
      if (e.is_regular_file() && e.path().extension() == ".safetensors") paths.push_back(e.path());
    MOP_USER_CHECK(!ec, dir.string(), ": cannot list: ", ec.message());
    MOP_USER_CHECK(!paths.empty(), dir.string(),
                   ": no *.safetensors files (PyTorch .bin checkpoints "
                   "are not supported; save with safe_serialization=True)");
    std::sort(paths.begin(), paths.end());
    for (const fs::path& p : paths) {
      files_.emplace_back(p);
      for (const auto& [name, t] : files_.back().tensors()) {
        auto [it, fresh] = tensors_.emplace(name, Entry{files_.size() - 1, nullptr});
        MOP_USER_CHECK(fresh, dir.string(), ": tensor '", name, "' is in both ",
                       files_[it->second.file].path().filename().string(), " and ",
                       p.filename().string(), " (and there is no model.safetensors.index.json)");
      }
    }
  }
  // Pointers into the files' tensor tables, taken once the vector of files no longer moves.
  for (auto& [name, e] : tensors_) e.tensor = files_[e.file].find(name);
}

const SafetensorsTensor* HfTensorFiles::find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second.tensor;
}

const fs::path& HfTensorFiles::file_of(std::string_view name) const {
  auto it = tensors_.find(name);
  MOP_CHECK(it != tensors_.end(), "no tensor ", name);
  return files_[it->second.file].path();
}

std::vector<std::string> HfTensorFiles::names() const {
  std::vector<std::string> out;
  for (const auto& [name, e] : tensors_) out.push_back(name);
  return out;
}

HfLayout HfTensorFiles::detect_layout() const {
  for (const auto& [name, e] : tensors_)
    if (name.ends_with(".mlp.experts.gate_up_proj")) return HfLayout::Fused;
  return HfLayout::PerExpert;
}

std::string hf_shard_name(int shard_idx, int num_shards) {
  if (num_shards == 1) return "model.safetensors";
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", shard_idx + 1, num_shards);
  return buf;
}

HfShardStats write_hf_shards(const fs::path& dir, const std::vector<HfTensorSpec>& specs,
                             DType dtype, uint64_t max_shard_bytes,
                             const std::function<void(const HfTensorSpec&, Tensor)>& fill) {
  MOP_CHECK(dtype == DType::BF16 || dtype == DType::F32, "HF export dtype ", dtype_name(dtype));
  // save_pretrained's split (huggingface_hub split_state_dict_into_shards): in order, a tensor
  // joins the current shard unless that would pass the limit; an oversized one goes alone.
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t current_bytes = 0, total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const uint64_t bytes = uint64_t(specs[i].numel()) * dtype_size(dtype);
    total += bytes;
    if (bytes > max_shard_bytes) {
      shards.push_back({i});
      continue;
    }
    if (current_bytes + bytes > max_shard_bytes && !current.empty()) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(i);
    current_bytes += bytes;
  }
  if (!current.empty()) shards.push_back(std::move(current));

  std::error_code ec;
  fs::create_directories(dir, ec);
  MOP_USER_CHECK(!ec, dir.string(), ": cannot create: ", ec.message());
  const int n = int(shards.size());
  std::map<std::string, std::string> weight_map;  // sorted, as transformers writes the index
  for (int s = 0; s < n; ++s) {
    size_t bytes = 0;
    for (size_t i : shards[size_t(s)])
      bytes += align_up(size_t(specs[i].numel()) * dtype_size(dtype), 8);
    Buffer buf(MemKind::Host, std::max<size_t>(bytes, 8));
    std::vector<SafetensorsEntry> entries;
    size_t offset = 0;
    for (size_t i : shards[size_t(s)]) {
      const HfTensorSpec& spec = specs[i];
      Tensor t(static_cast<char*>(buf.data()) + offset, dtype, {});
      t.ndim = int(spec.shape.size());
      MOP_CHECK(t.ndim <= Tensor::kMaxDims, spec.name, ": ", t.ndim, " dims");
      for (int d = 0; d < t.ndim; ++d) t.shape[size_t(d)] = spec.shape[size_t(d)];
      fill(spec, t);
      entries.push_back({spec.name, t});
      weight_map[spec.name] = hf_shard_name(s, n);
      offset += align_up(t.bytes(), 8);
    }
    write_safetensors(dir / hf_shard_name(s, n), entries, {{"format", "pt"}});
  }
  if (n > 1) {
    Json index = Json::object();
    index["metadata"]["total_size"] = total;
    Json& wm = index["weight_map"];
    wm = Json::object();
    for (const auto& [name, file] : weight_map) wm[name] = file;
    write_file_durable(dir / "model.safetensors.index.json", index.dump(2));
  }
  return {n, total};
}

}  // namespace mop
