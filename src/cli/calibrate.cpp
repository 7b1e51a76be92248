// mop calibrate: measures this machine for the plan (plan/machine.h) and writes a machine file.
// Every rank runs the same measurements at once — so host memory, PCIe and the CPU AdamW are
// measured as a full node shares them — and rank 0 writes the result. Inputs are random (GEMMs
// run faster on zeros); each op is run once to build its plans, then timed on its stream until
// enough time has passed. Sizes: the GEMM grid, rows per expert, sequence lengths and the
// memory-bound ops at q3moe-8l's widths on a GPU, small ones on the CPU backend.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <vector>

#include "cli/commands.h"
#include "cli/emulate.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "ops/ops.h"
#include "optim/host_adamw_bench.h"
#include "parallel/comm_factory.h"
#include "plan/machine.h"
#include "plan/op_bytes.h"
#include "runtime/memory.h"
#include "runtime/runtime.h"

namespace mop {

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Timing and tensors on the ops device.
class Bench {
 public:
  static constexpr double kSustainSeconds = 0.25;
  explicit Bench(Ops& ops) : ops_(ops), stream_(ops.stream()) {
    if (!stream_.is_null()) start_ = Event(stream_.device(), true), stop_ = Event(stream_.device(), true);
  }

  // Seconds per call of fn: once to warm up (plans, workspaces), then — on a GPU, for the ops a
  // step runs back to back — kSustainSeconds of calls untimed, so the GPU runs at the clocks its
  // power limit gives under a step's sustained load rather than at a short burst's boost clocks
  // (isolated 30 ms timings ran attention ~15% faster than the same kernels inside q3moe-8l
  // steps, 2026-12-03); then timed until min_seconds have passed (at most max_iters calls).
  double time(const std::function<void()>& fn, double min_seconds = 0.03, int max_iters = 40) {
    fn();
    ops_.synchronize();
    if (!stream_.is_null() && min_seconds >= 0.03)
      for (const double t0 = now(); now() - t0 < kSustainSeconds;) {
        for (int i = 0; i < 8; ++i) fn();
        ops_.synchronize();
      }
    int iters = 0;
    double elapsed = 0;
    while (iters < max_iters && elapsed < min_seconds) {
      const int batch = iters == 0 ? 1 : std::min(max_iters - iters, std::max(1, iters));
      const double t0 = now();
      if (!stream_.is_null()) start_.record(stream_);
      for (int i = 0; i < batch; ++i) fn();
      if (!stream_.is_null()) {
        stop_.record(stream_);
        stop_.synchronize();
        elapsed += 1e-3 * stop_.elapsed_ms_since(start_);
      } else {
        elapsed += now() - t0;
      }
      iters += batch;
    }
    return elapsed / iters;
  }

  // A tensor on the ops device filled with uniform values in [-scale, scale) (ids: in [0, range)).
  Tensor random(DType dtype, std::initializer_list<int64_t> dims, double scale = 1.0, int64_t range = 0) {
    Tensor t(nullptr, dtype, dims, ops_.device());
    keep_.emplace_back(ops_.device() == Device::CPU ? MemKind::Host : MemKind::Device, t.bytes());
    t.data = keep_.back().data();
    // One random chunk of the host, tiled over the tensor (generation would dominate otherwise).
    const int64_t chunk = std::min<int64_t>(t.numel(), int64_t(1) << 22);
    std::vector<float> f(size_t(range ? 0 : chunk));
    std::vector<int32_t> ids(size_t(range ? chunk : 0));
    for (int64_t i = 0; i < chunk; ++i) {
      const uint64_t r = philox_u64(seed_, 7, uint64_t(i));
      if (range) ids[size_t(i)] = int32_t(r % uint64_t(range));
      else f[size_t(i)] = float(scale * (double(r >> 11) / 4503599627370496.0 - 1.0));
    }
    ++seed_;
    const Tensor src = range ? Tensor(ids.data(), DType::I32, {chunk}) : Tensor(f.data(), DType::F32, {chunk});
    const Tensor flat = t.view({t.numel()});
    for (int64_t at = 0; at < t.numel(); at += chunk) {
      const int64_t n = std::min(chunk, t.numel() - at);
      ops_.copy(flat.rows(at, at + n), src.rows(0, n));
    }
    ops_.synchronize();
    return t;
  }
  void release() { keep_.clear(); }

