// Loading, overriding, validating and dumping the configuration. Every error is one UserError
// line that names the file position (when known), the YAML path and the offending value.
#include "config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "config/schema.h"
#include "core/error.h"
#include "core/small_file.h"

namespace mop {
namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string last_segment(const std::string& path) {
  auto dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

// A lower bound of the edit distance.
size_t length_gap(const std::string& a, const std::string& b) {
  return a.size() > b.size() ? a.size() - b.size() : b.size() - a.size();
}

}  // namespace

std::string did_you_mean(const std::string& path, const std::vector<std::string>& known) {
  const std::string segment = last_segment(path);
  const size_t limit = std::max<size_t>(2, segment.size() / 3);
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  // A distance is computed only when the lengths allow one within `limit`: the rest cannot be
  // suggested, and a megabyte-long key would cost its length × every known key's to compare.
  for (const auto& k : known) {
    size_t d = std::numeric_limits<size_t>::max();
    if (length_gap(path, k) <= limit) d = edit_distance(path, k);
    const std::string k_segment = last_segment(k);
    if (length_gap(segment, k_segment) + 1 <= limit)
      d = std::min(d, edit_distance(segment, k_segment) + 1);
    if (d < best_d) best_d = d, best = k;
  }
  return best_d <= limit ? " (did you mean " + best + "?)" : "";
}

namespace {

// The nearest choice to a value, where the names other tools use come first: PyTorch's "gpu" is
// cuda here, and a state placement of "cuda" is gpu (spelling alone would suggest cpu for both).
std::string value_did_you_mean(const std::string& value, const std::vector<std::string>& choices) {
  static const std::pair<const char*, const char*> kSynonyms[] = {
      {"gpu", "cuda"}, {"nvidia", "cuda"}, {"device", "cuda"}, {"cuda", "gpu"}, {"device", "gpu"}, {"cpu", "host"}};
  std::string lower = value;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  for (const auto& [from, to] : kSynonyms)
    if (lower == from && std::find(choices.begin(), choices.end(), to) != choices.end())
      return std::string(" (did you mean ") + to + "?)";
  return did_you_mean(value, choices);
}

std::string shortest_double(double v) {
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {  // 600.0, not 6e+02
    std::snprintf(buf, sizeof buf, "%.1f", v);
    return buf;
  }
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  // Keep it a float in YAML's eyes ("1" → "1.0"), so the dump reads back with the same type.
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

std::string growth_text(const std::vector<GrowthStage>& stages) {
  std::string out = "[";
  for (const GrowthStage& st : stages) {
    out += (out.size() > 1 ? ", {experts: " : "{experts: ") + std::to_string(st.experts);
    if (st.tokens > 0) out += ", tokens: " + shortest_double(st.tokens);
    if (st.steps > 0) out += ", steps: " + std::to_string(st.steps);
    out += "}";
  }
  return out + "]";
}

namespace {

class Loader {
 public:
  Loader(Config& cfg, std::string origin)
      : cfg_(cfg), origin_(std::move(origin)), fields_(config_schema(cfg)) {
    for (auto& f : fields_) {
      known_.push_back(f.path);
      for (size_t dot = f.path.find('.'); dot != std::string::npos; dot = f.path.find('.', dot + 1))
        prefixes_.insert(f.path.substr(0, dot));
    }
  }

  void load_tree(const YAML::Node& root) {
    if (!root || root.IsNull()) return;
    if (!root.IsMap()) fail(root, "", "the top level must be a mapping of sections (model:, moe:, ...)");
    walk(root, "");
  }

  void apply_override(const std::string& assignment) {
    auto eq = assignment.find('=');
    if (eq == std::string::npos || eq == 0)
      throw_user_error("--set ", assignment, ": expected section.key=value");
    std::string path = assignment.substr(0, eq), value = assignment.substr(eq + 1);
    FieldSpec* f = find(path);
    if (!f) throw_user_error("--set ", path, ": unknown key", did_you_mean(path, known_));
    YAML::Node node;
    try {
      node = YAML::Load(value);
    } catch (const YAML::Exception&) {
      node = YAML::Node(value);  // a plain string that is not valid YAML on its own
    }
    if (!node || node.IsNull()) node = YAML::Node(std::string());
    set_field(*f, node, "--set " + path);
  }

 private:
  FieldSpec* find(const std::string& path) {
    for (auto& f : fields_)
      if (f.path == path) return &f;
    return nullptr;
  }

  [[noreturn]] void fail(const YAML::Node& node, const std::string& path, const std::string& msg) {
    std::string where = origin_;
    if (node.Mark().line >= 0) where += ":" + std::to_string(node.Mark().line + 1);
    throw_user_error(where, ": ", path.empty() ? "" : path + ": ", msg);
  }

  void walk(const YAML::Node& map, const std::string& prefix) {
    std::map<std::string, int> seen;  // key → its line: a repeated key is refused, not overwritten
    for (const auto& kv : map) {
      std::string key = kv.first.Scalar();
      std::string path = prefix.empty() ? key : prefix + "." + key;
      const int line = kv.first.Mark().line + 1;
      if (auto [it, fresh] = seen.emplace(key, line); !fresh)
        fail(kv.first, "", "duplicate key " + path + " (first given on line " + std::to_string(it->second) +
                               "); give each key once");
      if (FieldSpec* f = find(path)) {
        set_field(*f, kv.second, located(kv.second, path));
      } else if (prefixes_.count(path)) {
        if (kv.second.IsNull()) continue;  // an empty section keeps its defaults
        if (!kv.second.IsMap()) fail(kv.second, path, "expected a mapping of keys");
        walk(kv.second, path);
      } else {
        std::vector<std::string> candidates = known_;
        candidates.insert(candidates.end(), prefixes_.begin(), prefixes_.end());
        fail(kv.first, "", "unknown key " + path + did_you_mean(path, candidates));
      }
    }
  }

  std::string located(const YAML::Node& node, const std::string& path) {
    std::string where = origin_;
    if (node.Mark().line >= 0) where += ":" + std::to_string(node.Mark().line + 1);
    return where + ": " + path;
  }

  static bool parse_int(const std::string& s, int64_t& out) {
    auto r = std::from_chars(s.data(), s.data() + s.size(), out);
    return r.ec == std::errc() && r.ptr == s.data() + s.size();
  }
  static bool parse_float(const std::string& s, double& out) {
    if (s.empty()) return false;
    errno = 0;
    char* end = nullptr;
    out = std::strtod(s.c_str(), &end);
    return end == s.c_str() + s.size() && std::isfinite(out) &&
           s.find_first_of("xXpP") == std::string::npos;
  }

  void set_field(FieldSpec& f, const YAML::Node& node, const std::string& where) {
    cfg_.pinned.insert(f.path);
    auto bad = [&](const std::string& msg) { throw_user_error(where, ": ", msg); };
    auto scalar = [&]() -> std::string {
      if (!node.IsScalar()) bad(std::string("expected a single ") + kind_name(f.kind) + " value");
      return node.Scalar();
    };
    switch (f.kind) {
      case FieldSpec::Kind::Int: {
        std::string s = scalar();
        int64_t v;
        double d;
        if (!parse_int(s, v)) {
          // Accept integral floats such as 1e6, reject 2.5 and out-of-range values.
          if (!parse_float(s, d)) bad("expected an integer, got '" + s + "'");
          if (d != std::floor(d)) bad("expected an integer, got " + s);
          if (d < f.min || d > f.max) bad(s + " is out of range (" + range(f) + ")");
          v = int64_t(d);
        }
        if (double(v) < f.min || double(v) > f.max) bad(s + " is out of range (" + range(f) + ")");
        *static_cast<int64_t*>(f.ptr) = v;
        break;
      }
      case FieldSpec::Kind::Float: {
        std::string s = scalar();
        double v;
        if (!parse_float(s, v)) bad("expected a number, got '" + s + "'");
        if (v < f.min || v > f.max) bad(s + " is out of range (" + range(f) + ")");
        *static_cast<double*>(f.ptr) = v;
        break;
      }
      case FieldSpec::Kind::Bool: {
        std::string s = scalar();
        std::string l = s;
        std::transform(l.begin(), l.end(), l.begin(), ::tolower);
        if (l == "true" || l == "yes" || l == "on") *static_cast<bool*>(f.ptr) = true;
        else if (l == "false" || l == "no" || l == "off") *static_cast<bool*>(f.ptr) = false;
        else bad("expected true or false, got '" + s + "'");
        break;
      }
      case FieldSpec::Kind::String: {
        std::string s = node.IsNull() ? std::string() : scalar();
        if (!f.choices.empty() && !f.open_choices &&
            std::find(f.choices.begin(), f.choices.end(), s) == f.choices.end())
          bad("'" + s + "' is not one of " + join(f.choices) + value_did_you_mean(s, f.choices));
        *static_cast<std::string*>(f.ptr) = s;
        break;
      }
      case FieldSpec::Kind::StringList: {
        auto& out = *static_cast<std::vector<std::string>*>(f.ptr);
        out.clear();
        if (node.IsNull()) break;
        if (node.IsScalar()) {
          out.push_back(node.Scalar());
        } else if (node.IsSequence()) {
          for (const auto& item : node) {
            if (!item.IsScalar()) bad("expected a list of strings");
            out.push_back(item.Scalar());
          }
        } else {
          bad("expected a string or a list of strings");
        }
        break;
      }
      case FieldSpec::Kind::GrowthStages: {
        auto& out = *static_cast<std::vector<GrowthStage>*>(f.ptr);
        out.clear();
        if (node.IsNull() || (node.IsScalar() && node.Scalar().empty())) break;
        if (!node.IsSequence()) bad("expected a list of stages, e.g. [{experts: 8, tokens: 2e9}, {experts: 16}]");
        for (size_t i = 0; i < node.size(); ++i) {
          const YAML::Node& item = node[i];
          const std::string at = "stage " + std::to_string(i + 1) + ": ";
          if (!item.IsMap()) bad(at + "expected a mapping {experts: N, tokens: T} or {experts: N, steps: S}");
          GrowthStage st;
          bool has_experts = false;
          for (const auto& kv : item) {
            const std::string key = kv.first.Scalar();
            const std::string v = kv.second.IsScalar() ? kv.second.Scalar() : std::string();
            double d = 0;
            if (key != "experts" && key != "tokens" && key != "steps")
              bad(at + "unknown key '" + key + "' (a stage has experts and one of tokens, steps)");
            if (!parse_float(v, d)) bad(at + key + ": expected a number, got '" + v + "'");
            if (key == "tokens") {
              if (d <= 0) bad(at + "tokens: " + v + " must be positive");
              st.tokens = d;
              continue;
            }
            if (d != std::floor(d) || d < 1 || d > 1e12) bad(at + key + ": expected a positive integer, got " + v);
            (key == "experts" ? st.experts : st.steps) = int64_t(d);
            has_experts = has_experts || key == "experts";
          }
          if (!has_experts) bad(at + "no experts");
          if (st.tokens > 0 && st.steps > 0) bad(at + "give tokens or steps, not both");
          out.push_back(st);
        }
        break;
      }
    }
  }

  static std::string range(const FieldSpec& f) {
    auto num = [&](double v) {
      return f.kind == FieldSpec::Kind::Int ? std::to_string(int64_t(v)) : shortest_double(v);
    };
    return num(f.min) + " to " + num(f.max);
  }

  static std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? (i + 1 == v.size() ? " or " : ", ") : "") + v[i];
    return s;
  }

  Config& cfg_;
  std::string origin_;
  std::vector<FieldSpec> fields_;
  std::vector<std::string> known_;
  std::set<std::string> prefixes_;
};

// Products of sizes in int64 with an overflow check (sizes are user input).
int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw_user_error(what, " overflows a 64-bit integer");
  return r;
}

// moe.growth / moe.growth_from, as far as one config shows them: a stage's config (a checkpoint's)
// has the stage's expert count as moe.num_experts, so that it need only be one of the stages'.
void validate_growth(const Config& c) {
  const auto& e = c.moe;
  if (e.growth_from > 0) {
    MOP_USER_CHECK(e.growth.empty(), "moe.growth_from and moe.growth: give one of them");
    // A stage's config (a checkpoint's) may hold growth_from experts itself.
    MOP_USER_CHECK(e.num_experts % e.growth_from == 0 &&
                       std::has_single_bit(uint64_t(e.num_experts / e.growth_from)),
                   "moe.growth_from: ", e.growth_from, " experts do not double up to moe.num_experts (",
                   e.num_experts, ")");
    MOP_USER_CHECK(e.top_k <= e.growth_from, "moe.top_k: ", e.top_k, " exceeds the first stage's ",
                   e.growth_from, " experts (moe.growth_from)");
    return;
  }
  if (e.growth.empty()) return;
  const int64_t tokens_per_step = checked_mul(c.train.global_batch_size, c.data.seq_len,
                                              "train.global_batch_size × data.seq_len");
  double tokens = 0;
  int64_t steps = 0;
  bool found = false;
  for (size_t i = 0; i < e.growth.size(); ++i) {
    const GrowthStage& st = e.growth[i];
    const std::string at = "moe.growth: stage " + std::to_string(i + 1) + " (" + std::to_string(st.experts) + " experts)";
    if (i > 0) {
      const int64_t before = e.growth[i - 1].experts;
      MOP_USER_CHECK(st.experts > before && st.experts % before == 0, at, " is not a multiple of stage ", i,
                     "'s ", before, " experts (each expert grows into a whole number of copies)");
    }
    MOP_USER_CHECK(st.tokens > 0 || st.steps > 0 || i + 1 == e.growth.size(), at,
                   ": no budget (tokens or steps); only the last stage may leave it out");
    found = found || st.experts == e.num_experts;
    tokens += st.tokens > 0 ? st.tokens : double(st.steps) * double(tokens_per_step);
    // Held below int64's range (llround of 1e300 is LLONG_MIN, which passed the check below):
    // a stage ending past train.steps needs only to be seen to.
    steps = int64_t(std::llround(std::min(tokens / double(tokens_per_step), 1e18)));
    if (i + 1 < e.growth.size())
      MOP_USER_CHECK(steps < c.train.steps, at, " ends at step ", steps, " (", tokens, " tokens at ",
                     tokens_per_step, " per step), not before train.steps (", c.train.steps, ")");
  }
  MOP_USER_CHECK(e.top_k <= e.growth.front().experts, "moe.top_k: ", e.top_k, " exceeds the first stage's ",
                 e.growth.front().experts, " experts (moe.growth)");
  MOP_USER_CHECK(found, "moe.growth: no stage has moe.num_experts (", e.num_experts, ") experts; the last "
                 "stage's count is the model's");
  const GrowthStage& last = e.growth.back();
  if (last.tokens > 0 || last.steps > 0)
    MOP_USER_CHECK(steps == c.train.steps, "moe.growth: the stages add up to ", steps, " steps (", tokens,
                   " tokens at ", tokens_per_step, " per step), train.steps is ", c.train.steps,
                   "; make them agree, or leave out the last stage's budget (it takes the rest)");
}

void validate(const Config& c) {
  const auto& m = c.model;
  const auto& e = c.moe;
  MOP_USER_CHECK(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads: ", m.num_kv_heads,
                 " does not divide model.num_heads (", m.num_heads, ")");
  if (m.head_dim == 0)
    MOP_USER_CHECK(m.hidden_size % m.num_heads == 0, "model.hidden_size: ", m.hidden_size,
                   " is not divisible by model.num_heads (", m.num_heads,
                   "); set model.head_dim explicitly");
  const auto& a = c.parallel.attention;
  MOP_USER_CHECK(a.impl != "ulysses" || a.cp == 1 || (m.num_heads % a.cp == 0 && m.num_kv_heads % a.cp == 0),
                 "parallel.attention.impl: ulysses needs model.num_heads (", m.num_heads,
                 ") and model.num_kv_heads (", m.num_kv_heads, ") to divide by parallel.attention.cp (",
                 a.cp, "); use ring or auto");
  MOP_USER_CHECK(c.head_dim() % 2 == 0, "model.head_dim: ", c.head_dim(),
                 " must be even (RoPE rotates pairs of dimensions)");
  MOP_USER_CHECK(e.top_k <= e.num_experts, "moe.top_k: ", e.top_k, " exceeds moe.num_experts (",
                 e.num_experts, ")");
  MOP_USER_CHECK(e.first_dense_layers <= m.num_layers, "moe.first_dense_layers: ",
                 e.first_dense_layers, " exceeds model.num_layers (", m.num_layers, ")");
  MOP_USER_CHECK(c.log.router_histogram.empty() || e.first_dense_layers < m.num_layers,
                 "log.router_histogram: the model has no MoE layers (moe.first_dense_layers = "
                 "model.num_layers = ", m.num_layers, ")");
  for (auto [key, n] : {std::pair<const char*, int64_t>{"train.offload_layers", c.train.offload_layers},
                        {"train.keep_attention", c.train.keep_attention}})
    MOP_USER_CHECK(n <= m.num_layers, key, ": ", n, " exceeds model.num_layers (", m.num_layers, ")");
  MOP_USER_CHECK(c.train.recompute || (c.train.offload_layers <= 0 && c.train.keep_attention <= 0),
                 "train.offload_layers and train.keep_attention keep tensors for a recomputing backward: "
                 "set train.recompute: true, or leave them at -1 (or 0)");
  MOP_USER_CHECK(c.train.keep_attention <= 0 || a.cp == 1 || a.impl == "ring" ||
                     m.num_heads % a.cp != 0 || m.num_kv_heads % a.cp != 0,
                 "train.keep_attention: Ulysses attention (parallel.attention.cp ", a.cp,
                 ") recomputes its attention; set parallel.attention.impl: ring, or train.keep_attention: 0");
  if (c.train.attention_tile > 0) {
    MOP_USER_CHECK(c.data.seq_len % c.train.attention_tile == 0, "train.attention_tile: ",
                   c.train.attention_tile, " tokens do not divide data.seq_len (", c.data.seq_len,
                   "); use a divisor, 0 (whole sequences) or -1 (the plan's choice)");
    MOP_USER_CHECK(a.cp == 1 || a.impl != "ring", "train.attention_tile: ring attention "
                   "(parallel.attention.impl: ring) runs its own blocks; leave the tile at -1 or 0");
  }
  if (c.train.keep_attention_tail > 0) {
    MOP_USER_CHECK(c.train.recompute && a.cp == 1 && c.train.micro_batch_size == 1 &&
                       c.train.attention_tile != 0,
                   "train.keep_attention_tail: kept tails are the last query tiles of one sequence: "
                   "they need train.recompute: true, parallel.attention.cp 1, train.micro_batch_size 1 "
                   "and attention in query tiles (train.attention_tile not 0)");
    MOP_USER_CHECK(c.train.attention_tile < 0 ||
                       c.train.keep_attention_tail < c.data.seq_len / c.train.attention_tile,
                   "train.keep_attention_tail: ", c.train.keep_attention_tail, " tiles of ",
                   c.train.attention_tile, " tokens leave none of data.seq_len (", c.data.seq_len,
                   ") to recompute; keep the whole output with train.keep_attention instead");
  }
  validate_growth(c);
  MOP_USER_CHECK(c.optim.min_lr <= c.optim.lr, "optim.min_lr: ", c.optim.min_lr,
                 " exceeds optim.lr (", c.optim.lr, ")");
  MOP_USER_CHECK(c.data.eos_id < m.vocab_size, "data.eos_id: ", c.data.eos_id,
                 " is outside the vocabulary (model.vocab_size ", m.vocab_size, ")");
  // train.plan: auto chooses the micro-batch size when the config does not.
  MOP_USER_CHECK(c.train.micro_batch_size <= c.train.global_batch_size ||
                     (c.train.plan == "auto" && !c.is_pinned("train.micro_batch_size")),
                 "train.micro_batch_size: ", c.train.micro_batch_size,
                 " exceeds train.global_batch_size (", c.train.global_batch_size, ")");
  // Tensor sizes must fit comfortably in int64 (and token positions in int32).
  int64_t tokens = checked_mul(c.train.micro_batch_size, c.data.seq_len,
                               "train.micro_batch_size × data.seq_len");
  MOP_USER_CHECK(tokens <= (int64_t(1) << 31) - 1, "train.micro_batch_size × data.seq_len = ",
                 tokens, " tokens per micro-batch exceeds 2^31 − 1");
  checked_mul(checked_mul(tokens, e.top_k, "tokens × moe.top_k"), std::max(m.hidden_size, e.expert_ffn * 2),
              "routed activations (tokens × top_k × width)");
  int64_t per_layer = checked_mul(checked_mul(e.num_experts, e.expert_ffn, "moe.num_experts × moe.expert_ffn"),
                                  checked_mul(3, m.hidden_size, "3 × hidden_size"), "expert parameters per layer");
  checked_mul(per_layer, m.num_layers, "expert parameters");
  checked_mul(m.vocab_size, m.hidden_size, "model.vocab_size × model.hidden_size");
}

}  // namespace

