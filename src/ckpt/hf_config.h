// Hugging Face model configs (config.json) ⇄ mop's Config, for the two architectures mop's model
// represents exactly: Qwen3MoeForCausalLM (q/k norm, optional dense first layers) and
// MixtralForCausalLM (no q/k norm, renormalised top-k). Anything else — another architecture, a
// feature in use that the model lacks (biases, sliding window, RoPE scaling, ...) — is a UserError
// naming the config.json field and its value.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/json.h"
#include "config/config.h"

namespace mop {

enum class HfArch : uint8_t { Qwen3Moe, Mixtral };

// "qwen3_moe" / "mixtral" (the model_type), and the class name "Qwen3MoeForCausalLM" / ...
std::string_view hf_arch_name(HfArch arch);
std::string_view hf_arch_class(HfArch arch);
std::optional<HfArch> parse_hf_arch(std::string_view model_type);

struct HfImportedConfig {
  HfArch arch = HfArch::Qwen3Moe;
  Config config;      // model/moe from config.json, data.eos_id, defaults elsewhere
  std::string dtype;  // config.json's dtype / torch_dtype ("bfloat16", ...); may be empty
  std::vector<std::string> notes;  // fields read but without effect on the model (dropout, ...)
};

// Maps a parsed config.json; `where` names it in errors ("hf/config.json").
HfImportedConfig hf_config_to_mop(const Json& hf, const std::string& where);

// The architecture a config is exported as by default: Qwen3-MoE when it has q/k norm, else
// Mixtral.
HfArch default_hf_arch(const Config& cfg);

// config.json for `cfg` as `arch`; torch_dtype is "bfloat16" or "float32". UserError when the
// model cannot be expressed in that architecture (naming the mop key).
Json mop_config_to_hf(const Config& cfg, HfArch arch, std::string_view torch_dtype);

// The model/moe sections of a config (and data.eos_id) as YAML, to paste into a training config.
std::string hf_config_yaml_fragment(const Config& cfg, const std::string& header_comment);

}  // namespace mop