 private:
  Ops& ops_;
  Stream stream_;
  Event start_, stop_;
  std::vector<Buffer> keep_;
  uint64_t seed_ = 1;
};

void say(bool root, const std::string& line) {
  if (root) std::fprintf(stderr, "calibrate: %s\n", line.c_str());
}

std::string rate(double v, double unit, const char* suffix) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f %s", v / unit, suffix);
  return buf;
}

std::string flops(double v) { return v >= 1e12 ? rate(v, 1e12, "TFLOP/s") : rate(v, 1e9, "GFLOP/s"); }

// Dense GEMMs: cubes of growing size, each pass as the model runs it.
void dense_gemm(Ops& ops, Bench& b, DeviceSpec& d, bool gpu, bool root) {
  d.gemm_fwd.points.clear(), d.gemm_dgrad.points.clear(), d.gemm_wgrad.points.clear();
  const DType c = gpu ? DType::BF16 : DType::F32, acc = DType::F32;
  for (int64_t n : gpu ? std::vector<int64_t>{512, 1024, 2048, 4096, 8192} : std::vector<int64_t>{32, 64, 128, 256}) {
    Tensor x = b.random(c, {n, n}, 1), w = b.random(c, {n, n}, 0.02), y = b.random(c, {n, n});
    Tensor dw = b.random(acc, {n, n});
    const double f = 2.0 * double(n) * double(n) * double(n);
    const double fwd = f / b.time([&] { ops.gemm(y, x, false, w, true, 1, 0); });
    const double dgrad = f / b.time([&] { ops.gemm(y, x, false, w, false, 1, 0); });
    const double wgrad = f / b.time([&] { ops.gemm(dw, x, true, w, false, 1, 1); });
    d.gemm_fwd.points.push_back({f, fwd}), d.gemm_dgrad.points.push_back({f, dgrad});
    d.gemm_wgrad.points.push_back({f, wgrad});
    say(root, "GEMM " + std::to_string(n) + "³: " + flops(fwd) + " forward, " + flops(dgrad) +
                  " data gradient, " + flops(wgrad) + " weight gradient");
    b.release();
  }
}

// One grouped pass of q3moe-8l's expert shapes (gate/up K = hidden → N = 2F, down K = F → N =
// hidden) over E experts with `rows` rows each on average, drawn as random routing gives them
// (multinomial): FLOP/s of the forward, the data gradient and the weight gradient, each over both
// projections.
struct GroupedRates {
  double fwd = 0, dgrad = 0, wgrad = 0;
  double combined() const { return 3 / (1 / fwd + 1 / dgrad + 1 / wgrad); }
};
GroupedRates grouped_rates(Ops& ops, Bench& b, int64_t E, int64_t H, int64_t F, int64_t rows,
                           DType c) {
  const int64_t R = rows * E;
  std::vector<int32_t> off(static_cast<size_t>(E + 1), 0);
  for (int64_t r = 0; r < R; ++r)
    ++off[size_t(1 + philox_u64(99, uint64_t(rows), uint64_t(r)) % uint64_t(E))];
  for (int64_t e = 0; e < E; ++e) off[size_t(e + 1)] += off[size_t(e)];
  const Tensor offsets(off.data(), DType::I32, {E + 1});
  Tensor x = b.random(c, {R, H}), gu = b.random(c, {R, 2 * F}), h = b.random(c, {R, F}),
         y = b.random(c, {R, H});
  Tensor w1 = b.random(c, {E, 2 * F, H}, 0.02), w2 = b.random(c, {E, H, F}, 0.02);
  Tensor dw1 = b.random(DType::F32, {E, 2 * F, H}), dw2 = b.random(DType::F32, {E, H, F});
  const double f = 2.0 * double(R) * double(H) * double(3 * F);  // both projections
  GroupedRates g;
  g.fwd = f / b.time([&] {
    ops.grouped_gemm_fwd(gu, x, w1, offsets);
    ops.grouped_gemm_fwd(y, h, w2, offsets);
  });
  g.dgrad = f / b.time([&] {
    ops.grouped_gemm_bwd_data(h, y, w2, offsets);
    ops.grouped_gemm_bwd_data(x, gu, w1, offsets);
  });
  g.wgrad = f / b.time([&] {
    ops.grouped_gemm_bwd_weight(dw2, y, h, offsets);
    ops.grouped_gemm_bwd_weight(dw1, gu, x, offsets);
  });
  b.release();
  return g;
}

