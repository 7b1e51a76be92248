// The config schema: one entry per YAML key, bound to a field of a Config instance, with its type,
// valid range or choices and documentation. Parsing, dumping and the reference in docs/configuration.md all walk it.
#pragma once

#include <string>
#include <vector>

#include "config/config.h"

namespace mop {

struct FieldSpec {
  enum class Kind { Int, Float, Bool, String, StringList, GrowthStages };
  std::string path;  // "moe.top_k"
  Kind kind = Kind::Int;
  // int64_t*, double*, bool*, std::string*, std::vector<std::string>*, std::vector<GrowthStage>*
  void* ptr = nullptr;
  std::string doc;
  double min = 0, max = 0;           // Int/Float: inclusive range
  std::vector<std::string> choices;  // String: allowed values (empty: any)
  bool open_choices = false;         // String: choices listed, other values are paths
};

std::vector<FieldSpec> config_schema(Config& cfg);

const char* kind_name(FieldSpec::Kind kind);

}  // namespace mop
