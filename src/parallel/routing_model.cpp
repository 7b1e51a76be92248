// RoutingModel (see routing_model.h): shares per layer and expert from a spec or a router
// histogram file, and the integer rows they give one source rank (water-filling under the
// one-row-per-token cap, then largest-remainder rounding).
#include "parallel/routing_model.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "ckpt/file_io.h"
#include "ckpt/json.h"
#include "core/error.h"
#include "core/small_file.h"

namespace mop {
namespace {

constexpr const char* kHistogramFormat = "mop-router-histogram";
constexpr int64_t kHistogramVersion = 1;
// A histogram of 1024 experts × 128 MoE layers with 12-digit counts is about 2 MB of text. The
// JSON reader holds a yaml-cpp tree and a Json tree of it at once, each larger than the text, so
// the cap stays well below kConfigFileCap.
constexpr uint64_t kHistogramFileCap = 16 * kMiB;
// The trainer sums counts as doubles (Comm::all_reduce_host): exact up to 2^53 rows per layer.
constexpr int64_t kMaxHistogramRows = int64_t(1) << 53;
constexpr int64_t kMaxExperts = int64_t(1) << 20;
constexpr size_t kMaxMoeLayers = 4096;  // model.num_layers' range

// Experts [r·E/ep, (r+1)·E/ep) of rank r: their rows from one source, summed over the layers.
std::vector<int64_t> rank_rows(const RoutingModel& m, int ep, int64_t tokens) {
  const int64_t E = m.experts();
  MOP_CHECK(ep >= 1 && E % ep == 0, "ep ", ep, " must divide the ", E, " experts");
  MOP_CHECK(tokens > 0, "tokens ", tokens);
  std::vector<int64_t> rows(size_t(ep), 0);
  std::vector<int32_t> c(static_cast<size_t>(E));
  for (int l = 0; l < std::max(1, m.layers()); ++l) {
    m.counts(l, tokens, c.data());
    for (int64_t e = 0; e < E; ++e) rows[size_t(e / (E / ep))] += c[size_t(e)];
  }
  return rows;
}

std::string percent(double share) {
  char buf[32];
  std::snprintf(buf, sizeof buf, share >= 0.1 ? "%.1f%%" : "%.2g%%", 100 * share);
  return buf;
}

}  // namespace

std::string router_histogram_json(const RouterHistogram& h) {
  MOP_CHECK(h.experts > 0 && h.top_k > 0 && h.counts.size() % size_t(h.experts) == 0,
            "a histogram of ", h.counts.size(), " counts for ", h.experts, " experts");
  std::string out = "{\"format\": \"" + std::string(kHistogramFormat) +
                    "\", \"version\": " + std::to_string(kHistogramVersion) +
                    ", \"experts\": " + std::to_string(h.experts) +
                    ", \"top_k\": " + std::to_string(h.top_k) +
                    ", \"tokens\": " + std::to_string(h.tokens) + ",\n \"layers\": [";
  for (int64_t l = 0; l < h.layers(); ++l) {
    out += l ? ",\n  [" : "\n  [";
    for (int64_t e = 0; e < h.experts; ++e) {
      if (e) out += ", ";
      out += std::to_string(h.counts[size_t(l * h.experts + e)]);
    }
    out += "]";
  }
  out += "\n ]}\n";
  return out;
}

void write_router_histogram(const std::filesystem::path& path, const RouterHistogram& h) {
  write_file_atomic(path, router_histogram_json(h));
}

RouterHistogram read_router_histogram(const std::filesystem::path& path, int64_t experts,
                                      int64_t top_k) {
  const std::string name = "router histogram " + path.string();
  const Json j = parse_json(read_small_file(path, "router histogram", kHistogramFileCap), name);
  MOP_USER_CHECK(j.is_object(), name, ": expected a JSON object, got ", json_kind_name(j.kind()));
  auto key = [&](const std::string& k) { return name + ": " + k; };
  const std::string& format = j.at("format", name).as_string(key("format"));
  MOP_USER_CHECK(format == kHistogramFormat, key("format"), ": \"", format, "\", expected \"",
                 kHistogramFormat, "\"");
  const int64_t version = j.at("version", name).as_int64(key("version"));
  MOP_USER_CHECK(version == kHistogramVersion, key("version"), ": ", version, ", expected ",
                 kHistogramVersion, " (written by a newer mop?)");
  RouterHistogram h;
  h.experts = j.at("experts", name).as_int64(key("experts"));
  MOP_USER_CHECK(h.experts == experts, key("experts"), ": ", h.experts, ", but the model has ",
                 experts, " (moe.num_experts)");
  h.top_k = j.at("top_k", name).as_int64(key("top_k"));
  MOP_USER_CHECK(h.top_k == top_k, key("top_k"), ": ", h.top_k, ", but the model has ", top_k,
                 " (moe.top_k)");
  h.tokens = j.at("tokens", name).as_int64(key("tokens"));
  MOP_USER_CHECK(h.tokens >= 1 && h.tokens <= kMaxHistogramRows / top_k, key("tokens"), ": ",
                 h.tokens, ", expected 1 to ", kMaxHistogramRows / top_k,
                 " (2^53 rows over top_k)");
  const int64_t rows = h.tokens * top_k;
  const Json::Array& layers = j.at("layers", name).as_array(key("layers"));
  MOP_USER_CHECK(!layers.empty(), key("layers"), ": empty, expected one array per MoE layer");
  MOP_USER_CHECK(layers.size() <= kMaxMoeLayers, key("layers"), ": ", layers.size(),
                 " MoE layers, more than a model has (model.num_layers ≤ ", kMaxMoeLayers, ")");
  // Every layer's length is checked before the counts are allocated (layers × experts).
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string where = key("layers[" + std::to_string(l) + "]");
    const size_t n = layers[l].as_array(where).size();
    MOP_USER_CHECK(int64_t(n) == experts, where, ": ", n, " counts, expected ", experts,
                   " (experts)");
  }
  h.counts.reserve(layers.size() * size_t(experts));
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string where = key("layers[" + std::to_string(l) + "]");
    const Json::Array& layer = layers[l].as_array(where);
    int64_t sum = 0;
    for (size_t e = 0; e < size_t(experts); ++e) {
      const std::string at = where + "[" + std::to_string(e) + "]";
      const int64_t c = layer[e].as_int64(at);
      MOP_USER_CHECK(c >= 0, at, ": ", c, " is negative");
      MOP_USER_CHECK(c <= h.tokens, at, ": ", c, " exceeds tokens (", h.tokens,
                     "): a token picks an expert at most once");
      sum += c;  // ≤ rows + 2^53 (checked below at every step): no overflow
      MOP_USER_CHECK(sum <= rows, where,
                     ": the counts add up to more than tokens × top_k = ", h.tokens, " × ", top_k,
                     " = ", rows);
      h.counts.push_back(c);
    }
    MOP_USER_CHECK(sum > 0, where, ": every count is 0 (no rows routed in this layer)");
    MOP_USER_CHECK(sum == rows, where, ": the counts add up to ", sum,
                   ", expected tokens × top_k = ", h.tokens, " × ", top_k, " = ", rows);
  }
  return h;
}

