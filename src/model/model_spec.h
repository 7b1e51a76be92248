// The model's shape and its parameters. Parameters are stored fused where one GEMM reads them
// (gate and up projections as one [2F,H] matrix, all experts of a layer as one [E,…] tensor);
// checkpoints name them as the published Qwen3-MoE checkpoints do (per-expert gate_proj/up_proj/
// down_proj, …) through zero-copy slices listed by `hf_views`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"

namespace mop {

struct ModelDims {
  int64_t vocab, hidden, layers, heads, kv_heads, head_dim;
  int64_t experts, top_k, expert_ffn, shared_ffn, dense_ffn, first_dense;
  bool qk_norm, renormalize, tied;
  double rope_theta, rms_eps, init_std;
  double aux_coef, z_coef;

  // Expert parallelism: this rank holds experts [expert_offset, expert_offset + experts_local).
  int64_t experts_local = 0, expert_offset = 0;

  // The whole model (experts_local = experts), or rank ep_rank's shard of ep_size.
  static ModelDims from(const Config& cfg, int ep_rank = 0, int ep_size = 1);
  bool is_moe(int64_t layer) const { return layer >= first_dense; }
  int64_t num_moe_layers() const { return layers - first_dense; }
  int64_t q_width() const { return heads * head_dim; }
  int64_t kv_width() const { return kv_heads * head_dim; }
};

// What a parameter is, for weight decay and optimizer-state placement.
enum class ParamKind : uint8_t { Embedding, AttentionProj, Norm, Router, Experts, Ffn, LmHead };

struct ParamDef {
  std::string name;            // internal name, e.g. model.layers.3.mlp.experts.gate_up_proj
  std::vector<int64_t> shape;  // row-major
  ParamKind kind;
  int layer;                   // -1 outside the layers
  std::string group;           // optimizer-state group: "embedding", "layers.3.attention", ...
  bool decay;                  // weight decay applies (not to norms or biases)
  int64_t numel() const;
};

// A checkpoint tensor: `shape` elements starting `offset` elements into parameter `param`.
struct HfView {
  std::string name;  // model.layers.3.mlp.experts.7.gate_proj.weight
  int param;
  int64_t offset;
  std::vector<int64_t> shape;
};

// Indices of a layer's parameters in the parameter list (-1 when absent).
struct LayerParams {
  int ln1 = -1, q = -1, k = -1, v = -1, o = -1, q_norm = -1, k_norm = -1, ln2 = -1;
  int router = -1, experts_gate_up = -1, experts_down = -1;  // MoE layers
  int shared_gate_up = -1, shared_down = -1;                 // shared expert
  int ffn_gate_up = -1, ffn_down = -1;                       // dense layers
};

struct ModelLayout {
  ModelDims dims;
  std::vector<ParamDef> params;
  std::vector<LayerParams> layers;
  int embedding = -1, final_norm = -1, lm_head = -1;  // lm_head == embedding when tied

  static ModelLayout build(const ModelDims& dims);
  std::vector<HfView> hf_views() const;
  int64_t num_params() const;
  // Parameters one token touches: attention, router, top_k experts, shared/dense FFN, norms and
  // the LM head; the embedding table (a lookup) is excluded as in the usual 6·N FLOP count.
  int64_t num_active_params() const;
};

}  // namespace mop
