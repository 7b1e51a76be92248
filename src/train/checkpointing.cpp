// Trainer checkpoints (see checkpointing.h): tensors under their checkpoint names as zero-copy
// views into the flat optimizer buffers, so saving and loading copy nothing but the file bytes.
#include "train/checkpointing.h"

#include <cstring>

#include <spdlog/spdlog.h>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors.h"
#include "config/schema.h"
#include "plan/parallel_spec.h"
#include "runtime/bulk_copy.h"

namespace mop {

namespace {

// The fp32 view of checkpoint tensor `v` inside parameter tensor `param` (a flat-buffer slot),
// on the slot's device.
Tensor view_of(const Tensor& param, const HfView& v) {
  Tensor t(static_cast<char*>(param.data) + size_t(v.offset) * sizeof(float), DType::F32, {});
  t.device = param.device;
  t.ndim = int(v.shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = v.shape[i];
  return t;
}

// The same, for tensors written to files from host memory.
Tensor hf_slice(const Tensor& param, const HfView& v) {
  MOP_CHECK(param.device == Device::CPU, "checkpoint tensors are written from host memory");
  return view_of(param, v);
}

}  // namespace

std::string config_key_differences(const Config& saved, const Config& now,
                                   std::initializer_list<const char*> prefixes) {
  Config a = saved, b = now;
  auto fa = config_schema(a), fb = config_schema(b);
  auto text = [](const FieldSpec& f) -> std::string {
    switch (f.kind) {
      case FieldSpec::Kind::Int: return std::to_string(*static_cast<int64_t*>(f.ptr));
      case FieldSpec::Kind::Float: {
        char buf[40];
        std::snprintf(buf, sizeof buf, "%.17g", *static_cast<double*>(f.ptr));
        return buf;
      }
      case FieldSpec::Kind::Bool: return *static_cast<bool*>(f.ptr) ? "true" : "false";
      case FieldSpec::Kind::String: return "\"" + *static_cast<std::string*>(f.ptr) + "\"";
      case FieldSpec::Kind::StringList: {
        std::string out = "[";
        for (const std::string& v : *static_cast<std::vector<std::string>*>(f.ptr))
          out += (out.size() > 1 ? ", " : "") + v;
        return out + "]";
      }
      case FieldSpec::Kind::GrowthStages: return growth_text(*static_cast<std::vector<GrowthStage>*>(f.ptr));
    }
    return "?";
  };
  std::string out;
  for (size_t i = 0; i < fa.size(); ++i) {
    bool wanted = false;
    for (const char* p : prefixes) wanted = wanted || fa[i].path.rfind(p, 0) == 0;
    // The growth schedule is not the model: a stage's expert count is moe.num_experts; nor is the
    // context length export-hf writes.
    if (!wanted || fa[i].path.starts_with("moe.growth") || fa[i].path == "model.max_position_embeddings") continue;
    const std::string va = text(fa[i]), vb = text(fb[i]);
    if (va != vb) out += (out.empty() ? "" : ", ") + fa[i].path + " " + va + " → " + vb;
  }
  return out;
}

namespace {

// The optimizer state tensor `which` (0 master, 1 exp_avg, 2 exp_avg_sq) of parameter p.
Tensor state_tensor(const Optimizer& optim, int p, int which) {
  return which == 0 ? optim.master(p) : which == 1 ? optim.exp_avg(p) : optim.exp_avg_sq(p);
}

// Host-readable views of one optimizer state tensor per parameter: the tensor itself when it is
// in host memory, else a copy staged into `keep` (checkpoints are rare; the staging is freed when
// `keep` goes; a vector keeps its buffer when `keep` grows). Sliced parameters of several
// replicas: every replica's slices gathered (a collective over each parameter's replicas, so every
// rank calls this), kept by the writer (slice 0) only.
std::vector<Tensor> host_state(const ParamStore& params, const Optimizer& optim, const ParallelGroups* groups,
                               int which, std::vector<HostFloats>& keep) {
  std::vector<Tensor> out;
  BulkCopier copier;
  const int n = params.num_params();
  for (int p = 0; p < n; ++p) {
    if (!optim.owns(p)) {  // updated (and saved) by another rank
      out.emplace_back();
      continue;
    }
    Tensor t = state_tensor(optim, p, which);
    if (t.device != Device::CPU) {
      keep.emplace_back(size_t(t.numel()));
      Tensor h = t;
      h.data = keep.back().data();
      h.device = Device::CPU;
      copier.copy(h, t);
      t = h;
    }
    if (params.sliced() && params.slice_count(p) > 1) {
      const ParamDef& def = params.layout().params[p];
      MOP_CHECK(groups, "saving sliced parameters needs the parallel groups");
      Comm& replicas = groups->host(replica_axes(def));
      HostFloats whole(size_t(t.numel() * params.slice_count(p)));
      replicas.all_gather(Tensor(whole.data(), DType::F32, {int64_t(whole.size())}), t);
      if (params.slice_index(p) != 0) {
        out.emplace_back();
        continue;
      }
      keep.push_back(std::move(whole));
      t = Tensor(keep.back().data(), DType::F32, {});
      t.ndim = int(def.shape.size());
      for (int i = 0; i < t.ndim; ++i) t.shape[i] = def.shape[i];
    }
    out.push_back(t);
  }
  return out;
}

// The tensor files of a checkpoint with this prefix ("model" or "optimizer"): one file, or one per
// writing rank ("model-rank1-of-4.safetensors"); tensors are found by name in any of them, so a
// checkpoint loads under any rank layout.
// Only files the (verified) manifest lists are read.
std::vector<SafetensorsFile> open_shards(const std::string& dir, const Manifest& m, const std::string& prefix) {
  std::vector<SafetensorsFile> files;
  for (const ManifestFile& f : m.files)
    if (f.name.rfind(prefix, 0) == 0 && f.name.ends_with(".safetensors"))
      files.emplace_back(std::filesystem::path(dir) / f.name);
  MOP_USER_CHECK(!files.empty(), "checkpoint ", dir, ": no ", prefix, "*.safetensors");
  return files;
}

// A tensor by checkpoint name (nullptr when absent), and where such names are found, for messages.
using TensorLookup = std::function<const SafetensorsTensor*(const std::string& name, std::string* where)>;

TensorLookup files_lookup(const std::vector<SafetensorsFile>& files) {
  return [&files](const std::string& name, std::string* where) -> const SafetensorsTensor* {
    *where = files.front().path().parent_path().string();
    for (const SafetensorsFile& f : files)
      if (const SafetensorsTensor* t = f.find(name)) {
        *where = f.path().string();
        return t;
      }
    return nullptr;
  };
}

// Loads the weights (which 0) or a moment (1, 2) of every parameter this rank owns from `lookup`,
// straight into the optimizer's tensors (BulkCopier: through pinned bounce buffers for those on
// the device). Loads happen before the first step, while no host update runs.
void load_state(const TensorLookup& lookup, const ParamStore& params, Optimizer& optim,
                const std::string& suffix, int which, const std::string& differences) {
  BulkCopier copier;
  // Sliced parameters of several replicas: the whole parameter is read into `whole`, then this
  // rank's slice (zeros past the end) goes to the state.
  std::vector<HostFloats> whole(size_t(params.num_params()));
  auto sliced = [&](int p) { return params.sliced() && params.slice_count(p) > 1; };
  for (int p = 0; p < params.num_params(); ++p)
    if (sliced(p) && optim.owns(p)) whole[size_t(p)].assign(size_t(params.slice_numel(p) * params.slice_count(p)), 0.0f);
  for (const HfView& v : params.layout().hf_views()) {
    if (!optim.owns(v.param)) continue;
    std::string name = v.name + suffix, where;
    const SafetensorsTensor* t = lookup(name, &where);
    std::string hint = differences.empty() ? "" : " (the config differs from the checkpoint's: " + differences + ")";
    MOP_USER_CHECK(t, where, ": no tensor '", name, "'", hint);
    MOP_USER_CHECK(t->dtype == DType::F32, where, ": tensor '", name, "' is ",
                   dtype_name(t->dtype), ", expected f32");
    MOP_USER_CHECK(t->shape == v.shape, where, ": tensor '", name, "' has shape ",
                   shape_str(t->shape), ", the model expects ", shape_str(v.shape), hint);
    if (sliced(v.param)) {
      std::memcpy(whole[size_t(v.param)].data() + v.offset, t->data, t->bytes);
      continue;
    }
    const Tensor slot = state_tensor(optim, v.param, which);
    const Tensor dst = view_of(slot, v);
    copier.copy(dst.data, dst.device != Device::CPU, t->data, false, t->bytes);
  }
  for (int p = 0; p < params.num_params(); ++p) {
    if (whole[size_t(p)].empty()) continue;
    const Tensor slot = state_tensor(optim, p, which);
    const float* mine = whole[size_t(p)].data() + params.slice_numel(p) * params.slice_index(p);
    copier.copy(slot.data, slot.device != Device::CPU, mine, false, slot.bytes());
  }
}

}  // namespace

std::string save_checkpoint(const Config& cfg, const ParamStore& params, const Optimizer& optim,
                            const TrainerState& state, World& world, const ParallelGroups* groups,
                            const TokenizerFiles* tokenizer) {
  // Rank 0 creates step_N.tmp; every rank writes the tensors whose optimizer state it owns (with
  // ZeRO-1 each replicated tensor has one owner; expert shards too), then rank 0 hashes every file,
  // writes the manifest and renames.
  std::optional<CheckpointWriter> w;
  if (world.is_root()) {
    w.emplace(CheckpointWriter::begin(cfg.checkpoint.dir, state.step));
    if (tokenizer) tokenizer->write_into(w->dir());
  }
  world.comm->barrier();
  const ModelLayout& layout = params.layout();
  // Sliced parameters: the replica with slice 0 writes the whole tensor (of its pipeline stage's).
  auto mine = [&](const HfView& v) {
    const int p = v.param;
    return optim.owns(p) && (!(params.sliced() && params.slice_count(p) > 1) || params.slice_index(p) == 0);
  };
  bool writer = false;
  for (const HfView& v : layout.hf_views()) writer = writer || mine(v);
  // Sliced parameters: every rank takes part in gathering them, the writers write.
  if (writer || params.sliced()) {
    const std::filesystem::path dir = checkpoint_tmp_dir(cfg.checkpoint.dir, state.step);
    const std::string shard = world.size > 1 ? "-rank" + std::to_string(world.rank) + "-of-" +
                                                   std::to_string(world.size) : "";
    const std::string model_file = "model" + shard + ".safetensors";
    const std::string optim_file = "optimizer" + shard + ".safetensors";
    SafetensorsMetadata meta{{"format", "pt"}, {"producer", "mop " MOP_VERSION}};
    {
      std::vector<HostFloats> keep;
      std::vector<Tensor> master = host_state(params, optim, groups, 0, keep);
      std::vector<SafetensorsEntry> model;
      for (const HfView& v : layout.hf_views())
        if (mine(v)) model.push_back({v.name, hf_slice(master[v.param], v)});
      if (writer) {
        FileDigest d = write_safetensors(dir / model_file, model, meta);
        if (w) w->add_file(model_file, d);
      }
    }
    {
      std::vector<HostFloats> keep;
      std::vector<Tensor> m = host_state(params, optim, groups, 1, keep);
      std::vector<Tensor> v2 = host_state(params, optim, groups, 2, keep);
      std::vector<SafetensorsEntry> moments;
      for (const HfView& v : layout.hf_views()) {
        if (!mine(v)) continue;
        moments.push_back({v.name + ".exp_avg", hf_slice(m[v.param], v)});
        moments.push_back({v.name + ".exp_avg_sq", hf_slice(v2[v.param], v)});
      }
      if (writer) {
        FileDigest d = write_safetensors(dir / optim_file, moments, meta);
        if (w) w->add_file(optim_file, d);
      }
    }
  }
  world.comm->barrier();
  std::string saved;
  if (w) {
    Manifest m;
    m.step = state.step;
    m.config = dump_config(cfg);
    m.state["consumed_samples"] = state.consumed_samples;
    m.state["optimizer_updates"] = state.optimizer_updates;
    m.state["seed"] = state.seed;
    m.state["data_fingerprint"] = state.data_fingerprint;
    m.state["world_size"] = world.size;
    if (state.growth_stages > 0) {
      m.state["growth_stage"] = state.growth_stage;
      m.state["growth_stages"] = state.growth_stages;
    }
    saved = w->commit(std::move(m)).string();
    for (const auto& gone : prune_checkpoints(cfg.checkpoint.dir, int(cfg.checkpoint.keep_last)))
      spdlog::debug("removed old checkpoint {}", gone.string());
  }
  world.comm->barrier();
  return saved;
}

std::optional<TokenizerFiles> resolve_run_tokenizer(const Config& cfg, const std::optional<std::string>& from) {
  std::optional<TokenizerFiles> data;
  const bool named = !cfg.data.tokenizer.empty();
  if (named) {
    data = TokenizerFiles::read(cfg.data.tokenizer, "data.tokenizer");
  } else {
    std::string with, without;
    for (const std::string& path : cfg.data.paths) {
      std::optional<TokenizerFiles> t = TokenizerFiles::beside_data(path);
      (t ? with : without) = path;
      if (!t) continue;
      MOP_USER_CHECK(!data || data->tokenizer_json() == t->tokenizer_json(), "data.paths: ", data->source,
                     " and ", t->source, " differ: the shards were made with different tokenizers");
      if (!data) data = std::move(t);
    }
    MOP_USER_CHECK(with.empty() || without.empty(), "data.paths: ", with, " was made with a tokenizer (",
                   data->source, ") and ", without, " without one; prepare every shard with the same "
                   "tokenizer, or name the one that holds for all in data.tokenizer");
  }
  std::optional<TokenizerFiles> saved;
  if (from) saved = TokenizerFiles::in_directory(*from);
  if (data && saved && data->tokenizer_json() != saved->tokenizer_json()) {
    MOP_USER_CHECK(named, "the data's tokenizer ", data->source, " differs from the one checkpoint ", *from,
                   " was trained with (", saved->source, "): the ids would mean other tokens. Name the "
                   "tokenizer to keep in data.tokenizer if this is on purpose");
    spdlog::warn("data.tokenizer {} differs from the tokenizer of {}; the new checkpoints carry {}",
                 data->source, *from, data->source);
  }
  if (!data && saved)
    spdlog::warn("the data have no tokenizer (byte-level or random ids), checkpoint {} has one; the "
                 "new checkpoints keep it", *from);
  std::optional<TokenizerFiles> t = data ? std::move(data) : std::move(saved);
  if (t) t->check_fits(cfg.model.vocab_size);
  return t;
}

std::optional<std::string> resolve_resume_dir(const Config& cfg) {
  const std::string& mode = cfg.checkpoint.resume;
  if (mode == "none") return std::nullopt;
  auto dir = mode == "auto" ? resolve_resume(cfg.checkpoint.dir, ResumeMode::Auto)
                            : resolve_resume(mode, ResumeMode::Path);
  if (!dir) return std::nullopt;
  return dir->string();
}

Config checkpoint_config(const std::string& dir) {
  Manifest m = read_manifest(dir);
  return load_config_text(m.config, {}, dir + "/manifest.json config");
}

TrainerState load_checkpoint(const std::string& dir, const Config& cfg, const ParamStore& params,
                             Optimizer& optim, bool optim_state) {
  Manifest m = verify_checkpoint(dir);
  std::string where = dir + "/manifest.json";
  Config saved = load_config_text(m.config, {}, where + " config");
  std::string differences = config_key_differences(saved, cfg, {"model.", "moe."});
  {
    const std::vector<SafetensorsFile> files = open_shards(dir, m, "model");
    load_state(files_lookup(files), params, optim, "", 0, differences);
  }
  TrainerState st;
  st.step = m.step;
  st.consumed_samples = m.state.at("consumed_samples", where).as_int64(where + ": consumed_samples");
  st.optimizer_updates = m.state.at("optimizer_updates", where).as_int64(where + ": optimizer_updates");
  st.seed = m.state.at("seed", where).as_uint64(where + ": seed");
  st.data_fingerprint = m.state.at("data_fingerprint", where).as_uint64(where + ": data_fingerprint");
  MOP_USER_CHECK(st.optimizer_updates >= 0 && st.optimizer_updates <= st.step && st.consumed_samples >= 0,
                 where, ": counters disagree with step ", st.step, " (optimizer_updates ",
                 st.optimizer_updates, ", consumed_samples ", st.consumed_samples,
                 "); the checkpoint is inconsistent, resume from another");
  if (optim_state) {
    const std::vector<SafetensorsFile> f = open_shards(dir, m, "optimizer");
    load_state(files_lookup(f), params, optim, ".exp_avg", 1, differences);
    load_state(files_lookup(f), params, optim, ".exp_avg_sq", 2, differences);
    optim.set_updates(st.optimizer_updates);
  }
  optim.sync_weights();
  return st;
}

HeldCheckpoint hold_checkpoint(const Config& cfg, const ParamStore& params, const Optimizer& optim,
                               const TrainerState& state) {
  HeldCheckpoint h;
  h.config = cfg;
  h.state = state;
  BulkCopier copier;
  const char* suffix[3] = {"", ".exp_avg", ".exp_avg_sq"};
  for (int which = 0; which < 3; ++which)
    for (const HfView& v : params.layout().hf_views()) {
      MOP_CHECK(optim.owns(v.param), "hold_checkpoint: one rank holds every tensor");
      const Tensor slot = state_tensor(optim, v.param, which);
      const Tensor src = view_of(slot, v);
      HostFloats values(size_t(src.numel()));
      copier.copy(values.data(), false, src.data, src.device != Device::CPU, src.bytes());
      h.put(v.name + suffix[which], v.shape, std::move(values));
    }
  return h;
}

void HeldCheckpoint::put(const std::string& name, std::vector<int64_t> shape, HostFloats values) {
  Held& e = tensors[name];
  e.values = std::move(values);
  e.view.dtype = DType::F32;
  e.view.shape = std::move(shape);
  e.view.data = e.values.data();
  e.view.bytes = e.values.size() * sizeof(float);
}

size_t HeldCheckpoint::bytes() const {
  size_t n = 0;
  for (const auto& [name, h] : tensors) n += h.values.size() * sizeof(float);
  return n;
}

const SafetensorsTensor* HeldCheckpoint::find(const std::string& name) const {
  auto it = tensors.find(name);
  return it == tensors.end() ? nullptr : &it->second.view;
}

TrainerState load_held_checkpoint(const HeldCheckpoint& held, const Config& cfg, const ParamStore& params,
                                  Optimizer& optim) {
  const std::string differences = config_key_differences(held.config, cfg, {"model.", "moe."});
  MOP_CHECK(differences.empty(), "the held state is of another model: ", differences);
  const TensorLookup lookup = [&held](const std::string& name, std::string* where) {
    *where = "the state held between growth stages";
    return held.find(name);
  };
  const char* suffix[3] = {"", ".exp_avg", ".exp_avg_sq"};
  for (int which = 0; which < 3; ++which) load_state(lookup, params, optim, suffix[which], which, differences);
  optim.set_updates(held.state.optimizer_updates);
  optim.sync_weights();
  return held.state;
}

}  // namespace mop