RoutingModel RoutingModel::parse(const std::string& spec, int64_t experts, int64_t top_k) {
  MOP_CHECK(experts >= 1 && experts <= kMaxExperts && top_k >= 1 && top_k <= experts,
            "routing model for ", experts, " experts, top_k ", top_k);
  RoutingModel m;
  m.spec_ = spec, m.experts_ = experts, m.top_k_ = top_k;
  const size_t E = size_t(experts);
  if (spec == "balanced") {
    m.kind_ = Kind::Balanced;
    m.shares_.assign(E, 1.0 / double(experts));
    return m;
  }
  if (spec.rfind("zipf:", 0) == 0) {
    const std::string s = spec.substr(5);
    double v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    MOP_USER_CHECK(
        !s.empty() && ec == std::errc() && end == s.data() + s.size() && std::isfinite(v) && v >= 0,
        "routing model ", spec, ": S: '", s,
        "' is not a finite number ≥ 0 (zipf:S, e.g. zipf:1.2)");
    m.kind_ = Kind::Zipf;
    // (e+1)^-S; with a large S the tail underflows to 0 and counts() spreads what expert 0
    // cannot take evenly over the rest.
    m.shares_.resize(E);
    for (size_t e = 0; e < E; ++e) m.shares_[e] = std::pow(double(e + 1), -v);
    const double sum = std::accumulate(m.shares_.begin(), m.shares_.end(), 0.0);
    for (double& x : m.shares_) x /= sum;
    return m;
  }
  std::error_code ec;
  MOP_USER_CHECK(
      !spec.empty() && std::filesystem::exists(spec, ec), "routing model '", spec,
      "': expected balanced, zipf:S or the path of a router histogram file (no such file)");
  const RouterHistogram h = read_router_histogram(spec, experts, top_k);
  m.kind_ = Kind::Histogram, m.layers_ = int(h.layers()), m.hist_tokens_ = h.tokens;
  m.shares_.resize(h.counts.size());
  const double rows = double(h.tokens * top_k);  // each layer's sum, exact (≤ 2^53)
  for (size_t i = 0; i < h.counts.size(); ++i) m.shares_[i] = double(h.counts[i]) / rows;
  return m;
}

const double* RoutingModel::shares_of(int moe_layer) const {
  MOP_CHECK(moe_layer >= 0, "MoE layer ", moe_layer);
  if (layers_ == 0) return shares_.data();
  MOP_USER_CHECK(moe_layer < layers_, "router histogram ", spec_, ": has ", layers_,
                 " MoE layers, MoE layer ", moe_layer,
                 " asked (the model has more MoE layers "
                 "than the run that wrote the histogram)");
  return shares_.data() + size_t(moe_layer) * size_t(experts_);
}