// Grouped expert GEMMs by rows per expert at 128 experts (the CPU backend: 8), then — at a fixed
// number of rows per expert — by the experts one call holds (a rank's local experts: E / ep), as a
// factor on those rates: in the step of an emulated ep-8 rank (16 experts × 2,048 rows) the H200 ran
// q3moe-8l's expert GEMMs 31% faster than the 128-expert table said (2026-12-03); alone, 16 experts
// run 1.09× the 128-expert rate (2026-12-04).
void grouped_gemm(Ops& ops, Bench& b, DeviceSpec& d, bool gpu, bool root) {
  const int64_t E = gpu ? 128 : 8, H = gpu ? 2048 : 64, F = gpu ? 768 : 32;
  d.grouped_fwd.points.clear(), d.grouped_dgrad.points.clear(), d.grouped_wgrad.points.clear();
  d.grouped_experts.points.clear();
  d.grouped_shape = "E=" + std::to_string(E) + " H=" + std::to_string(H) +
                    " F=" + std::to_string(F) + ", gate/up and down";
  const DType c = gpu ? DType::BF16 : DType::F32;
  for (int64_t rows : gpu ? std::vector<int64_t>{64, 128, 256, 512, 1024, 2048}
                          : std::vector<int64_t>{16, 64, 256}) {
    const GroupedRates g = grouped_rates(ops, b, E, H, F, rows, c);
    d.grouped_fwd.points.push_back({double(rows), g.fwd});
    d.grouped_dgrad.points.push_back({double(rows), g.dgrad});
    d.grouped_wgrad.points.push_back({double(rows), g.wgrad});
    say(root, "experts, " + std::to_string(rows) + " rows per expert: " + flops(g.fwd) +
                  " forward, " + flops(g.dgrad) + " data gradient, " + flops(g.wgrad) +
                  " weight gradient");
  }
  const int64_t rows = gpu ? 1024 : 64;
  const double full = grouped_rates(ops, b, E, H, F, rows, c).combined();
  for (int64_t e : gpu ? std::vector<int64_t>{4, 8, 16, 32, 64} : std::vector<int64_t>{2}) {
    const double factor = grouped_rates(ops, b, e, H, F, rows, c).combined() / full;
    d.grouped_experts.points.push_back({double(e), factor});
    char buf[96];
    std::snprintf(
        buf, sizeof buf, "experts, %lld per call (%lld rows each): %.3f × the %lld-expert rate",
        static_cast<long long>(e), static_cast<long long>(rows), factor, static_cast<long long>(E));
    say(root, buf);
  }
  d.grouped_experts.points.push_back({double(E), 1.0});
}

