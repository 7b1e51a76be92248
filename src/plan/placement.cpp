// State and saved-tensor placement (see placement.h).
#include "plan/placement.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "model/params.h"
#include "model/tiled_attention.h"

namespace mop {

namespace {

// Moving a segment's optimizer state from the host to the device, per segment: what it costs the
// device and saves the host (rank 0). Everything on the host costs 2 bytes per parameter on the
// device (bf16 gradient staging, in `need`); moving a segment's state costs 10 more per element.
// (Sliced parameters count their slices' elements.) With streamed gradients the host-updated
// segments cost the device nothing of their own (their gradients are in flight); moving one costs
// its state (12 bytes per element the rank keeps) and the gradients it then keeps on the device:
// the slice's (4 bytes per slice element) or the whole parameter's. The host saves the state and
// its staging.
struct StateMoves {
  std::vector<double> device_cost, host_saving;
  double need = 0;  // device bytes of the all-on-host placement not in the caller's `used`
};

StateMoves state_moves(const Plan& p, const ModelLayout& local) {
  const int segments = num_segments(p.dims);
  // Sliced parameters without streaming keep their slices' gradients on the device either way
  // (what the step runs): moving their state costs what moving whole parameters' does.
  const bool moving = p.stream_grads;
  // Streamed, the host keeps the state the rank owns (12 bytes per element), the pinned bf16
  // gradients and weights of the parameters it owns (4 per element of the whole parameter), and
  // with several micro-batches every streamed gradient's running sum (plan.cpp, memory_of_rank).
  const double running_sum = p.micro_batches > 1 ? double(dtype_size(p.run.grad)) : 0.0;
  StateMoves m;
  m.device_cost.assign(size_t(segments), 0), m.host_saving.assign(size_t(segments), 0);
  for (int q = 0; q < int(local.params.size()); ++q) {
    const int64_t n = local.params[q].numel();
    const size_t s = size_t(param_segment(local, q));
    const double state = double(p.state_numel(0, q, n));
    if (!moving) {
      const bool sliced = p.parallel.params[size_t(q)].kind == Sharding::Slice;
      const double e = double(aligned_numel(sliced ? p.parallel.slice_numel(q, n) : n));
      m.device_cost[s] += 10.0 * e;
      m.need += 2.0 * e;
      m.host_saving[s] += 12.0 * state + 4.0 * e;
    } else {
      const double whole = double(aligned_numel(n));
      const bool sliced = p.parallel.params[size_t(q)].kind == Sharding::Slice;
      m.device_cost[s] += sliced ? 16.0 * state : 12.0 * state + 4.0 * whole;
      m.host_saving[s] += 12.0 * state + (p.owns(0, q) ? 4.0 * whole : 0.0) + running_sum * whole;
    }
  }
  return m;
}

// How many segments' state moves to the device (a prefix in forward order, whose host updates
// would be exposed first) with `free` device bytes, and the host bytes that saves.
int segments_moved(const StateMoves& m, double free, double* host_saved = nullptr) {
  double need = m.need, saved = 0;
  int s = 0;
  for (; s < int(m.device_cost.size()) && need + m.device_cost[size_t(s)] <= free; ++s)
    need += m.device_cost[size_t(s)], saved += m.host_saving[size_t(s)];
  if (host_saved) *host_saved = saved;
  return s;
}

// Optimizer-state placement per segment. auto: as many segments on the device as fit (less its
// reserve), in forward order (state_moves). `device_used`: the device memory besides the state
// and staging, or with streamed gradients all of it with every segment's state on the host.
}  // namespace

std::vector<bool> place_state(Plan& p, const ModelLayout& local, size_t device_used) {
  const int segments = num_segments(p.dims);
  const std::string& mode = p.cfg.optim.state_placement;
  if (p.run.device == Device::CPU) {
    if (mode != "host") return std::vector<bool>(size_t(segments), false);
    MOP_USER_CHECK(p.run.compute == DType::F32, "optim.state_placement: host on the CPU needs "
                   "train.precision fp32 (the host engine reads fp32 or bf16 gradients)");
    return std::vector<bool>(size_t(segments), true);
  }
  if (mode == "gpu") return std::vector<bool>(size_t(segments), false);
  if (mode == "host") return std::vector<bool>(size_t(segments), true);
  const double free = p.machine.device.memory_bytes - p.machine.device.reserve_bytes - double(device_used);
  const int moved = segments_moved(state_moves(p, local), free);
  std::vector<bool> on_host(size_t(segments), true);
  for (int s = 0; s < moved; ++s) on_host[size_t(s)] = false;
  return on_host;
}

// With recompute: which layers keep their attention output (layers [0, keep)), which keep the
// last `tail` query tiles of it (the others, where attention runs in tiles over one sequence per
// micro-batch), and which keep their saved tensors in pinned host memory (layers [0, host)).
// Pinned counts are taken as given; the plan's choice saves the most recomputed attention that
// memory holds, with as few host layers as the device needs (their copies hide behind the layers'
// compute), planned with every optimizer state that may live on the host there — the state takes
// what device memory is left afterwards (place_state).
void place_saved(Plan& p, const ModelDims& local_dims) {
  ActivationOptions& ao = p.activation_options;
  const Config& cfg = p.cfg;
  const int L = int(p.dims.layers);
  ao.host_layers = ao.keep_attention = ao.keep_attention_tail = 0;
  if (!ao.recompute) return;
  const bool can_keep = p.cp == 1 || p.ring;
  const int pin_keep = int(cfg.train.keep_attention), pin_host = int(cfg.train.offload_layers);
  // Tails: the last tiles of one tiled sequence per micro-batch on one rank's whole sequences.
  const int64_t S = ao.max_seq, tile = ao.attention_tile;
  const int tiles = p.cp == 1 && !p.ring && ao.max_batch == 1 && TiledAttention::tiled(tile, S) &&
                            S % tile == 0
                        ? int(S / tile)
                        : 0;
  const int pin_tail = int(cfg.train.keep_attention_tail);
  MOP_USER_CHECK(pin_tail <= 0 || (tiles > 0 && pin_tail < tiles), "train.keep_attention_tail: ",
                 pin_tail, " tiles need attention in query tiles over one sequence per micro-batch "
                 "with more tiles than that (this plan: ", tiles ? std::to_string(tiles) + " tiles of " +
                 std::to_string(tile) + " tokens" : std::string("no tiles"), ")");
  if (p.run.device == Device::CPU) {  // one memory: nothing to offload
    ao.keep_attention = pin_keep >= 0 ? pin_keep : (can_keep ? L : 0);
    ao.keep_attention_tail = std::max(0, pin_tail);
    ao.host_layers = std::max(0, pin_host);
    return;
  }
  const std::string& mode = cfg.optim.state_placement;
  const ModelLayout& local = p.local_layout();
  Plan trial = p;
  if (mode != "gpu") trial.state_on_host.assign(local.params.size(), true);
  // Only the activations change from trial to trial.
  trial.activations = plan_activations(local_dims, trial.activation_options);
  const MemoryPlan base = trial.memory_of_rank(0);
  // auto: the state that placement then moves to the device (as much as the device has room
  // for) relieves the host.
  const bool moving = p.stream_grads;
  const StateMoves moves = mode == "auto" ? state_moves(trial, local) : StateMoves{};
  const double capacity = p.machine.device.memory_bytes - p.machine.device.reserve_bytes;
  int tail = std::max(0, pin_tail);  // the tail the trials below keep
  auto fits = [&](int keep, int host) {
    ActivationOptions& o = trial.activation_options;
    o.keep_attention = keep, o.host_layers = host, o.keep_attention_tail = keep < L ? tail : 0;
    trial.activations = plan_activations(local_dims, o);
    trial.memory = base;
    trial.memory.activations = trial.activations.device_bytes();
    trial.memory.host_activations = trial.activations.host_bytes();
    if (mode == "auto") {
      const MemoryPlan& t = trial.memory;
      const double used = moving ? double(t.device_total())
                                 : double(t.device_total() - t.optimizer_state - t.host_grad_staging);
      double saved = 0;
      segments_moved(moves, capacity - used, &saved);
      const double from_state = std::min(saved, double(t.host_optimizer_state));
      trial.memory.host_optimizer_state -= size_t(from_state);
      trial.memory.host_staging -= size_t(std::min(saved - from_state, double(t.host_staging)));
    }
    return plan_fits(trial);
  };
  const int keep_hi = pin_keep >= 0 ? pin_keep : (can_keep ? L : 0), keep_lo = pin_keep >= 0 ? pin_keep : 0;
  const int host_lo = pin_host >= 0 ? pin_host : 0, host_hi = pin_host >= 0 ? pin_host : L;
  // More host layers take device memory off and put host memory on; more kept layers (or a
  // longer tail) take both. So for each kept count the fewest host layers that fit the device is
  // a bisection, and the kept counts that fit at all are a prefix from keep_lo: bisect them too.
  auto fewest_host = [&](int keep) {  // -1: no host count fits
    if (!fits(keep, host_hi)) {
      // The device may not fit even with every layer on the host, or the host may not: try the
      // device-side end too (host memory only grows with host layers).
      for (int h = host_lo; h < host_hi; ++h)
        if (fits(keep, h)) return h;
      return -1;
    }
    int lo = host_lo, hi = host_hi;  // fits(hi)
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (fits(keep, mid)) hi = mid; else lo = mid + 1;
    }
    return lo;
  };
  struct Choice {
    int keep = -1, host = -1, tail = 0;
  };
  auto most_kept = [&]() {  // the most kept layers that fit with `tail`; keep -1: none fits
    if (int h = fewest_host(keep_hi); h >= 0) return Choice{keep_hi, h, tail};
    Choice best;
    int lo = keep_lo, hi = keep_hi - 1;
    while (lo <= hi) {
      const int mid = (lo + hi) / 2;
      if (int h = fewest_host(mid); h >= 0) best = {mid, h, tail}, lo = mid + 1; else hi = mid - 1;
    }
    return best;
  };
  Choice best = most_kept();
  if (pin_tail < 0 && tiles > 1 && best.keep >= 0 && best.keep < L) {
    // Recomputing the first m of n tiles runs m(m−1)/2 full blocks and m causal ones (half a
    // full block each): m²/2 blocks. Each tail is priced by the recompute it leaves.
    auto recompute = [&](const Choice& c) {
      const double m = tiles - c.tail;
      return double(L - c.keep) * m * m;
    };
    for (tail = 1; tail < tiles; ++tail) {
      const Choice c = most_kept();
      if (c.keep < 0) break;  // longer tails only take more memory
      if (recompute(c) < recompute(best)) best = c;
    }
  }
  if (best.keep >= 0) {
    ao.keep_attention = best.keep, ao.host_layers = best.host;
    ao.keep_attention_tail = best.keep < L ? best.tail : 0;
    return;
  }
  // Does not fit: the fit check says why.
  ao.keep_attention = keep_lo, ao.host_layers = host_hi;
  ao.keep_attention_tail = keep_lo < L ? std::max(0, pin_tail) : 0;
}

}  // namespace mop
