// Hugging Face model directories built by hand for the [hf] tests: config.json text and tensors
// named as transformers names them (spelled out here, independently of src/model/hf_tensors.cpp),
// written with our safetensors writer, one file or shards with model.safetensors.index.json.
#pragma once

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "ckpt/json.h"
#include "ckpt/safetensors.h"
#include "core/dtype.h"
#include "core/rng.h"

namespace mop::hf_test {

struct TinyHf {
  std::string arch = "qwen3_moe";  // or "mixtral"
  bool fused = false;              // transformers 5 fused experts instead of per-expert tensors
  DType dtype = DType::F32;        // F32 or BF16 on disk
  bool tied = false;
  int first_dense = 0;  // qwen3_moe: mlp_only_layers = [0, first_dense)
  int shards = 1;       // > 1: model-0000i-of-0000n.safetensors + index
  int64_t vocab = 40, hidden = 8, layers = 3, heads = 2, kv_heads = 1, head_dim = 6;
  int64_t experts = 3, top_k = 2, ffn = 5, dense_ffn = 7;
  uint64_t seed = 1;
};

struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;  // exact in bf16
};

inline std::vector<float> tensor_values(uint64_t seed, const std::string& key, int64_t n) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a of the name: values depend on (seed, name, index)
  for (char c : key) h = (h ^ uint8_t(c)) * 1099511628211ull;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    double u = double(philox_u64(seed, h, uint64_t(i)) >> 11) / 9007199254740992.0;
    v[size_t(i)] = round_bf16(float(u * 2 - 1));
  }
  return v;
}

// The model's tensors, per-expert values keyed by (seed, Qwen3-style per-expert name), so the
// fused and per-expert layouts, and Qwen3 and Mixtral names, carry the same numbers.
inline std::vector<NamedTensor> tiny_tensors(const TinyHf& m) {
  const bool mixtral = m.arch == "mixtral";
  const int64_t H = m.hidden, D = m.head_dim, F = m.ffn, E = m.experts;
  std::vector<NamedTensor> out;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, const std::string& key) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    out.push_back({name, shape, tensor_values(m.seed, key, n)});
  };
  auto plain = [&](const std::string& name, std::vector<int64_t> shape) { add(name, shape, name); };
  plain("model.embed_tokens.weight", {m.vocab, H});
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    plain(p + "input_layernorm.weight", {H});
    plain(p + "self_attn.q_proj.weight", {m.heads * D, H});
    plain(p + "self_attn.k_proj.weight", {m.kv_heads * D, H});
    plain(p + "self_attn.v_proj.weight", {m.kv_heads * D, H});
    plain(p + "self_attn.o_proj.weight", {H, m.heads * D});
    if (!mixtral) {
      plain(p + "self_attn.q_norm.weight", {D});
      plain(p + "self_attn.k_norm.weight", {D});
    }
    plain(p + "post_attention_layernorm.weight", {H});
    if (l < m.first_dense) {
      plain(p + "mlp.gate_proj.weight", {m.dense_ffn, H});
      plain(p + "mlp.up_proj.weight", {m.dense_ffn, H});
      plain(p + "mlp.down_proj.weight", {H, m.dense_ffn});
      continue;
    }
    const std::string moe = p + (mixtral && !m.fused ? "block_sparse_moe." : "mlp.");
    add(moe + "gate.weight", {E, H}, p + "mlp.gate.weight");
    auto key = [&](int64_t e, const char* proj) {
      return p + "mlp.experts." + std::to_string(e) + "." + proj + ".weight";
    };
    if (m.fused) {
      NamedTensor gu{moe + "experts.gate_up_proj", {E, 2 * F, H}, {}};
      NamedTensor dn{moe + "experts.down_proj", {E, H, F}, {}};
      for (int64_t e = 0; e < E; ++e) {
        for (const char* proj : {"gate_proj", "up_proj"})
          for (float v : tensor_values(m.seed, key(e, proj), F * H)) gu.values.push_back(v);
        for (float v : tensor_values(m.seed, key(e, "down_proj"), H * F)) dn.values.push_back(v);
      }
      out.push_back(std::move(gu));
      out.push_back(std::move(dn));
      continue;
    }
    for (int64_t e = 0; e < E; ++e) {
      const std::string ex = moe + "experts." + std::to_string(e) + ".";
      add(ex + (mixtral ? "w1.weight" : "gate_proj.weight"), {F, H}, key(e, "gate_proj"));
      add(ex + (mixtral ? "w3.weight" : "up_proj.weight"), {F, H}, key(e, "up_proj"));
      add(ex + (mixtral ? "w2.weight" : "down_proj.weight"), {H, F}, key(e, "down_proj"));
    }
  }
  plain("model.norm.weight", {H});
  if (!m.tied) plain("lm_head.weight", {m.vocab, H});
  return out;
}