// Attention by sequence length, one sequence per call (micro-batches of one): causal, and the
// non-causal blocks of ring attention.
void attention(Ops& ops, Bench& b, DeviceSpec& d, bool gpu, bool root) {
  const int64_t Nq = gpu ? 32 : 4, Nkv = gpu ? 4 : 2, D = gpu ? 128 : 32;
  const DType c = gpu ? DType::BF16 : DType::F32;
  for (bool causal : {true, false}) {
    RateTable& fwd_t = causal ? d.attention_fwd : d.attention_block_fwd;
    RateTable& bwd_t = causal ? d.attention_bwd : d.attention_block_bwd;
    fwd_t.points.clear(), bwd_t.points.clear();
    const std::vector<int64_t> seqs = gpu ? (causal ? std::vector<int64_t>{1024, 4096, 16384, 65536, 131072}
                                                    : std::vector<int64_t>{1024, 4096, 16384, 32768, 65536, 131072})
                                          : std::vector<int64_t>{64, 256};
    for (int64_t S : seqs) {
      const int B = 1;
      const int64_t T = B * S;
      Tensor q = b.random(c, {T, Nq, D}), k = b.random(c, {T, Nkv, D}), v = b.random(c, {T, Nkv, D});
      Tensor out = b.random(c, {T, Nq, D}), lse = b.random(DType::F32, {B, Nq, S});
      Tensor dq = b.random(c, {T, Nq, D}), dk = b.random(c, {T, Nkv, D}), dv = b.random(c, {T, Nkv, D});
      const float scale = float(1.0 / std::sqrt(double(D)));
      // FLOPs: 4·S²·Nq·D per sequence forward (half of it causal), 2.5× that backward.
      const double f = 4.0 * B * double(S) * double(S) * double(Nq * D) * (causal ? 0.5 : 1.0);
      const double fr = f / b.time([&] { ops.attention_fwd(out, lse, q, k, v, B, scale, causal); });
      // The backward recomputes the softmax from the forward's lse: run the forward first.
      ops.attention_fwd(out, lse, q, k, v, B, scale, causal);
      const double br = 2.5 * f / b.time([&] {
        ops.attention_bwd(dq, dk, dv, out, q, k, v, out, lse, B, scale, causal);
      });
      fwd_t.points.push_back({double(S), fr});
      bwd_t.points.push_back({double(S), br});
      say(root, std::string(causal ? "attention" : "attention block") + " S=" + std::to_string(S) + ": " +
                    flops(fr) + " forward, " + flops(br) + " backward");
      b.release();
    }
  }
}

// The fused LM head + loss by chunk (train.lm_head_chunk).
void lm_head(Ops& ops, Bench& b, DeviceSpec& d, bool gpu, bool root) {
  const int64_t T = gpu ? 16384 : 256, H = gpu ? 2048 : 64, V = gpu ? 151936 : 2048;
  const DType c = gpu ? DType::BF16 : DType::F32;
  d.lm_head_fwd.points.clear(), d.lm_head_bwd.points.clear();
  for (int64_t C : gpu ? std::vector<int64_t>{1024, 4096} : std::vector<int64_t>{64}) {
    Tensor x = b.random(c, {T, H}), w = b.random(c, {V, H}, 0.02);
    Tensor targets = b.random(DType::I32, {T}, 0, V), ws = b.random(DType::F32, {C, V});
    Tensor loss = b.random(DType::F32, {T}), lse = b.random(DType::F32, {T});
    Tensor dx = b.random(c, {T, H}), dw = b.random(DType::F32, {V, H});
    const double f = 2.0 * double(T) * double(V) * double(H);
    const double fwd = f / b.time([&] { ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws); });
    const double bwd = 3 * f / b.time([&] { ops.lmhead_ce_bwd(dx, dw, x, w, targets, lse, 1e-4f, ws); });
    d.lm_head_fwd.points.push_back({double(C), fwd});
    d.lm_head_bwd.points.push_back({double(C), bwd});
    say(root, "LM head + loss, chunks of " + std::to_string(C) + ": " + flops(fwd) + " forward, " +
                  flops(bwd) + " backward");
    b.release();
  }
}

