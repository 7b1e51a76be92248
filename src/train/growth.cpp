// Progressive expert growth (see growth.h).
#include "train/growth.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <deque>
#include <filesystem>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/file_io.h"
#include "ckpt/hf_tensors.h"
#include "ckpt/manifest.h"
#include "ckpt/safetensors.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/model_spec.h"

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

void grow_checkpoint(const std::string& dir, const GrowthOptions& o) {
  const Manifest m = verify_checkpoint(dir);
  const std::string where = dir + "/manifest.json config";
  const Config before = load_config_text(m.config, {}, where);
  const int64_t E = before.moe.num_experts, F = o.experts / std::max<int64_t>(E, 1);
  MOP_USER_CHECK(o.experts > E && o.experts % E == 0, "checkpoint ", dir, ": cannot grow its ", E,
                 " experts to ", o.experts, " (not a multiple)");
  Config after = before;
  after.moe.num_experts = o.experts;
  after = load_config_text(dump_config(after), {}, where + " (grown)");
  const ModelLayout layout = ModelLayout::build(ModelDims::from(after));
  const int64_t H = after.model.hidden_size;

  const fs::path root = fs::path(dir).parent_path();
  CheckpointWriter w = CheckpointWriter::begin(root, m.step);
  {
    const HfTensorFiles files(dir);
    auto source = [&](const std::string& name) -> const SafetensorsTensor& {
      const SafetensorsTensor* t = files.find(name);
      MOP_USER_CHECK(t && t->dtype == DType::F32, "checkpoint ", dir, ": no f32 tensor '", name, "'");
      return *t;
    };
    auto view = [](const void* data, const std::vector<int64_t>& shape) {
      Tensor v(const_cast<void*>(data), DType::F32, {});
      v.ndim = int(shape.size());
      for (int i = 0; i < v.ndim; ++i) v.shape[i] = shape[size_t(i)];
      return v;
    };
    std::deque<std::vector<float>> made;  // grown router tensors and zeros, alive until written
    std::vector<SafetensorsEntry> tensors[3];  // weights, exp_avg, exp_avg_sq
    const char* suffix[3] = {"", ".exp_avg", ".exp_avg_sq"};
    int64_t largest = 0;
    for (const HfView& v : layout.hf_views()) {
      int64_t n = 1;
      for (int64_t d : v.shape) n *= d;
      largest = std::max(largest, n);
    }
    std::vector<float>& zeros = made.emplace_back(size_t(largest), 0.0f);
    for (const HfView& v : layout.hf_views()) {
      size_t at = 0, len = 0;
      const int64_t j = expert_of(v.name, &at, &len);
      const bool router = is_router(v.name);
      std::string src = v.name;
      if (j >= 0) src.replace(at, len, std::to_string(j / F));
      for (int k = 0; k < 3; ++k) {
        const std::string name = v.name + suffix[k];
        if (k > 0 && !o.copy_moments && (j >= 0 || router)) {
          tensors[k].push_back({name, view(zeros.data(), v.shape)});
          continue;
        }
        const SafetensorsTensor& t = source(src + suffix[k]);
        if (!router) {
          MOP_USER_CHECK(t.shape == v.shape, "checkpoint ", dir, ": tensor '", src + suffix[k], "' has shape ",
                         shape_str(t.shape), ", expected ", shape_str(v.shape));
          tensors[k].push_back({name, view(t.data, v.shape)});
          continue;
        }
        const std::vector<int64_t> want{E, H};
        MOP_USER_CHECK(t.shape == want, "checkpoint ", dir, ": router '", name,
                       "' has shape ", shape_str(t.shape), ", expected [", E, ",", H, "]");
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
        tensors[k].push_back({name, view(g.data(), v.shape)});
      }
    }
    // Files of at most 5 GB, named as the trainer's loader finds them (model*, optimizer*).
    const SafetensorsMetadata meta{{"format", "pt"}, {"producer", "mop " MOP_VERSION " growth"}};
    auto write = [&](const std::string& prefix, const std::vector<SafetensorsEntry>& all) {
      std::vector<std::vector<SafetensorsEntry>> groups(1);
      uint64_t bytes = 0;
      for (const SafetensorsEntry& e : all) {
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
    write("model", tensors[0]);
    std::vector<SafetensorsEntry> moments = tensors[1];
    moments.insert(moments.end(), tensors[2].begin(), tensors[2].end());
    write("optimizer", moments);
  }
  // Every other file (the tokenizer, ...) as it was.
  for (const ManifestFile& f : m.files)
    if (!f.name.ends_with(".safetensors")) write_file_durable(w.file(f.name), read_file(fs::path(dir) / f.name));
  Manifest grown = m;
  grown.files.clear();
  grown.config = dump_config(after);
  grown.state["grown_from_experts"] = E;
  w.commit(std::move(grown));
  spdlog::info("growth: {} now holds {} experts per MoE layer (each of the {} copied {}×; router noise {}, "
               "optimizer moments {})", dir, o.experts, E, F, o.noise, o.copy_moments ? "copied" : "zero");
}

}  // namespace mop