Config load_config_text(const std::string& text, const std::vector<std::string>& overrides,
                        const std::string& origin) {
  Config cfg;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& ex) {
    throw_user_error(origin, ":", ex.mark.line + 1, ": malformed YAML: ", ex.msg);
  }
  Loader loader(cfg, origin);
  loader.load_tree(root);
  for (const auto& o : overrides) loader.apply_override(o);
  validate(cfg);
  return cfg;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  MOP_USER_CHECK(!std::filesystem::is_directory(path, ec), "config file ", path,
                 " is a directory; give the YAML file itself (a checkpoint directory holds "
                 "config.resolved.yaml)");
  return load_config_text(read_small_file(path, "config file", kConfigFileCap), overrides, path);
}

void validate_parallel(const Config& c, int world_size) {
  const auto& a = c.parallel.attention;
  const auto& m = c.parallel.moe;
  const int64_t pp = c.parallel.pp;
  MOP_USER_CHECK(world_size % pp == 0, "parallel.pp: ", pp, " pipeline stages do not divide the ",
                 world_size, " ranks");
  const int64_t stage = world_size / pp;
  const std::string ranks = pp == 1 ? "the number of ranks (" + std::to_string(world_size) + ")"
                                    : "the ranks of a pipeline stage (" + std::to_string(world_size) +
                                          " / parallel.pp " + std::to_string(pp) + " = " +
                                          std::to_string(stage) + ")";
  const std::string fix = "; give foldings that multiply to " + std::to_string(stage) +
                          ", or set train.plan: auto to have the plan choose those the config does not give";
  MOP_USER_CHECK(a.cp * a.dp == stage, "parallel.attention: cp (", a.cp, ") × dp (", a.dp,
                 ") = ", a.cp * a.dp, " must equal ", ranks, fix);
  MOP_USER_CHECK(m.ep * m.dp == stage, "parallel.moe: ep (", m.ep, ") × dp (", m.dp, ") = ",
                 m.ep * m.dp, " must equal ", ranks, fix);
  if (pp > 1) {
    const int64_t segments = c.model.num_layers + 2;  // embedding, layers, final norm + LM head
    const int64_t v = c.parallel.pipeline.virtual_stages;
    MOP_USER_CHECK(c.parallel.pipeline.schedule == "interleaved" || v == 1,
                   "parallel.pipeline.virtual_stages: ", v, " needs parallel.pipeline.schedule: interleaved");
    MOP_USER_CHECK(pp * v <= segments, "parallel.pp: ", pp, " stages × ", v, " virtual stages need at least ",
                   pp * v, " segments, but the model has ", segments, " (embedding, ", c.model.num_layers,
                   " layers, final norm and LM head)");
    MOP_USER_CHECK(!c.model.tie_embeddings, "parallel.pp: ", pp, " with model.tie_embeddings: the first and the last "
                   "stage would share the embedding, which is not supported; untie the embeddings or set parallel.pp: 1");
    MOP_USER_CHECK(c.moe.growth.empty() && c.moe.growth_from == 0,
                   "parallel.pp: ", pp, " with expert growth (moe.growth) is not supported; set parallel.pp: 1");
  }
  MOP_USER_CHECK(c.moe.num_experts % m.ep == 0, "parallel.moe.ep: ", m.ep,
                 " does not divide moe.num_experts (", c.moe.num_experts, ")");
  for (const GrowthStage& st : c.moe.growth)
    MOP_USER_CHECK(st.experts % m.ep == 0, "parallel.moe.ep: ", m.ep, " does not divide the ", st.experts,
                   " experts of a moe.growth stage (every stage's experts are sharded over the ep ranks)");
  MOP_USER_CHECK(c.moe.growth_from % m.ep == 0, "parallel.moe.ep: ", m.ep, " does not divide moe.growth_from (",
                 c.moe.growth_from, ")");
  int64_t per_step = c.train.micro_batch_size * a.dp;
  MOP_USER_CHECK(c.train.global_batch_size % per_step == 0, "train.global_batch_size: ",
                 c.train.global_batch_size, " is not a multiple of train.micro_batch_size (",
                 c.train.micro_batch_size, ") × parallel.attention.dp (", a.dp, ")");
  if (pp > 1 && c.parallel.pipeline.schedule == "interleaved") {
    const int64_t micro_batches = c.train.global_batch_size / per_step;
    MOP_USER_CHECK(micro_batches % pp == 0, "parallel.pipeline.schedule: interleaved needs the micro-batches per "
                   "rank (", micro_batches, " = train.global_batch_size / (micro_batch_size × attention.dp)) to be "
                   "a multiple of parallel.pp (", pp, "); use 1f1b or change the batch");
  }
  MOP_USER_CHECK(c.data.seq_len % a.cp == 0, "data.seq_len: ", c.data.seq_len,
                 " is not divisible by parallel.attention.cp (", a.cp, ")");
}