// Memory-bound ops: bytes read and written per second.
void memory_bound(Ops& ops, Bench& b, DeviceSpec& d, bool gpu, bool root) {
  const int64_t T = gpu ? 16384 : 1024, H = gpu ? 2048 : 128, K = 8, E = 128, F = gpu ? 768 : 64;
  const int64_t heads = gpu ? 32 : 4, D = gpu ? 128 : 32, V = gpu ? 151936 : 4096;
  const DType c = gpu ? DType::BF16 : DType::F32;
  const double cs = double(dtype_size(c));
  auto report = [&](const char* what, double& into, double bytes, double seconds) {
    into = bytes / seconds;
    say(root, std::string(what) + ": " + rate(into, 1e9, "GB/s"));
  };
  {
    const int64_t n = gpu ? (int64_t(1) << 28) : (int64_t(1) << 22);
    Tensor x = b.random(c, {n}), y = b.random(c, {n});
    report("copy", d.copy_bw, op_bytes::copy(double(n), cs), b.time([&] { ops.copy(y, x); }));
  }
  {
    Tensor x = b.random(c, {T, H}), y = b.random(c, {T, H}), w = b.random(c, {H}), dx = b.random(c, {T, H});
    Tensor rstd = b.random(DType::F32, {T}), dw = b.random(DType::F32, {H});
    const double fwd = b.time([&] { ops.rmsnorm_fwd(y, rstd, x, w, 1e-6f); });
    const double bwd = b.time([&] { ops.rmsnorm_bwd(dx, dw, y, x, w, rstd, false); });
    report("RMSNorm", d.norm_bw, op_bytes::norm(T, H, cs, false) + op_bytes::norm(T, H, cs, true), fwd + bwd);
  }
  {
    Tensor x = b.random(c, {T, heads, D}), pos = b.random(DType::I32, {T}, 0, T);
    report("RoPE", d.rope_bw, op_bytes::rope(T, heads * D, cs), b.time([&] { ops.rope_fwd(x, pos, 1e6f); }));
  }
  {
    const int64_t M = T * K;
    Tensor gu = b.random(c, {M, 2 * F}), h = b.random(c, {M, F}), dgu = b.random(c, {M, 2 * F});
    const double fwd = b.time([&] { ops.swiglu_fwd(h, gu); });
    const double bwd = b.time([&] { ops.swiglu_bwd(dgu, h, gu); });
    report("SwiGLU", d.swiglu_bw, op_bytes::swiglu(M, F, cs, false) + op_bytes::swiglu(M, F, cs, true), fwd + bwd);
  }
  {
    Tensor x = b.random(c, {T, H}), xp = b.random(c, {T * K, H}), src = b.random(DType::I32, {T * K}, 0, T);
    report("permute", d.permute_bw, op_bytes::gather(T * K, H, cs), b.time([&] { ops.moe_permute_fwd(xp, x, src); }));
  }
  {
    Tensor logits = b.random(DType::F32, {T, E}), probs = b.random(DType::F32, {T, E});
    Tensor lse = b.random(DType::F32, {T}), idx = b.random(DType::I32, {T, K}, 0, E);
    Tensor w = b.random(DType::F32, {T, K});
    report("router", d.router_bw, op_bytes::router(T, E, K),
           b.time([&] { ops.router_fwd(idx, w, probs, lse, logits, true); }));
  }
  {
    Tensor table = b.random(c, {V, H}), ids = b.random(DType::I32, {T}, 0, V), out = b.random(c, {T, H});
    Tensor dtable = b.random(DType::F32, {V, H});
    const double fwd = b.time([&] { ops.embedding_fwd(out, ids, table); });
    const double bwd = b.time([&] { ops.embedding_bwd(dtable, ids, out); });
    report("embedding", d.embedding_bw, op_bytes::embedding(T, H, cs, false) + op_bytes::embedding(T, H, cs, true), fwd + bwd);
  }
  {
    const int64_t n = gpu ? (int64_t(1) << 27) : (int64_t(1) << 20);
    Tensor p = b.random(DType::F32, {n}, 0.1), m = b.random(DType::F32, {n}, 1e-3), v = b.random(DType::F32, {n}, 1e-6);
    Tensor g = b.random(DType::F32, {n}, 1e-3), w = b.random(c, {n});
    AdamWArgs args;
    args.lr = 1e-4f;
    report("AdamW", d.adamw_bw, op_bytes::adamw(double(n), 4, cs), b.time([&] { ops.adamw_step_cast(p, m, v, g, args, w); }));
    Buffer sums(ops.device() == Device::CPU ? MemKind::Host : MemKind::Device, 4 * sizeof(int64_t));
    Tensor out(sums.data(), DType::I64, {4}, ops.device());
    report("sum of squares", d.reduce_bw, double(n) * 4, b.time([&] { ops.sumsq(out, g); }));
    Tensor one = b.random(DType::F32, {1});
    d.launch_seconds = b.time([&] { ops.fill(one, 0); }, 0.01, 200);
    float host = 0;
    d.sync_seconds = b.time([&] { ops.copy(Tensor(&host, DType::F32, {1}), one); }, 0.01, 200);
    say(root, "launch " + rate(d.launch_seconds, 1e-6, "µs, ") + "host round trip " +
                  rate(d.sync_seconds, 1e-6, "µs"));
  }
  b.release();
}

