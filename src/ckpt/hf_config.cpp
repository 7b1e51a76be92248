// config.json ⇄ Config for Qwen3-MoE and Mixtral (see hf_config.h). Field names and defaults are
// those of transformers' Qwen3MoeConfig and MixtralConfig (v4 and v5 spellings: rope_theta or
// rope_parameters, torch_dtype or dtype, num_experts or num_local_experts).
#include "ckpt/hf_config.h"

#include <algorithm>
#include <sstream>

#include "config/schema.h"
#include "core/error.h"

namespace mop {

namespace {

// A range bound as an integer when it is one ("4096", not "4.096e+03").
std::string bound_str(double v) {
  if (v == double(int64_t(v))) return std::to_string(int64_t(v));
  std::ostringstream os;
  os << v;
  return os.str();
}

// The range mop's config allows for `mop_key` (config/schema.h).
std::pair<double, double> mop_range(std::string_view mop_key) {
  static Config scratch;
  static const std::vector<FieldSpec> schema = config_schema(scratch);
  for (const FieldSpec& f : schema)
    if (f.path == mop_key) return {f.min, f.max};
  MOP_UNREACHABLE("no config key ", mop_key);
}

// Typed, defaulted reads of config.json fields; a JSON null counts as absent (transformers writes
// `"head_dim": null`, `"sliding_window": null`). A field that becomes a mop key is read with that
// key: its value is checked against the key's range here, named by the field as config.json spells
// it, before anything (a per-layer vector) is sized by it; the pairs read are kept to name the
// config.json fields behind an error of mop's own checks.
class Fields {
 public:
  Fields(const Json& j, const std::string& where) : j_(j), where_(where) {}

  const Json* get(std::string_view key) const {
    const Json* v = j_.find(key);
    return v && !v->is_null() ? v : nullptr;
  }
  std::string at(std::string_view key) const { return where_ + ": " + std::string(key); }
  int64_t integer(std::string_view key) const {
    const Json* v = get(key);
    MOP_USER_CHECK(v, where_, ": missing field '", key, "'");
    return v->as_int64(at(key));
  }
  int64_t integer(std::string_view key, int64_t fallback) const {
    const Json* v = get(key);
    return v ? v->as_int64(at(key)) : fallback;
  }
  double number(std::string_view key, double fallback) const {
    const Json* v = get(key);
    return v ? v->as_double(at(key)) : fallback;
  }
  bool boolean(std::string_view key, bool fallback) const {
    const Json* v = get(key);
    return v ? v->as_bool(at(key)) : fallback;
  }
  std::string string(std::string_view key, std::string fallback) const {
    const Json* v = get(key);
    return v ? v->as_string(at(key)) : fallback;
  }
  int64_t integer_as(std::string_view key, std::string_view mop_key) {
    return in_range(key, mop_key, integer(key));
  }
  int64_t integer_as(std::string_view key, std::string_view mop_key, int64_t fallback) {
    return in_range(key, mop_key, integer(key, fallback));
  }
  double number_as(std::string_view key, std::string_view mop_key, double fallback) {
    return in_range(key, mop_key, number(key, fallback));
  }
  // "model.num_kv_heads is num_key_value_heads, ..." for the mop keys `message` names.
  std::string names_in(const std::string& message) const {
    std::string out;
    for (const auto& [mop_key, key] : read_as_)
      if (message.find(mop_key) != std::string::npos)
        out += (out.empty() ? "" : ", ") + mop_key + " is " + key;
    return out;
  }

  // "<where>: key = value: why" — the one-line message for a field mop cannot represent.
  [[noreturn]] void unsupported(std::string_view key, const std::string& why) const {
    const Json* v = j_.find(key);
    throw_user_error(where_, ": ", key, " = ", v ? v->dump() : "null", ": ", why);
  }

  // `v`, config.json's `key`, checked against the range of the mop key it becomes.
  template <class T>
  T in_range(std::string_view key, std::string_view mop_key, T v) {
    const auto [lo, hi] = mop_range(mop_key);
    if (!(double(v) >= lo && double(v) <= hi))
      throw_user_error(where_, ": ", key, " = ", v, " is out of range: it becomes mop's ", mop_key,
                       ", which takes ", bound_str(lo), " to ", bound_str(hi));
    read_as_.emplace_back(std::string(mop_key), std::string(key));
    return v;
  }

