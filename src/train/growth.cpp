// Progressive expert growth (see growth.h).
#include "train/growth.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/file_io.h"
#include "model/hf_tensors.h"
#include "ckpt/manifest.h"
#include "ckpt/safetensors.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/small_file.h"
#include "model/model_spec.h"
#include "runtime/bulk_copy.h"

namespace mop {

namespace fs = std::filesystem;

int GrowthSchedule::stage_at(int64_t step) const {
  int s = 0;
  while (s + 1 < stages() && step >= end_step[size_t(s)]) ++s;
  return s;
}

bool GrowthSchedule::is_boundary(int64_t step) const {
  for (int s = 0; s + 1 < stages(); ++s)
    if (end_step[size_t(s)] == step) return true;
  return false;
}

GrowthSchedule growth_schedule(const Config& cfg) {
  const MoeConfig& e = cfg.moe;
  GrowthSchedule g;
  const int64_t steps = cfg.train.steps;
  if (e.growth_from > 0) {
    MOP_USER_CHECK(e.growth_from < e.num_experts, "moe.growth_from: ", e.growth_from,
                   " is not fewer than moe.num_experts (", e.num_experts, "): nothing to grow");
    // Doubling; stage i of n trains on 2^i / (2^n - 1) of the run (each expert sees the same
    // number of tokens in every stage).
    for (int64_t x = e.growth_from; x <= e.num_experts; x *= 2) g.experts.push_back(x);
    const double total = std::ldexp(1.0, g.stages()) - 1;
    double share = 0;
    for (int s = 0; s < g.stages(); ++s) {
      share += std::ldexp(1.0, s);
      g.end_step.push_back(s + 1 == g.stages() ? steps : int64_t(std::llround(double(steps) * share / total)));
    }
  } else if (!e.growth.empty()) {
    const double tokens_per_step = double(cfg.train.global_batch_size) * double(cfg.data.seq_len);
    double tokens = 0;
    for (size_t s = 0; s < e.growth.size(); ++s) {
      const GrowthStage& st = e.growth[s];
      g.experts.push_back(st.experts);
      tokens += st.tokens > 0 ? st.tokens : double(st.steps) * tokens_per_step;
      g.end_step.push_back(s + 1 == e.growth.size() ? steps : int64_t(std::llround(tokens / tokens_per_step)));
    }
  } else {
    return g;
  }
  MOP_USER_CHECK(g.experts.back() == e.num_experts, "moe.growth: the last stage has ", g.experts.back(),
                 " experts, moe.num_experts is ", e.num_experts, "; the last stage's count is the model's");
  for (int s = 0; s < g.stages(); ++s) {
    const int64_t begin = s ? g.end_step[size_t(s - 1)] : 0;
    MOP_USER_CHECK(g.end_step[size_t(s)] > begin, "moe.growth: stage ", s + 1, " (", g.experts[size_t(s)],
                   " experts) gets no step of the run's ", steps, " (raise its budget or train.steps)");
  }
  return g;
}

GrowthOptions growth_options(const Config& cfg, const GrowthSchedule& schedule, int stage) {
  return {schedule.experts[size_t(stage)], cfg.moe.growth_noise, cfg.moe.growth_optimizer == "copy",
          uint64_t(cfg.train.seed), stage + 1, schedule.stages()};
}

Config stage_config(const Config& cfg, const GrowthSchedule& schedule, int stage) {
  Config c = cfg;
  if (!schedule.empty()) c.moe.num_experts = schedule.experts[size_t(stage)];
  return c;
}

namespace {

// Expert index of a checkpoint name "model.layers.L.mlp.experts.J.…", or -1.
int64_t expert_of(const std::string& name, size_t* at, size_t* len) {
  const std::string key = ".mlp.experts.";
  const size_t p = name.find(key);
  if (p == std::string::npos) return -1;
  const size_t b = p + key.size(), e = name.find('.', b);
  if (e == std::string::npos) return -1;
  *at = b, *len = e - b;
  return std::stoll(name.substr(b, e - b));
}

bool is_router(const std::string& name) { return name.ends_with(".mlp.gate.weight"); }

}  // namespace

namespace {

// The tensors of `before`'s model grown to o.experts (see grow_checkpoint), in the grown layout's
// order: views into the source's tensors where they are kept or copied, into `made` (new router
// tensors, zeros) where not. `source(name)` returns a checkpoint tensor or nullptr; `where` names
// the source in errors.
std::vector<SafetensorsEntry> grown_tensors(const Config& before, const Config& after, const GrowthOptions& o,
                                            const std::function<const SafetensorsTensor*(const std::string&)>& source,
                                            const std::string& where, std::deque<std::vector<float>>& made) {
  const int64_t E = before.moe.num_experts, F = o.experts / E, H = after.model.hidden_size;
  const ModelLayout layout = ModelLayout::build(ModelDims::from(after));
  auto find = [&](const std::string& name) -> const SafetensorsTensor& {
    const SafetensorsTensor* t = source(name);
    MOP_USER_CHECK(t && t->dtype == DType::F32, where, ": no f32 tensor '", name, "'");
    return *t;
  };
  auto view = [](const void* data, const std::vector<int64_t>& shape) {
    Tensor v(const_cast<void*>(data), DType::F32, {});
    v.ndim = int(shape.size());
    for (int i = 0; i < v.ndim; ++i) v.shape[i] = shape[size_t(i)];
    return v;
  };
  // Zeros for fresh moments: as large as the largest expert or router tensor (none when copied).
  size_t at = 0, len = 0;
  int64_t largest = 0;
  for (const HfView& v : layout.hf_views()) {
    if (o.copy_moments || (expert_of(v.name, &at, &len) < 0 && !is_router(v.name))) continue;
    int64_t n = 1;
    for (int64_t d : v.shape) n *= d;
    largest = std::max(largest, n);
  }
  const std::vector<float>& zeros = made.emplace_back(size_t(largest), 0.0f);
  std::vector<SafetensorsEntry> out;
  const char* suffix[3] = {"", ".exp_avg", ".exp_avg_sq"};
  for (int k = 0; k < 3; ++k)
    for (const HfView& v : layout.hf_views()) {
      const int64_t j = expert_of(v.name, &at, &len);
      const bool router = is_router(v.name);
      std::string src = v.name;
      if (j >= 0) src.replace(at, len, std::to_string(j / F));
      const std::string name = v.name + suffix[k];
      if (k > 0 && !o.copy_moments && (j >= 0 || router)) {
        out.push_back({name, view(zeros.data(), v.shape)});
        continue;
      }
      const SafetensorsTensor& t = find(src + suffix[k]);
      if (!router) {
        MOP_USER_CHECK(t.shape == v.shape, where, ": tensor '", src + suffix[k], "' has shape ",
                       shape_str(t.shape), ", expected ", shape_str(v.shape));
        out.push_back({name, view(t.data, v.shape)});
        continue;
      }
      const std::vector<int64_t> want{E, H};
      MOP_USER_CHECK(t.shape == want, where, ": router '", name, "' has shape ", shape_str(t.shape),
                     ", expected [", E, ",", H, "]");
      const float* rows = static_cast<const float*>(t.data);
      std::vector<float>& g = made.emplace_back(size_t(o.experts * H));
      const uint64_t stream = fnv1a64("growth " + v.name + " " + std::to_string(o.experts));
      for (int64_t r = 0; r < o.experts; ++r) {
        const float* s = rows + (r / F) * H;
        float* d = g.data() + r * H;
        double ms = 0;
        for (int64_t c = 0; c < H; ++c) ms += double(s[c]) * double(s[c]);
        const double scale = (k == 0 && r % F != 0) ? o.noise * std::sqrt(ms / double(H)) : 0.0;
        for (int64_t c = 0; c < H; ++c)
          d[c] = scale > 0 ? float(double(s[c]) + scale * philox_normal(o.seed, stream, uint64_t(r * H + c))) : s[c];
      }
      out.push_back({name, view(g.data(), v.shape)});
    }
  return out;
}

// The config after growing `before` to `experts` (validated); UserError if not a multiple.
Config grown_config(const Config& before, int64_t experts, const std::string& what, const std::string& where) {
  const int64_t E = before.moe.num_experts;
  MOP_USER_CHECK(experts > E && experts % E == 0, what, ": cannot grow its ", E, " experts to ", experts,
                 " (not a multiple)");
  Config after = before;
  after.moe.num_experts = experts;
  return load_config_text(dump_config(after), {}, where + " (grown)");
}

void log_growth(const std::string& what, int64_t from, const GrowthOptions& o,
                std::chrono::steady_clock::time_point began) {
  spdlog::info("growth: {} now holds {} experts per MoE layer (each of the {} copied {}×; router noise {}, "
               "optimizer moments {}; grown in {:.1f} s)", what, o.experts, from, o.experts / from, o.noise,
               o.copy_moments ? "copied" : "zero",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count());
}

}  // namespace

void grow_checkpoint(const std::string& dir, const GrowthOptions& o) {
  const auto began = std::chrono::steady_clock::now();
  const Manifest m = verify_checkpoint(dir);
  const std::string where = dir + "/manifest.json config";
  const Config before = load_config_text(m.config, {}, where);
  const Config after = grown_config(before, o.experts, "checkpoint " + dir, where);
  CheckpointWriter w = CheckpointWriter::begin(fs::path(dir).parent_path(), m.step);
  {
    const HfTensorFiles files(dir);
    std::deque<std::vector<float>> made;  // grown router tensors and zeros, alive until written
    const std::vector<SafetensorsEntry> all = grown_tensors(
        before, after, o, [&](const std::string& name) { return files.find(name); }, "checkpoint " + dir, made);
    std::vector<SafetensorsEntry> weights, moments;
    for (const SafetensorsEntry& e : all)
      (e.name.ends_with(".exp_avg") || e.name.ends_with(".exp_avg_sq") ? moments : weights).push_back(e);
    // Files of at most 5 GB, named as the trainer's loader finds them (model*, optimizer*).
    const SafetensorsMetadata meta{{"format", "pt"}, {"producer", "mop " MOP_VERSION " growth"}};
    auto write = [&](const std::string& prefix, const std::vector<SafetensorsEntry>& part) {
      std::vector<std::vector<SafetensorsEntry>> groups(1);
      uint64_t bytes = 0;
      for (const SafetensorsEntry& e : part) {
        if (bytes + e.tensor.bytes() > 5'000'000'000ull && !groups.back().empty()) groups.emplace_back(), bytes = 0;
        groups.back().push_back(e);
        bytes += e.tensor.bytes();
      }
      for (size_t gi = 0; gi < groups.size(); ++gi) {
        std::string name = hf_shard_name(int(gi), int(groups.size()));
        name.replace(0, 5, prefix);  // "model…" → "optimizer…"
        w.add_file(name, write_safetensors(w.file(name), groups[gi], meta));
      }
    };
    write("model", weights);
    write("optimizer", moments);
  }
  // Every other file (the tokenizer, ...) as it was.
  for (const ManifestFile& f : m.files)
    if (!f.name.ends_with(".safetensors"))
      write_file_durable(w.file(f.name), read_small_file(fs::path(dir) / f.name, "checkpoint file",
                                                         kTokenizerFileCap));
  Manifest grown = m;
  grown.files.clear();
  grown.config = dump_config(after);
  Json::Object kept;  // a stage recorded before the growth is the previous one
  for (auto& [key, value] : grown.state.as_object())
    if (key != "growth_stage" && key != "growth_stages") kept.emplace_back(key, std::move(value));
  grown.state = Json(std::move(kept));
  grown.state["grown_from_experts"] = before.moe.num_experts;
  if (o.stage > 0) {
    grown.state["growth_stage"] = o.stage;
    grown.state["growth_stages"] = o.stages;
  }
  w.commit(std::move(grown));
  log_growth(dir, before.moe.num_experts, o, began);
}

HeldCheckpoint grow_held(HeldCheckpoint&& held, const GrowthOptions& o) {
  const auto began = std::chrono::steady_clock::now();
  HeldCheckpoint out;
  out.config = grown_config(held.config, o.experts, "the held state", "the held state's config");
  out.state = held.state;
  out.tokenizer = std::move(held.tokenizer);
  std::deque<std::vector<float>> made;
  const std::vector<SafetensorsEntry> grown = grown_tensors(
      held.config, out.config, o, [&](const std::string& name) { return held.find(name); }, "the held state", made);
  // The last grown tensor that reads a held tensor takes its values (a moved vector keeps its
  // buffer, so the views still to come stay valid); earlier ones copy. A held tensor nobody reads
  // (zeroed moments) goes at once: host memory peaks near the grown state, not old + new.
  std::map<const void*, std::pair<std::string, int>> readers;
  for (const auto& [name, h] : held.tensors)
    if (!h.values.empty()) readers[h.values.data()] = {name, 0};
  for (const SafetensorsEntry& e : grown)
    if (auto it = readers.find(e.tensor.data); it != readers.end()) ++it->second.second;
  for (const auto& [data, r] : readers)
    if (r.second == 0) held.tensors.erase(r.first);
  BulkCopier copier;
  for (const SafetensorsEntry& e : grown) {
    std::vector<int64_t> shape(e.tensor.shape.begin(), e.tensor.shape.begin() + e.tensor.ndim);
    auto it = readers.find(e.tensor.data);
    if (it != readers.end() && --it->second.second == 0) {
      auto h = held.tensors.find(it->second.first);
      out.put(e.name, std::move(shape), std::move(h->second.values));
      held.tensors.erase(h);
      continue;
    }
    HostFloats values(size_t(e.tensor.numel()));
    copier.copy(values.data(), false, e.tensor.data, false, e.tensor.bytes());
    out.put(e.name, std::move(shape), std::move(values));
  }
  log_growth("the state held in memory", held.config.moe.num_experts, o, began);
  return out;
}

}  // namespace mop