// Backend workspaces at q3moe-8l's shapes for two micro-batch sizes: base + per token (the LM
// head's chunk buffer, which the plan adds itself, left out).
void workspaces(Device dev, int local_rank, DeviceSpec& d, bool root) {
  if (dev == Device::CPU) {
    d.workspace_bytes = d.workspace_bytes_per_token = 0;
    return;
  }
  double bytes[2];
  const int64_t tokens[2] = {4096, 16384};
  for (int i = 0; i < 2; ++i) {
    std::unique_ptr<Ops> ops = make_ops(dev, local_rank);
    OpShapes s;
    s.max_tokens = tokens[i], s.batch = 1, s.seq = tokens[i];
    s.heads = 32, s.kv_heads = 4, s.head_dim = 128, s.hidden = 2048, s.experts = 128, s.top_k = 8;
    s.expert_ffn = 768, s.vocab = 151936, s.lm_head_chunk = 1024;
    ops->prepare(s);
    bytes[i] = double(ops->workspace_bytes()) - double(s.lm_head_chunk * s.vocab * 2);
  }
  d.workspace_bytes_per_token = std::max(0.0, (bytes[1] - bytes[0]) / double(tokens[1] - tokens[0]));
  d.workspace_bytes = std::max(0.0, bytes[0] - d.workspace_bytes_per_token * double(tokens[0]));
  say(root, "workspaces: " + format_bytes(d.workspace_bytes) + " + " +
                rate(d.workspace_bytes_per_token, 1, "bytes per token"));
}

// The host: memory, cores, the AdamW engine alone and beside pinned copies, memory bandwidth.
void host(Device dev, HostSpec& h, LinkSpec& l, bool root) {
  h.memory_bytes = double(memory_info(Device::CPU).total);
  h.cores = host_cores();
  const bool gpu = dev != Device::CPU;
  ThreadPool pool(0);
  const int64_t n = gpu ? (int64_t(1) << 27) : (int64_t(1) << 22);
  HostAdamWBenchState st(n, gpu ? MemKind::Pinned : MemKind::Host);
  st.fill(pool);
  AdamWArgs args;
  args.lr = 1e-4f, args.weight_decay = 0.1f, args.bias_correction1 = 0.1f, args.bias_correction2 = 0.05f;
  const std::string bad = st.validate(pool, args, best_simd_isa());
  MOP_CHECK(bad.empty(), "host AdamW engine: ", bad);
  auto timed = [&](const HostAdamWRange& r) {
    host_adamw_run(pool, r, args);  // warm
    const double t0 = now();
    host_adamw_run(pool, r, args);
    host_adamw_run(pool, r, args);
    return (now() - t0) / 2;
  };
  HostAdamWRange weights = st.r, state = st.r;
  weights.write_state = false;
  state.weights = nullptr;
  const double one = timed(st.r);
  h.adamw_one_pass = double(n) / one;
  h.adamw_weights_pass = double(n) / timed(weights);
  h.adamw_state_pass = double(n) / timed(state);
  say(root, "host AdamW (" + std::to_string(pool.num_threads()) + " threads): " +
                rate(h.adamw_one_pass, 1e9, "G params/s one pass, ") +
                rate(h.adamw_weights_pass, 1e9, "weights pass, ") + rate(h.adamw_state_pass, 1e9, "state pass"));
  {  // host memory bandwidth: a threaded copy between two buffers
    const int64_t bytes = gpu ? (int64_t(1) << 30) : (int64_t(1) << 26);
    Buffer a(MemKind::Host, size_t(bytes)), c(MemKind::Host, size_t(bytes));
    auto copy = [&] {
      pool.run(bytes, int64_t(1) << 22, [&](int64_t b0, int64_t b1) {
        std::memcpy(static_cast<char*>(c.data()) + b0, static_cast<char*>(a.data()) + b0, size_t(b1 - b0));
      });
    };
    copy();
    const double t0 = now();
    copy();
    h.dram_bw = 2.0 * double(bytes) / (now() - t0);
    say(root, "host memory: " + rate(h.dram_bw, 1e9, "GB/s"));
  }
  if (!gpu) return;
  // Pinned copies, each way and both at once; then AdamW while both run.
  const size_t bytes = size_t(1) << 30;
  Buffer up(MemKind::Pinned, bytes), down(MemKind::Pinned, bytes), d1(MemKind::Device, bytes),
      d2(MemKind::Device, bytes);
  OwnedStream s1(dev), s2(dev);
  auto copies = [&](bool h2d, bool d2h, int reps) {
    const double t0 = now();
    for (int i = 0; i < reps; ++i) {
      if (h2d) copy_async(d1.data(), up.data(), bytes, s1.get());
      if (d2h) copy_async(down.data(), d2.data(), bytes, s2.get());
    }
    s1.get().synchronize(), s2.get().synchronize();
    return now() - t0;
  };
  copies(true, true, 1);
  l.h2d = 3.0 * double(bytes) / copies(true, false, 3);
  l.d2h = 3.0 * double(bytes) / copies(false, true, 3);
  l.both = 6.0 * double(bytes) / copies(true, true, 3);
  say(root, "pinned copies: " + rate(l.h2d, 1e9, "GB/s to the device, ") + rate(l.d2h, 1e9, "GB/s back, ") +
                rate(l.both, 1e9, "GB/s both at once"));
  for (int i = 0; i < 8; ++i) {
    copy_async(d1.data(), up.data(), bytes, s1.get());
    copy_async(down.data(), d2.data(), bytes, s2.get());
  }
  const double with = timed(st.r);
  s1.get().synchronize(), s2.get().synchronize();
  h.adamw_under_copies = std::min(1.0, one / with);
  say(root, "host AdamW beside copies both ways: × " + rate(h.adamw_under_copies, 1, ""));
}