 private:
  const Json& j_;
  const std::string& where_;
  std::vector<std::pair<std::string, std::string>> read_as_;  // (mop key, config.json field)
};

// RoPE: transformers 5 writes rope_parameters {rope_type, rope_theta}; 4.x rope_theta and
// rope_scaling (null for plain RoPE). Only plain ("default") RoPE is implemented.
double read_rope_theta(Fields& f, double fallback) {
  if (const Json* rs = f.get("rope_scaling")) {
    const Json* type = rs->is_object() ? rs->find("rope_type") : nullptr;
    if (!type || type->is_null()) type = rs->is_object() ? rs->find("type") : nullptr;
    if (!type || type->is_null() || !type->is_string() || type->as_string() != "default")
      f.unsupported("rope_scaling", "mop implements plain RoPE only (no scaling)");
  }
  if (const Json* rp = f.get("rope_parameters")) {
    std::string where = f.at("rope_parameters");
    MOP_USER_CHECK(rp->is_object(), where, ": expected an object, got ", rp->dump());
    const Json* type = rp->find("rope_type");
    if (!type || type->is_null()) type = rp->find("type");
    if (type && !type->is_null() && type->as_string(where + ".rope_type") != "default")
      f.unsupported("rope_parameters", "mop implements plain RoPE only (rope_type default)");
    const Json* partial = rp->find("partial_rotary_factor");
    if (partial && !partial->is_null() && partial->as_double(where) != 1.0)
      f.unsupported("rope_parameters",
                    "mop rotates every dimension of a head (partial_rotary_factor 1)");
    const Json* theta = rp->find("rope_theta");
    if (theta && !theta->is_null())
      return f.in_range("rope_parameters.rope_theta", "model.rope_theta",
                        theta->as_double(where + ".rope_theta"));
  }
  if (f.number("partial_rotary_factor", 1.0) != 1.0)
    f.unsupported("partial_rotary_factor", "mop rotates every dimension of a head");
  return f.number_as("rope_theta", "model.rope_theta", fallback);
}

// The first N layers dense and the rest MoE is what mop's model expresses
// (moe.first_dense_layers); Qwen3-MoE's mlp_only_layers and decoder_sparse_step can say more.
int64_t qwen3_first_dense_layers(const Fields& f, int64_t layers, int64_t experts) {
  // `layers` is in mop's range (Fields::integer_as) before this vector is sized by it. Entries of
  // mlp_only_layers past the last layer name no layer (transformers ignores them too).
  std::vector<bool> mlp_only(static_cast<size_t>(layers), false);
  if (const Json* m = f.get("mlp_only_layers"))
    for (const Json& v : m->as_array(f.at("mlp_only_layers"))) {
      const int64_t l = v.as_int64(f.at("mlp_only_layers"));
      if (l >= 0 && l < layers) mlp_only[size_t(l)] = true;
    }
  const int64_t step = f.integer("decoder_sparse_step", 1);
  MOP_USER_CHECK(step >= 1, f.at("decoder_sparse_step"), ": ", step, " must be ≥ 1");
  std::vector<bool> sparse(static_cast<size_t>(layers), false);
  for (int64_t l = 0; l < layers; ++l)
    sparse[size_t(l)] = !mlp_only[size_t(l)] && experts > 0 && (l + 1) % step == 0;
  int64_t first = 0;
  while (first < layers && !sparse[size_t(first)]) ++first;
  bool prefix = std::all_of(sparse.begin() + first, sparse.end(), [](bool s) { return s; });
  const char* why = "mop's dense layers can only be the first N layers (moe.first_dense_layers)";
  if (!prefix) f.unsupported(step != 1 ? "decoder_sparse_step" : "mlp_only_layers", why);
  if (first == layers)
    f.unsupported(experts > 0 ? "mlp_only_layers" : "num_experts",
                  "every layer is dense; mop trains MoE models");
  return first;
}

void refuse_common(const Fields& f) {
  if (f.get("quantization_config"))
    f.unsupported("quantization_config", "quantized checkpoints are not supported");
  if (f.string("hidden_act", "silu") != "silu")
    f.unsupported("hidden_act", "mop's experts are SwiGLU (silu)");
  if (f.boolean("attention_bias", false))
    f.unsupported("attention_bias", "mop's attention projections have no biases");
  if (f.boolean("mlp_bias", false))
    f.unsupported("mlp_bias", "mop's feed-forward layers have no biases");
  if (f.integer("shared_expert_intermediate_size", 0) > 0)
    f.unsupported("shared_expert_intermediate_size",
                  "shared experts with a sigmoid gate (Qwen2-MoE) are not supported");
  if (const Json* lt = f.get("layer_types"))
    for (const Json& t : lt->as_array(f.at("layer_types")))
      if (t.as_string(f.at("layer_types")) != "full_attention")
        f.unsupported("layer_types", "mop's attention is full causal attention in every layer");
}

}  // namespace

std::string_view hf_arch_name(HfArch arch) {
  return arch == HfArch::Qwen3Moe ? "qwen3_moe" : "mixtral";
}

std::string_view hf_arch_class(HfArch arch) {
  return arch == HfArch::Qwen3Moe ? "Qwen3MoeForCausalLM" : "MixtralForCausalLM";
}

std::optional<HfArch> parse_hf_arch(std::string_view model_type) {
  if (model_type == "qwen3_moe") return HfArch::Qwen3Moe;
  if (model_type == "mixtral") return HfArch::Mixtral;
  return std::nullopt;
}

HfImportedConfig hf_config_to_mop(const Json& hf, const std::string& where) {
  MOP_USER_CHECK(hf.is_object(), where, ": expected a JSON object");
  Fields f(hf, where);
  HfImportedConfig out;
  const std::string model_type = f.string("model_type", "");
  std::optional<HfArch> arch = parse_hf_arch(model_type);
  if (!arch)
    f.unsupported("model_type",
                  "mop imports Qwen3MoeForCausalLM (qwen3_moe) and MixtralForCausalLM (mixtral)");
  out.arch = *arch;
  if (const Json* a = f.get("architectures")) {
    const Json::Array& list = a->as_array(f.at("architectures"));
    if (!list.empty() && list[0].as_string(f.at("architectures")) != hf_arch_class(*arch))
      f.unsupported("architectures", "mop imports " + std::string(hf_arch_class(*arch)) +
                                         " for model_type " + model_type);
  }
  refuse_common(f);
  out.dtype = f.string("dtype", f.string("torch_dtype", ""));

  Config& c = out.config;
  auto& m = c.model;
  auto& e = c.moe;
  m.vocab_size = f.integer_as("vocab_size", "model.vocab_size");
  m.hidden_size = f.integer_as("hidden_size", "model.hidden_size");
  m.num_layers = f.integer_as("num_hidden_layers", "model.num_layers");
  m.num_heads = f.integer_as("num_attention_heads", "model.num_heads");
  m.num_kv_heads = f.integer_as("num_key_value_heads", "model.num_kv_heads", m.num_heads);
  m.head_dim = f.integer_as("head_dim", "model.head_dim", 0);
  m.tie_embeddings = f.boolean("tie_word_embeddings", false);
  m.init_std = std::clamp(f.number("initializer_range", 0.02), 1e-6, 1.0);
  m.max_position_embeddings = f.integer_as("max_position_embeddings", "model.max_position_embeddings", 0);
  e.top_k = f.integer_as("num_experts_per_tok", "moe.top_k");
  // transformers' load-balancing loss, E·Σ_e f_e·P_e with f_e counting all top-k choices, is
  // top_k at balance; mop's (docs/hugging-face.md: E/(T·k)·Σ_e count_e·P_e) is 1. The same gradient takes
  // top_k × the coefficient. (transformers adds it only with output_router_logits: true.)
  e.aux_loss_coef = f.number("router_aux_loss_coef", 1e-3) * double(e.top_k);
  e.z_loss_coef = 0;  // neither model has a router z-loss
  if (f.number("attention_dropout", 0) != 0)
    out.notes.push_back("attention_dropout " + hf.at("attention_dropout").dump() +
                        " is not applied: mop trains without dropout");

  if (*arch == HfArch::Qwen3Moe) {
    // transformers 5 writes num_experts as num_local_experts (Qwen3MoeConfig.attribute_map).
    e.num_experts = f.get("num_experts") ? f.integer_as("num_experts", "moe.num_experts")
                                         : f.integer_as("num_local_experts", "moe.num_experts");
    if (f.boolean("use_sliding_window", false))
      f.unsupported("use_sliding_window",
                    "mop's attention is full causal attention (no sliding window)");
    m.qk_norm = true;
    m.rms_eps = f.number_as("rms_norm_eps", "model.rms_eps", 1e-6);
    m.rope_theta = read_rope_theta(f, 10000.0);
    e.expert_ffn = f.integer_as("moe_intermediate_size", "moe.expert_ffn");
    e.renormalize = f.boolean("norm_topk_prob", false);
    e.first_dense_layers = qwen3_first_dense_layers(f, m.num_layers, e.num_experts);
    e.dense_ffn = f.integer_as("intermediate_size", "moe.dense_ffn", 0);
    MOP_USER_CHECK(e.first_dense_layers == 0 || e.dense_ffn > 0, where,
                   ": missing field 'intermediate_size' (the width of the dense layers)");
  } else {
    e.num_experts = f.integer_as("num_local_experts", "moe.num_experts");
    m.qk_norm = false;
    m.rms_eps = f.number_as("rms_norm_eps", "model.rms_eps", 1e-5);
    m.rope_theta = read_rope_theta(f, 1e6);
    e.expert_ffn = f.integer_as("intermediate_size", "moe.expert_ffn");
    // Mixtral: softmax over all experts, top-k, divide by the kept sum — the same weights as a
    // softmax over the top-k logits, i.e. renormalize: true.
    e.renormalize = true;
    if (const Json* sw = f.get("sliding_window")) {
      int64_t window = sw->as_int64(f.at("sliding_window"));
      int64_t max_pos = f.integer("max_position_embeddings", 0);
      if (max_pos == 0 || window < max_pos)
        f.unsupported("sliding_window",
                      "mop's attention is full causal attention (no sliding window)");
      out.notes.push_back("sliding_window " + std::to_string(window) +
                          " ≥ max_position_embeddings " + std::to_string(max_pos) +
                          " never applies; ignored");
    }
    if (f.number("router_jitter_noise", 0) != 0)
      out.notes.push_back("router_jitter_noise " + hf.at("router_jitter_noise").dump() +
                          " (training-time noise) is not applied by mop");
  }
  // The end-of-document id for data.eos_id (a list: the first), when it is inside the vocabulary.
  c.data.eos_id = -1;
  if (const Json* eos = f.get("eos_token_id")) {
    const Json* id = eos->is_array() ? (eos->size() ? &eos->as_array()[0] : nullptr) : eos;
    if (id && id->is_integer()) {
      int64_t v = id->as_int64(f.at("eos_token_id"));
      if (v >= 0 && v < m.vocab_size) c.data.eos_id = v;
    }
  }
  // The config must also pass mop's own checks (ranges, head_dim even, …).
  try {
    c = load_config_text(dump_config(c), {}, where);
  } catch (const UserError& err) {
    const std::string names = f.names_in(err.what());
    throw_user_error(where, ": the model does not fit mop's configuration: ", err.what(),
                     names.empty() ? "" : " (in config.json: " + names + ")");
  }
  return out;
}

HfArch default_hf_arch(const Config& cfg) {
  return cfg.model.qk_norm ? HfArch::Qwen3Moe : HfArch::Mixtral;
}

Json mop_config_to_hf(const Config& cfg, HfArch arch, std::string_view torch_dtype) {
  const auto& m = cfg.model;
  const auto& e = cfg.moe;
  const std::string cls(hf_arch_class(arch));
  MOP_USER_CHECK(e.shared_expert_ffn == 0, "moe.shared_expert_ffn: ", e.shared_expert_ffn, ": ",
                 cls, " has no shared expert");
  if (arch == HfArch::Qwen3Moe) {
    MOP_USER_CHECK(m.qk_norm, "model.qk_norm: false: ", cls,
                   " always applies q/k norm; export with --arch mixtral");
  } else {
    MOP_USER_CHECK(!m.qk_norm, "model.qk_norm: true: ", cls,
                   " has no q/k norm; export with --arch qwen3_moe");
    MOP_USER_CHECK(e.first_dense_layers == 0, "moe.first_dense_layers: ", e.first_dense_layers,
                   ": ", cls, " has no dense layers; export with --arch qwen3_moe");
    MOP_USER_CHECK(e.renormalize, "moe.renormalize: false: ", cls,
                   " always renormalises the top-k weights");
  }
  // Not part of the model's function, but transformers sizes caches by it: the imported model's
  // (so that import → export gives back its config.json), else at least 32768.
  const int64_t max_pos = m.max_position_embeddings > 0 ? m.max_position_embeddings
                                                        : std::max<int64_t>(32768, cfg.data.seq_len);
  Json rope = Json::object();
  rope["rope_theta"] = m.rope_theta;
  rope["rope_type"] = "default";
  Json j = Json::object();
  // Keys in sorted order, as transformers writes them. Both spellings of the RoPE base and the
  // dtype (transformers 4.x reads rope_theta and torch_dtype, 5.x rope_parameters and dtype).
  j["architectures"] = Json(Json::Array{Json(cls)});
  if (arch == HfArch::Qwen3Moe) j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["bos_token_id"] = nullptr;
  if (arch == HfArch::Qwen3Moe) j["decoder_sparse_step"] = 1;
  j["dtype"] = torch_dtype;
  j["eos_token_id"] = cfg.data.eos_id >= 0 ? Json(cfg.data.eos_id) : Json(nullptr);
  j["head_dim"] = cfg.head_dim();
  j["hidden_act"] = "silu";
  j["hidden_size"] = m.hidden_size;
  j["initializer_range"] = m.init_std;
  j["intermediate_size"] = arch == HfArch::Qwen3Moe ? cfg.dense_ffn() : e.expert_ffn;
  j["max_position_embeddings"] = max_pos;
  if (arch == HfArch::Qwen3Moe) {
    Json dense = Json::array();
    for (int64_t l = 0; l < e.first_dense_layers; ++l) dense.push_back(l);
    j["mlp_only_layers"] = std::move(dense);
  }
  j["model_type"] = hf_arch_name(arch);
  if (arch == HfArch::Qwen3Moe) {
    j["moe_intermediate_size"] = e.expert_ffn;
    j["norm_topk_prob"] = e.renormalize;
  }
  j["num_attention_heads"] = m.num_heads;
  if (arch == HfArch::Qwen3Moe) j["num_experts"] = e.num_experts;
  j["num_experts_per_tok"] = e.top_k;
  j["num_hidden_layers"] = m.num_layers;
  j["num_key_value_heads"] = m.num_kv_heads;
  if (arch == HfArch::Mixtral) j["num_local_experts"] = e.num_experts;
  j["output_router_logits"] = false;
  j["pad_token_id"] = nullptr;
  j["rms_norm_eps"] = m.rms_eps;
  j["rope_parameters"] = std::move(rope);
  j["rope_theta"] = m.rope_theta;
  j["router_aux_loss_coef"] = e.aux_loss_coef / double(e.top_k);  // see hf_config_to_mop
  if (arch == HfArch::Mixtral) j["router_jitter_noise"] = 0.0;
  j["sliding_window"] = nullptr;
  j["tie_word_embeddings"] = m.tie_embeddings;
  j["torch_dtype"] = torch_dtype;
  j["use_cache"] = true;
  if (arch == HfArch::Qwen3Moe) j["use_sliding_window"] = false;
  j["vocab_size"] = m.vocab_size;
  return j;
}

std::string hf_config_yaml_fragment(const Config& cfg, const std::string& header_comment) {
  // The model and moe sections of the resolved dump, so every key (defaults included) is there.
  std::istringstream in(dump_config(cfg));
  std::ostringstream out;
  out << "# " << header_comment << "\n"
      << "# moe.aux_loss_coef = config.json router_aux_loss_coef × top_k (transformers' balancing "
         "loss is top_k at balance, mop's 1)\n";
  bool keep = false;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] != ' ' && line[0] != '#')
      keep = line == "model:" || line == "moe:";
    if (keep) out << line << "\n";
  }
  out << "data:\n  eos_id: " << cfg.data.eos_id
      << "  # config.json eos_token_id (-1: none in the vocabulary)\n";
  return out.str();
}

}  // namespace mop