std::string dump_config(const Config& cfg) {
  Config copy = cfg;
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::vector<std::string> open;  // currently open nested map keys
  for (const auto& f : config_schema(copy)) {
    std::vector<std::string> parts;
    std::stringstream ss(f.path);
    for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
    std::vector<std::string> parents(parts.begin(), parts.end() - 1);
    size_t common = 0;
    while (common < open.size() && common < parents.size() && open[common] == parents[common]) ++common;
    while (open.size() > common) out << YAML::EndMap, open.pop_back();
    while (open.size() < parents.size()) {
      out << YAML::Key << parents[open.size()] << YAML::Value << YAML::BeginMap;
      open.push_back(parents[open.size()]);
    }
    out << YAML::Key << parts.back() << YAML::Value;
    switch (f.kind) {
      case FieldSpec::Kind::Int: out << *static_cast<int64_t*>(f.ptr); break;
      case FieldSpec::Kind::Float: out << shortest_double(*static_cast<double*>(f.ptr)); break;
      case FieldSpec::Kind::Bool: out << *static_cast<bool*>(f.ptr); break;
      case FieldSpec::Kind::String: out << YAML::DoubleQuoted << *static_cast<std::string*>(f.ptr); break;
      case FieldSpec::Kind::StringList: {
        out << YAML::Flow << YAML::BeginSeq;
        for (const auto& s : *static_cast<std::vector<std::string>*>(f.ptr)) out << YAML::DoubleQuoted << s;
        out << YAML::EndSeq;
        break;
      }
      case FieldSpec::Kind::GrowthStages: {
        out << YAML::Flow << YAML::BeginSeq;
        for (const GrowthStage& st : *static_cast<std::vector<GrowthStage>*>(f.ptr)) {
          out << YAML::Flow << YAML::BeginMap << YAML::Key << "experts" << YAML::Value << st.experts;
          if (st.tokens > 0) out << YAML::Key << "tokens" << YAML::Value << shortest_double(st.tokens);
          if (st.steps > 0) out << YAML::Key << "steps" << YAML::Value << st.steps;
          out << YAML::EndMap;
        }
        out << YAML::EndSeq;
        break;
      }
    }
  }
  while (!open.empty()) out << YAML::EndMap, open.pop_back();
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string config_reference_markdown() {
  Config defaults;
  std::ostringstream os;
  os << "| key | type | default | meaning |\n|---|---|---|---|\n";
  for (const auto& f : config_schema(defaults)) {
    std::string def;
    switch (f.kind) {
      case FieldSpec::Kind::Int: def = std::to_string(*static_cast<int64_t*>(f.ptr)); break;
      case FieldSpec::Kind::Float: def = shortest_double(*static_cast<double*>(f.ptr)); break;
      case FieldSpec::Kind::Bool: def = *static_cast<bool*>(f.ptr) ? "true" : "false"; break;
      case FieldSpec::Kind::String: def = "\"" + *static_cast<std::string*>(f.ptr) + "\""; break;
      case FieldSpec::Kind::StringList: def = "[]"; break;
      case FieldSpec::Kind::GrowthStages: def = "[]"; break;
    }
    std::string type = kind_name(f.kind);
    if (!f.choices.empty()) {
      type.clear();
      for (size_t i = 0; i < f.choices.size(); ++i) type += (i ? " \\| " : "") + f.choices[i];
      if (f.open_choices) type += " \\| path";
    }
    os << "| `" << f.path << "` | " << type << " | `" << def << "` | " << f.doc << " |\n";
  }
  return os.str();
}

}  // namespace mop