// Collectives over all ranks: in one node they describe the node's links, across nodes the
// network's.
void collectives(Ops& ops, Bench& b, World& world, LinkSpec& l, bool gpu, bool root) {
  if (world.size < 2) return;
  std::unique_ptr<Comm> comm =
      make_comm_factory(world)->data(world_group(world.size, world.rank), ops.device(), ops.stream());
  const bool net = world.local_size < world.size;
  const int n = world.size;
  const int64_t elems = gpu ? (int64_t(1) << 26) : (int64_t(1) << 20);
  Tensor x = b.random(DType::F32, {elems}), y = b.random(DType::F32, {elems});
  const double bytes = double(elems) * 4;
  auto sync_time = [&](const std::function<void()>& fn) {
    comm->barrier();
    return b.time(fn, 0.05, 20);
  };
  const double ar = bytes * 2.0 * (n - 1) / n / sync_time([&] { comm->all_reduce_sum(x); });
  const std::vector<int64_t> counts(size_t(n), elems / n);
  const int64_t rows = elems / n * n;
  Tensor xr = x.rows(0, rows).view({rows, 1}), yr = y.rows(0, rows).view({rows, 1});
  const double a2a = bytes * (n - 1) / n / sync_time([&] { comm->all_to_all_v(yr, counts, xr, counts); });
  const int next = (world.rank + 1) % n, prev = (world.rank + n - 1) % n;
  const double sr = bytes / sync_time([&] { comm->send_recv(y, prev, x, next); });
  Tensor one = x.rows(0, 2);
  const double lat = sync_time([&] { comm->all_reduce_sum(one); });
  (net ? l.net_all_reduce : l.node_all_reduce) = ar;
  (net ? l.net_all_to_all : l.node_all_to_all) = a2a;
  (net ? l.net_send_recv : l.node_send_recv) = sr;
  (net ? l.net_latency : l.node_latency) = lat;
  say(root, std::string(net ? "network" : "in the node") + " (" + std::to_string(n) + " ranks): all-reduce " +
                rate(ar, 1e9, "GB/s bus, all-to-all ") + rate(a2a, 1e9, "GB/s bus, ring shift ") +
                rate(sr, 1e9, "GB/s, latency ") + rate(lat, 1e-6, "µs"));
  b.release();
}

