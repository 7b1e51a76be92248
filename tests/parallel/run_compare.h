// Comparing training runs bit for bit (the sharding and streaming tests): every tensor of a
// checkpoint by name, the values a run logged, and how many tensors of one checkpoint differ from
// another's.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "catch.h"
#include "ckpt/safetensors.h"
#include "train/train_test_util.h"

namespace mop::test {

// The model and MoE of those runs (2 layers of hidden 32, 8 experts of top 2), its embedding tied
// or not; and the data: `corpus`, 32-token sequences.
inline std::string compare_model_yaml(bool tied, const std::string& corpus) {
  return "model: {vocab_size: 257, hidden_size: 32, num_layers: 2, num_heads: 8, num_kv_heads: 4, head_dim: 8, "
         "init_std: 0.1, tie_embeddings: " + std::string(tied ? "true" : "false") + "}\n"
         "moe: {num_experts: 8, top_k: 2, expert_ffn: 16, shared_expert_ffn: 8, aux_loss_coef: 0.05, "
         "z_loss_coef: 0.01}\n"
         "data: {paths: [" + corpus + "], seq_len: 32, eod_mask_loss: true}\n";
}

// Every tensor of a checkpoint (all its model and optimizer files), by name: its bytes.
inline std::map<std::string, std::string> checkpoint_tensors(const std::filesystem::path& step_dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(step_dir)) {
    if (e.path().extension() != ".safetensors") continue;
    SafetensorsFile f(e.path());
    for (const auto& [name, t] : f.tensors()) out[name] = std::string(static_cast<const char*>(t.data), t.bytes);
  }
  return out;
}

// A metric a run logged (metrics.jsonl in `dir`), one string a step (shortest round-trip text:
// equal ⇔ equal bits).
inline std::vector<std::string> logged(const std::string& dir, const std::string& key) {
  std::vector<std::string> out;
  for (const Json& j : read_metrics(dir + "/metrics.jsonl")) out.push_back(j.at(key).dump());
  return out;
}

// The steps of a run (metrics.jsonl in `dir`) whose gradient norm was above `clip`: clipping bound.
inline int steps_clipped(const std::string& dir, double clip) {
  int n = 0;
  for (const Json& j : read_metrics(dir + "/metrics.jsonl"))
    n += j.at("grad_norm").as_double() > clip;
  return n;
}

// The tensors of `a` that `b` lacks or holds with other bytes.
inline int differing_tensors(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  int differ = 0;
  for (const auto& [name, bytes] : a) {
    auto it = b.find(name);
    differ += it == b.end() || it->second != bytes;
  }
  return differ;
}

// Rank 0, after runs in directories under `root`: `base` trained (its loss moved over `steps`
// steps), `same_log` logged what `base` did for every key in `keys`, and the final checkpoint
// (step `steps`) of every one of `others` holds the same tensors with the same bytes as base's.
inline void check_same_runs(const std::string& root, const std::string& base, const std::string& same_log,
                            const std::vector<std::string>& keys, const std::vector<std::string>& others, int steps) {
  const std::string last = "/step_" + std::to_string(steps);
  const auto a = checkpoint_tensors(root + "/" + base + last);
  REQUIRE(a.size() > 20);
  const std::vector<std::string> loss = logged(root + "/" + base, "loss");
  CHECK(loss.size() == size_t(steps));
  CHECK(loss.front() != loss.back());  // it trains
  for (const std::string& key : keys) {
    INFO(key);
    CHECK(logged(root + "/" + base, key) == logged(root + "/" + same_log, key));
  }
  for (const std::string& other : others) {
    INFO(other);
    const auto b = checkpoint_tensors(root + "/" + other + last);
    CHECK(b.size() == a.size());
    CHECK(differing_tensors(a, b) == 0);
  }
}

}  // namespace mop::test
