// RoutingModel: the rows one rank's tokens send to each expert of an MoE layer, made up rather
// than measured — for `mop emulate`, whose stand-in for the expert exchange's count all-gather
// (ExpertDispatcher::plan) must produce the other ranks' counts. A model is "balanced", "zipf:S"
// (expert e's share ∝ 1/(e+1)^S) or a router histogram file that `mop train` writes
// (log.router_histogram: the rows each expert of each MoE layer received over a run). Pure
// functions of (spec, layer, tokens): every rank of an emulation derives the same counts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace mop {

// The routed rows of a run, per MoE layer and expert, summed over its training steps and ranks.
// File (JSON; the writer puts one layer per line):
//   {"format": "mop-router-histogram", "version": 1, "experts": E, "top_k": k,
//    "tokens": N, "layers": [[E counts], ...]}   one array per MoE layer, in layer order
// N is the tokens each MoE layer routed; each layer's counts add up to N·k and none exceeds N (a
// token picks k distinct experts).
struct RouterHistogram {
  int64_t experts = 0, top_k = 0, tokens = 0;
  std::vector<int64_t> counts;  // [moe layer][expert], row-major: layers() × experts
  int64_t layers() const { return experts > 0 ? int64_t(counts.size()) / experts : 0; }
};

std::string router_histogram_json(const RouterHistogram& h);
// Written atomically (path.tmp, then renamed over `path`): a reader sees a whole file.
void write_router_histogram(const std::filesystem::path& path, const RouterHistogram& h);
// Reads and checks a histogram for a model of `experts` experts and `top_k`: a file that is not
// one (not found, a directory or FIFO, over the size cap, not JSON, another format or version),
// or that does not fit the model (experts, top_k), or whose counts are not what N tokens route
// (negative, over N, a layer not adding up to N·k, a layer of zeros) is a UserError naming the
// file, the key and the value: "router histogram h.json: experts: 64, but the model has 8".
RouterHistogram read_router_histogram(const std::filesystem::path& path, int64_t experts,
                                      int64_t top_k);

class RoutingModel {
 public:
  // spec: "balanced"; "zipf:S" with S a finite number ≥ 0 (zipf:0 is balanced); anything else is
  // the path of a router histogram (a file named like a spec: ./zipf:1). A bad spec or file is a
  // UserError naming it. experts ≥ 1 and 1 ≤ top_k ≤ experts are the caller's (MOP_CHECK).
  static RoutingModel parse(const std::string& spec, int64_t experts, int64_t top_k);

  // out [E]: the rows a source rank with `tokens` tokens sends to each expert of MoE layer
  // `moe_layer` (0-based among the MoE layers). Σ out = tokens·top_k exactly and out[e] ≤ tokens:
  // a share asking for more than `tokens` rows is capped there and its excess goes to the
  // uncapped experts in proportion to their shares (water-filling); the real-valued targets are
  // then rounded by largest remainder (ties: the lower expert). Deterministic. A histogram asked
  // for a layer it does not have (moe_layer ≥ layers()) throws a UserError naming the file and
  // both counts; callers check layers() up front. 0 ≤ tokens ≤ 2^31 − 1 (out is int32). Every
  // source rank with the same tokens gets the same counts: compute them once per layer.
  void counts(int moe_layer, int64_t tokens, int32_t* out) const;
  // Expert e's share of the layer's rows before capping (Σ_e share = 1).
  double share(int moe_layer, int64_t e) const;
  // MoE layers a histogram describes; 0 for balanced and zipf (every layer the same).
  int layers() const { return layers_; }
  int64_t experts() const { return experts_; }
  int64_t top_k() const { return top_k_; }
  // One line for the log: "zipf:1.2 over 64 experts: expert 0's share 21.3% of the rows, expert
  // 63's 0.14%", "router histogram h.json: 24 MoE layers, 1048576 tokens; the busiest expert
  // takes 9.8% of its layer's rows (layer 3, expert 17)".
  std::string describe() const;

  // Expert-parallel load over ep ranks (rank r owns experts [r·E/ep, (r+1)·E/ep); ep divides E).
  // Rank r's rows: what counts(·, tokens) sends its experts, summed over the layers (one layer
  // for balanced and zipf) — the same from every source rank, so per source.
  // most_loaded: the rank receiving the most rows (ties: the lowest).
  static int most_loaded(const RoutingModel& m, int ep, int64_t tokens);
  // Rank ep_rank's rows over its balanced share (layers · tokens·top_k / ep): 1.0 is balanced,
  // 2.0 twice the rows a balanced router would send it.
  static double load(const RoutingModel& m, int ep_rank, int ep, int64_t tokens);

 private:
  RoutingModel() = default;
  const double* shares_of(int moe_layer) const;  // [E] of the layer (a UserError past layers())

  enum class Kind { Balanced, Zipf, Histogram };
  Kind kind_ = Kind::Balanced;
  std::string spec_;
  int64_t experts_ = 0, top_k_ = 0, hist_tokens_ = 0;
  int layers_ = 0;
  std::vector<double> shares_;  // [max(layers, 1)][E], each row adds up to 1
};

}  // namespace mop