// The in-step factors: args.step_config's step, run here as one rank of its own (random tokens,
// four steps), measured by category over what the rates just measured predict for it.
void step_factors(const CalibrateArgs& args, Machine& m, bool root) {
  const Config cfg = load_config(args.step_config, args.step_overrides);
  Machine one = m;
  one.gpus_per_node = 1, one.nodes = 1;
  one.device.in_step.fill(1);
  const RankTimes r = time_rank(cfg, one, 1, 0, 4);
  std::string line;
  for (int c = 0; c < kNumOpCategories; ++c) {
    if (OpCategory(c) == OpCategory::Communication) continue;
    const double predicted = r.plan.time.seconds[size_t(c)], measured = r.times.seconds[size_t(c)];
    // Categories of under a millisecond are left alone: their ratio is noise.
    const double f = predicted > 1e-3 && measured > 1e-3 ? std::clamp(measured / predicted, 0.05, 20.0) : 1.0;
    m.device.in_step[size_t(c)] = f;
    line += fmt::format("{}{} {:.0f}/{:.0f} ms = {:.3f}", line.empty() ? "" : ", ", op_category_name(OpCategory(c)),
                        1e3 * measured, 1e3 * predicted, f);
  }
  say(root, "in-step factors from " + args.step_config + " (measured/predicted per step): " + line);
}

}  // namespace

int cmd_calibrate(const CalibrateArgs& args, World& world) {
  MOP_USER_CHECK(args.step_config.empty() || world.size == 1, "--step runs on one rank; calibrate the node's "
                 "collectives under mpirun without it");
  const bool gpu = args.device != "cpu" && gpu_count() > 0;
  MOP_USER_CHECK(args.device != "cuda" || gpu, "--device cuda: no CUDA device is available",
                 cuda_built() ? "" : " (this mop was built without CUDA)");
  const Device dev = gpu ? Device::CUDA : Device::CPU;
  const bool root = world.is_root();
  if (gpu) select_gpu(world.local_rank % gpu_count());
  // What this machine's measurements do not cover (the collectives without mpirun, the network)
  // comes from the built-in description of its GPU.
  std::string note;
  Machine m = builtin_machine(gpu ? builtin_for_gpu(gpu_name(), &note) : "cpu");
  if (!note.empty())
    say(root, "what this does not measure (collectives without mpirun, the network) comes from the built-in " +
                  m.base + ", which is not this GPU's own description");
  m.origin = "measured here by mop calibrate (what it does not measure: the built-in " + m.base + "'s)";
  const double t0 = now();
  std::unique_ptr<Ops> ops = make_ops(dev, world.local_rank);
  Bench bench(*ops);
  DeviceSpec& d = m.device;
  d.kind = dev;
  d.name = gpu ? gpu_name() : "CPU backend";
  d.memory_bytes = double(memory_info(dev).free);
  m.gpus_per_node = world.local_size;
  m.nodes = std::max(1, world.size / std::max(1, world.local_size));
  say(root, d.name + ": " + format_bytes(d.memory_bytes) + " free per rank, " + std::to_string(world.size) +
                " rank(s), " + std::to_string(world.local_size) + " per node");
  dense_gemm(*ops, bench, d, gpu, root);
  grouped_gemm(*ops, bench, d, gpu, root);
  attention(*ops, bench, d, gpu, root);
  lm_head(*ops, bench, d, gpu, root);
  memory_bound(*ops, bench, d, gpu, root);
  if (!gpu) d.peak_flops = d.gemm_fwd.points.back().second;
  workspaces(dev, world.local_rank, d, root);
  host(dev, m.host, m.link, root);
  collectives(*ops, bench, world, m.link, gpu, root);
  m.name = "calibrated: " + d.name + (world.size > 1 ? " × " + std::to_string(world.size) : std::string());
  ops.reset();
  if (!args.step_config.empty()) step_factors(args, m, root);
  say(root, "done in " + rate(now() - t0, 1, "s"));
  if (!root) return 0;
  const std::string yaml = machine_yaml(m);
  if (args.out.empty()) {
    std::fputs(yaml.c_str(), stdout);
  } else {
    std::ofstream out(args.out);
    MOP_USER_CHECK(out.good(), "--out ", args.out, ": cannot write");
    out << yaml;
    MOP_USER_CHECK(out.good(), "--out ", args.out, ": write failed");
    std::fprintf(stderr, "calibrate: wrote %s\n", args.out.c_str());
  }
  return 0;
}

}  // namespace mop