double RoutingModel::share(int moe_layer, int64_t e) const {
  MOP_CHECK(e >= 0 && e < experts_, "expert ", e, " of ", experts_);
  return shares_of(moe_layer)[e];
}

void RoutingModel::counts(int moe_layer, int64_t tokens, int32_t* out) const {
  MOP_CHECK(tokens >= 0 && tokens <= INT32_MAX, "tokens ", tokens, " (each count is an int32)");
  const double* s = shares_of(moe_layer);
  const size_t E = size_t(experts_);
  const int64_t rows = tokens * top_k_;
  // Water-filling: the uncapped experts share what the capped ones (exactly `tokens` each) leave,
  // in proportion to their shares; an expert asking for more than `tokens` is capped and the
  // rest share again. Capping only raises the others' targets, so each pass caps every expert
  // over the line at once; at most E passes. Σ target = rows, as rows ≤ E · tokens.
  std::vector<double> target(E, 0.0);
  std::vector<char> capped(E, 0);
  double rest = double(rows);
  for (;;) {
    double weight = 0;
    size_t open = 0;
    for (size_t e = 0; e < E; ++e)
      if (!capped[e]) weight += s[e], ++open;
    if (open == 0) break;
    bool capped_any = false;
    for (size_t e = 0; e < E; ++e) {
      if (capped[e]) continue;
      // Shares that underflowed to 0 (zipf with a large S) take an even split of what is left.
      target[e] = weight > 0 ? rest * (s[e] / weight) : rest / double(open);
      if (target[e] > double(tokens)) capped[e] = 1, capped_any = true;
    }
    if (!capped_any) break;
    rest = double(rows);
    for (size_t e = 0; e < E; ++e)
      if (capped[e]) target[e] = double(tokens), rest -= double(tokens);
  }
  // Largest remainder: floors, then one more row to the largest fractional parts (ties: the
  // lower expert) until the rows add up. Rounding error in the targets may leave the floors a
  // row or two off either way; the loops below settle it without passing a cap.
  std::vector<int64_t> n(E);
  std::vector<double> frac(E);
  int64_t left = rows;
  for (size_t e = 0; e < E; ++e) {
    n[e] = std::clamp<int64_t>(int64_t(std::floor(target[e])), 0, tokens);
    frac[e] = target[e] - double(n[e]);
    left -= n[e];
  }
  std::vector<size_t> order(E);
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return frac[a] > frac[b]; });
  while (left > 0)
    for (size_t i = 0; i < E && left > 0; ++i)
      if (n[order[i]] < tokens) ++n[order[i]], --left;
  while (left < 0)
    for (size_t i = E; i-- > 0 && left < 0;)
      if (n[order[i]] > 0) --n[order[i]], ++left;
  for (size_t e = 0; e < E; ++e) out[e] = int32_t(n[e]);
}

std::string RoutingModel::describe() const {
  const size_t E = size_t(experts_);
  if (kind_ == Kind::Balanced)
    return "balanced over " + std::to_string(E) + " experts: each takes " +
           percent(1.0 / double(E)) + " of the rows";
  if (kind_ == Kind::Zipf) {
    const bool capped = shares_[0] * double(top_k_) > 1;
    return spec_ + " over " + std::to_string(E) + " experts: expert 0's share " +
           percent(shares_[0]) + " of the rows, expert " + std::to_string(E - 1) + "'s " +
           percent(shares_[E - 1]) +
           (capped ? " (capped at 1/top_k = " + percent(1.0 / double(top_k_)) +
                         ": a token picks an expert once)"
                   : "");
  }
  size_t busiest = 0;
  for (size_t i = 1; i < shares_.size(); ++i)
    if (shares_[i] > shares_[busiest]) busiest = i;
  return "router histogram " + spec_ + ": " + std::to_string(layers_) + " MoE layers, " +
         std::to_string(hist_tokens_) + " tokens; the busiest expert takes " +
         percent(shares_[busiest]) + " of its layer's rows (layer " + std::to_string(busiest / E) +
         ", expert " + std::to_string(busiest % E) + ")";
}

int RoutingModel::most_loaded(const RoutingModel& m, int ep, int64_t tokens) {
  const std::vector<int64_t> rows = rank_rows(m, ep, tokens);
  return int(std::max_element(rows.begin(), rows.end()) - rows.begin());  // the first of ties
}

double RoutingModel::load(const RoutingModel& m, int ep_rank, int ep, int64_t tokens) {
  MOP_CHECK(ep_rank >= 0 && ep_rank < ep, "ep rank ", ep_rank, " of ", ep);
  const std::vector<int64_t> rows = rank_rows(m, ep, tokens);
  const double balanced =
      double(std::max(1, m.layers())) * double(tokens) * double(m.top_k()) / double(ep);
  return double(rows[size_t(ep_rank)]) / balanced;
}

}  // namespace mop