// transformers 5's config.json for the model (keys as save_pretrained writes them).
inline Json tiny_config(const TinyHf& m) {
  const bool mixtral = m.arch == "mixtral";
  Json j = Json::object();
  j["architectures"] =
      Json(Json::Array{Json(mixtral ? "MixtralForCausalLM" : "Qwen3MoeForCausalLM")});
  j["model_type"] = m.arch;
  j["vocab_size"] = m.vocab;
  j["hidden_size"] = m.hidden;
  j["num_hidden_layers"] = m.layers;
  j["num_attention_heads"] = m.heads;
  j["num_key_value_heads"] = m.kv_heads;
  j["head_dim"] = m.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = 1e-6;
  j["rope_parameters"]["rope_theta"] = 10000.0;
  j["rope_parameters"]["rope_type"] = "default";
  j["tie_word_embeddings"] = m.tied;
  j["num_experts_per_tok"] = m.top_k;
  j["router_aux_loss_coef"] = 0.001;
  j["max_position_embeddings"] = 256;
  j["sliding_window"] = nullptr;
  j["dtype"] = m.dtype == DType::BF16 ? "bfloat16" : "float32";
  if (mixtral) {
    j["num_local_experts"] = m.experts;
    j["intermediate_size"] = m.ffn;
  } else {
    j["num_local_experts"] = m.experts;  // transformers 5 spells num_experts this way
    j["moe_intermediate_size"] = m.ffn;
    j["intermediate_size"] = m.dense_ffn;
    j["norm_topk_prob"] = true;
    j["decoder_sparse_step"] = 1;
    j["use_sliding_window"] = false;
    j["attention_bias"] = false;
    Json dense = Json::array();
    for (int l = 0; l < m.first_dense; ++l) dense.push_back(l);
    j["mlp_only_layers"] = std::move(dense);
  }
  return j;
}

inline void write_text_file(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

// Writes the model into `dir` (created): config.json with `config`, tensors as m.dtype in m.shards
// files (round robin by tensor, so every shard holds several).
inline void write_tiny_hf(const std::filesystem::path& dir, const TinyHf& m, const Json& config,
                          const std::vector<NamedTensor>& tensors) {
  std::filesystem::create_directories(dir);
  write_text_file(dir / "config.json", config.dump(2));
  std::vector<std::vector<uint16_t>> bf16_store(tensors.size());
  std::vector<std::vector<SafetensorsEntry>> files(size_t(m.shards));
  Json weight_map = Json::object();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const NamedTensor& t = tensors[i];
    void* data = const_cast<float*>(t.values.data());
    if (m.dtype == DType::BF16) {
      for (float v : t.values) bf16_store[i].push_back(float_to_bf16(v).bits);
      data = bf16_store[i].data();
    }
    Tensor view(data, m.dtype, {});
    view.ndim = int(t.shape.size());
    for (int d = 0; d < view.ndim; ++d) view.shape[size_t(d)] = t.shape[size_t(d)];
    const size_t shard = i % size_t(m.shards);
    files[shard].push_back({t.name, view});
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05d.safetensors", shard + 1, m.shards);
    weight_map[t.name] = std::string(m.shards == 1 ? "model.safetensors" : name);
  }
  for (int s = 0; s < m.shards; ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, m.shards);
    write_safetensors(dir / (m.shards == 1 ? "model.safetensors" : name), files[size_t(s)],
                      {{"format", "pt"}});
  }
  if (m.shards > 1) {
    Json index = Json::object();
    index["metadata"]["total_size"] = 0;
    index["weight_map"] = std::move(weight_map);
    write_text_file(dir / "model.safetensors.index.json", index.dump(2));
  }
}

inline void write_tiny_hf(const std::filesystem::path& dir, const TinyHf& m) {
  write_tiny_hf(dir, m, tiny_config(m), tiny_tensors(m));
}

// Every tensor of a model directory (all of its *.safetensors files) by name: dtype, shape, bytes.
struct RawTensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
inline std::map<std::string, RawTensor> read_all_tensors(const std::filesystem::path& dir) {
  std::map<std::string, RawTensor> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    SafetensorsFile f(e.path());
    for (const auto& [name, t] : f.tensors())
      out[name] = {t.dtype, t.shape, std::string(static_cast<const char*>(t.data), t.bytes)};
  }
  return out;
}

}  // namespace mop::hf_test
