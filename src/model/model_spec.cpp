// Model dimensions from the config, the parameter list in forward order, and the mapping to the
// Qwen3-MoE checkpoint names.
#include "model/model_spec.h"

#include "core/error.h"

namespace mop {

ModelDims ModelDims::from(const Config& c, int ep_rank, int ep_size) {
  ModelDims d{};
  d.vocab = c.model.vocab_size;
  d.hidden = c.model.hidden_size;
  d.layers = c.model.num_layers;
  d.heads = c.model.num_heads;
  d.kv_heads = c.model.num_kv_heads;
  d.head_dim = c.head_dim();
  d.experts = c.moe.num_experts;
  d.top_k = c.moe.top_k;
  d.expert_ffn = c.moe.expert_ffn;
  d.shared_ffn = c.moe.shared_expert_ffn;
  d.dense_ffn = c.dense_ffn();
  d.first_dense = c.moe.first_dense_layers;
  d.qk_norm = c.model.qk_norm;
  d.renormalize = c.moe.renormalize;
  d.tied = c.model.tie_embeddings;
  d.rope_theta = c.model.rope_theta;
  d.rms_eps = c.model.rms_eps;
  d.init_std = c.model.init_std;
  d.aux_coef = c.moe.aux_loss_coef;
  d.z_coef = c.moe.z_loss_coef;
  d.experts_local = d.experts / ep_size;
  d.expert_offset = d.experts_local * ep_rank;
  return d;
}

int64_t ParamDef::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

ModelLayout ModelLayout::build(const ModelDims& d) {
  ModelLayout m;
  m.dims = d;
  auto add = [&](std::string name, std::vector<int64_t> shape, ParamKind kind, int layer,
                 std::string group) {
    bool decay = kind != ParamKind::Norm;
    m.params.push_back({std::move(name), std::move(shape), kind, layer, std::move(group), decay});
    return int(m.params.size()) - 1;
  };
  m.embedding = add("model.embed_tokens.weight", {d.vocab, d.hidden}, ParamKind::Embedding, -1,
                    "embedding");
  for (int l = 0; l < int(d.layers); ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    std::string g = "layers." + std::to_string(l) + ".";
    LayerParams lp;
    lp.ln1 = add(p + "input_layernorm.weight", {d.hidden}, ParamKind::Norm, l, "norms");
    lp.q = add(p + "self_attn.q_proj.weight", {d.q_width(), d.hidden}, ParamKind::AttentionProj, l,
               g + "attention");
    lp.k = add(p + "self_attn.k_proj.weight", {d.kv_width(), d.hidden}, ParamKind::AttentionProj,
               l, g + "attention");
    lp.v = add(p + "self_attn.v_proj.weight", {d.kv_width(), d.hidden}, ParamKind::AttentionProj,
               l, g + "attention");
    lp.o = add(p + "self_attn.o_proj.weight", {d.hidden, d.q_width()}, ParamKind::AttentionProj, l,
               g + "attention");
    if (d.qk_norm) {
      lp.q_norm = add(p + "self_attn.q_norm.weight", {d.head_dim}, ParamKind::Norm, l, "norms");
      lp.k_norm = add(p + "self_attn.k_norm.weight", {d.head_dim}, ParamKind::Norm, l, "norms");
    }
    lp.ln2 = add(p + "post_attention_layernorm.weight", {d.hidden}, ParamKind::Norm, l, "norms");
    if (d.is_moe(l)) {
      lp.router = add(p + "mlp.gate.weight", {d.experts, d.hidden}, ParamKind::Router, l,
                      g + "router");
      lp.experts_gate_up = add(p + "mlp.experts.gate_up_proj",
                               {d.experts_local, 2 * d.expert_ffn, d.hidden}, ParamKind::Experts, l,
                               g + "experts");
      lp.experts_down = add(p + "mlp.experts.down_proj", {d.experts_local, d.hidden, d.expert_ffn},
                            ParamKind::Experts, l, g + "experts");
      if (d.shared_ffn) {
        lp.shared_gate_up = add(p + "mlp.shared_expert.gate_up_proj", {2 * d.shared_ffn, d.hidden},
                                ParamKind::Ffn, l, g + "experts");
        lp.shared_down = add(p + "mlp.shared_expert.down_proj.weight", {d.hidden, d.shared_ffn},
                             ParamKind::Ffn, l, g + "experts");
      }
    } else {
      lp.ffn_gate_up = add(p + "mlp.gate_up_proj", {2 * d.dense_ffn, d.hidden}, ParamKind::Ffn, l,
                           g + "ffn");
      lp.ffn_down = add(p + "mlp.down_proj.weight", {d.hidden, d.dense_ffn}, ParamKind::Ffn, l,
                        g + "ffn");
    }
    m.layers.push_back(lp);
  }
  m.final_norm = add("model.norm.weight", {d.hidden}, ParamKind::Norm, -1, "norms");
  m.lm_head = d.tied ? m.embedding
                     : add("lm_head.weight", {d.vocab, d.hidden}, ParamKind::LmHead, -1, "lm_head");
  return m;
}

std::vector<HfView> ModelLayout::hf_views() const {
  std::vector<HfView> out;
  auto whole = [&](int p) { out.push_back({params[p].name, p, 0, params[p].shape}); };
  // A fused [2F, H] gate/up matrix at `offset` is gate rows then up rows.
  auto gate_up = [&](const std::string& prefix, int p, int64_t offset, int64_t ffn) {
    int64_t h = dims.hidden;
    out.push_back({prefix + "gate_proj.weight", p, offset, {ffn, h}});
    out.push_back({prefix + "up_proj.weight", p, offset + ffn * h, {ffn, h}});
  };
  for (int p = 0; p < int(params.size()); ++p) {
    const auto& def = params[p];
    std::string prefix = "model.layers." + std::to_string(def.layer) + ".mlp.";
    if (def.kind == ParamKind::Experts) {
      bool is_gate_up = def.name.ends_with("gate_up_proj");
      int64_t per_expert = def.numel() / dims.experts_local;
      for (int64_t e = 0; e < dims.experts_local; ++e) {
        std::string ep = prefix + "experts." + std::to_string(dims.expert_offset + e) + ".";
        if (is_gate_up)
          gate_up(ep, p, e * per_expert, dims.expert_ffn);
        else
          out.push_back({ep + "down_proj.weight", p, e * per_expert, {dims.hidden, dims.expert_ffn}});
      }
    } else if (def.name.ends_with("shared_expert.gate_up_proj")) {
      gate_up(prefix + "shared_expert.", p, 0, dims.shared_ffn);
    } else if (def.name.ends_with("mlp.gate_up_proj")) {
      gate_up(prefix, p, 0, dims.dense_ffn);
    } else {
      whole(p);
    }
  }
  return out;
}

int64_t ModelLayout::num_params() const {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

int64_t ModelLayout::num_active_params() const {
  int64_t n = 0;
  for (int p = 0; p < int(params.size()); ++p) {
    const auto& def = params[p];
    if (p == embedding && !dims.tied) continue;
    n += def.kind == ParamKind::Experts ? def.numel() / dims.experts_local * dims.top_k : def.numel();
  }
  return n;
}

}  // namespace mop
