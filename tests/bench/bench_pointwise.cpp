// Pointwise-family benchmarks (mop_bench pointwise): RMSNorm fwd/bwd at T = 4096 and 16384 × 2048
// (and the per-head q-norm shape 131072 × 128), SwiGLU fwd/bwd at 32768 × 768, RoPE on
// q [4096, 32, 128], embedding fwd/bwd with V = 151936, H = 2048 (uniform and Zipf-distributed
// ids), AdamW and the exact sum of squares over 400M parameters. Each op is validated against the
// CPU reference first — on the benchmark shape, or a reduced one where the tensors are too large
// for a quick host reference (embedding: V = 4096; AdamW, sumsq: 2^20 + 3 elements) — then timed. GB/s counts the bytes an op must
// move at the least (what a perfect kernel reads and writes once):
//   rmsnorm fwd   = N·C·2 (x) + N·C·2 (y) + C·2 (w) + N·4 (rstd)
//   rmsnorm bwd   = 2·N·C·2 (x, dy) + N·C·2 (dx) + C·2 (w) + C·8 (dw read and written) + N·4
//   swiglu fwd    = M·2F·2 (gu) + M·F·2 (h);   bwd = M·2F·2 (gu) + M·F·2 (dh) + M·2F·2 (dgu)
//   rope          = 2·T·heads·D·2 (x read and written in place) + T·4 (positions)
//   embedding fwd = T·H·2 (rows read) + T·H·2 (out) + T·4 (ids)
//   embedding bwd = T·H·2 (dout) + U·H·8 (the U distinct ids' dtable rows read and written) + T·4
//   adamw         = 4·(2 + 2 + 2)·n (param, m, v read and written) + 4·n (f32 grad)
//   sumsq         = 4·n (f32 gradient read once; the exact sum of squares of the global norm)
#ifdef MOP_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <string>
#include <unordered_set>
#include <vector>

#include "bench.h"
#include "runtime/cuda_check.h"
#include "core/rng.h"
#include "gpu/pointwise_test_util.h"
#include "ops/cuda_ops.h"

namespace mop::bench {
namespace {

using test::DeviceTensor;
using test::HostTensor;
namespace pw = test::pw;

// Tolerances as in tests/gpu/pointwise_*_test.cpp (reasons there).
constexpr double kRstdRtol = 4e-5;
constexpr double kNormRtol = pw::kBf16Rtol + kRstdRtol;
constexpr double kDxAtolScale = 1e-5;
constexpr double kDwRtol = 1e-5;
constexpr double kSwigluRtol = pw::kBf16Rtol + 1e-5, kSwigluAtol = 1e-4;
constexpr double kRopeAtol = 1e-6;
constexpr double kLongRunRtol = 1e-6;

constexpr int64_t kVocab = 151936, kHidden = 2048;  // q3moe-8l

bool close(const HostTensor& got, const HostTensor& ref, double atol, double rtol) {
  return pw::mismatches(got, ref, atol, rtol) == 0;
}

double largest(const HostTensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t.get(i)));
  return m;
}

std::string dims(int64_t a, int64_t b) {
  return std::to_string(a) + "×" + std::to_string(b);
}

// ---- RMSNorm ----------------------------------------------------------------------------------

void bench_rmsnorm(int64_t rows, int64_t cols) {
  CudaOps ops;
  const float eps = 1e-6f;
  const HostTensor x = pw::random_f32({rows, cols}, 1, -2, 2);
  const HostTensor w = pw::random_f32({cols}, 2, -1.5, 1.5);
  const HostTensor dy = pw::random_f32({rows, cols}, 3);
  HostTensor y_ref(DType::F32, {rows, cols}), rstd_ref(DType::F32, {rows});
  pw::cpu().rmsnorm_fwd(y_ref, rstd_ref, x, w, eps);
  HostTensor dx_ref(DType::F32, {rows, cols}), dw_ref(DType::F32, {cols});
  pw::cpu().rmsnorm_bwd(dx_ref, dw_ref, dy, x, w, rstd_ref, false);
  std::vector<double> dw_scale(static_cast<size_t>(cols), 0.0);
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t c = 0; c < cols; ++c)
      dw_scale[size_t(c)] +=
          std::fabs(dy.get(n * cols + c) * x.get(n * cols + c) * rstd_ref.get(n));

  DeviceTensor d_x = pw::upload_at(x, DType::BF16), d_w = pw::upload_at(w, DType::BF16);
  DeviceTensor d_dy = pw::upload_at(dy, DType::BF16);
  DeviceTensor y = pw::poisoned(DType::BF16, {rows, cols}), rstd = pw::poisoned(DType::F32, {rows});
  ops.rmsnorm_fwd(y.t, rstd.t, d_x.t, d_w.t, eps);
  const bool fwd_valid = close(test::download(y.t), y_ref, 1e-6, kNormRtol) &&
                         close(test::download(rstd.t), rstd_ref, 0, kRstdRtol);

  DeviceTensor d_rstd = pw::upload_at(rstd_ref, DType::F32);
  DeviceTensor dx = pw::poisoned(DType::BF16, {rows, cols});
  DeviceTensor dw = pw::upload_at(HostTensor(DType::F32, {cols}), DType::F32);
  ops.rmsnorm_bwd(dx.t, dw.t, d_dy.t, d_x.t, d_w.t, d_rstd.t, false);
  bool bwd_valid =
      close(test::download(dx.t), dx_ref, kDxAtolScale * largest(dx_ref) + 1e-6, pw::kBf16Rtol);
  const HostTensor dw_got = test::download(dw.t);
  for (int64_t c = 0; c < cols; ++c)
    bwd_valid = bwd_valid &&
                std::fabs(dw_got.get(c) - dw_ref.get(c)) <= kDwRtol * dw_scale[size_t(c)] + 1e-7;

  const double elems = double(rows) * double(cols);
  const double fwd_bytes = 4 * elems + 2.0 * double(cols) + 4.0 * double(rows);
  const double bwd_bytes = 6 * elems + 10.0 * double(cols) + 4.0 * double(rows);
  const double fwd_ms =
      time_ms([&] { ops.rmsnorm_fwd(y.t, rstd.t, d_x.t, d_w.t, eps); }, ops.cuda_stream());
  report("rmsnorm_fwd [" + dims(rows, cols) + "]", fwd_valid, fwd_ms, 0, fwd_bytes, kHbmGBps);
  const double bwd_ms = time_ms(
      [&] { ops.rmsnorm_bwd(dx.t, dw.t, d_dy.t, d_x.t, d_w.t, d_rstd.t, false); }, ops.cuda_stream());
  report("rmsnorm_bwd [" + dims(rows, cols) + "]", bwd_valid, bwd_ms, 0, bwd_bytes, kHbmGBps);
}

MOP_BENCH("rmsnorm T=4096") {
  bench_rmsnorm(4096, kHidden);
}
MOP_BENCH("rmsnorm T=16384") {
  bench_rmsnorm(16384, kHidden);
}
MOP_BENCH("rmsnorm q-norm T=4096") {
  bench_rmsnorm(4096 * 32, 128);
}
MOP_BENCH("rmsnorm q-norm T=16384") {
  bench_rmsnorm(16384 * 32, 128);
}

// ---- SwiGLU -----------------------------------------------------------------------------------

MOP_BENCH("swiglu") {
  CudaOps ops;
  const int64_t rows = 32768, width = 768;
  const HostTensor gu = pw::random_f32({rows, 2 * width}, 11, -4, 4);
  const HostTensor dh = pw::random_f32({rows, width}, 12);
  HostTensor h_ref(DType::F32, {rows, width}), dgu_ref(DType::F32, {rows, 2 * width});
  pw::cpu().swiglu_fwd(h_ref, gu);
  pw::cpu().swiglu_bwd(dgu_ref, dh, gu);
  DeviceTensor d_gu = pw::upload_at(gu, DType::BF16), d_dh = pw::upload_at(dh, DType::BF16);
  DeviceTensor h = pw::poisoned(DType::BF16, {rows, width});
  DeviceTensor dgu = pw::poisoned(DType::BF16, {rows, 2 * width});
  ops.swiglu_fwd(h.t, d_gu.t);
  ops.swiglu_bwd(dgu.t, d_dh.t, d_gu.t);
  const bool fwd_valid = close(test::download(h.t), h_ref, 1e-6, kSwigluRtol);
  const bool bwd_valid = close(test::download(dgu.t), dgu_ref, kSwigluAtol, kSwigluRtol);
  const double elems = double(rows) * double(width);
  const double fwd_ms = time_ms([&] { ops.swiglu_fwd(h.t, d_gu.t); }, ops.cuda_stream());
  report("swiglu_fwd [" + dims(rows, width) + "]", fwd_valid, fwd_ms, 0, 6 * elems, kHbmGBps);
  const double bwd_ms = time_ms([&] { ops.swiglu_bwd(dgu.t, d_dh.t, d_gu.t); }, ops.cuda_stream());
  report("swiglu_bwd [" + dims(rows, width) + "]", bwd_valid, bwd_ms, 0, 10 * elems, kHbmGBps);
}

// ---- RoPE -------------------------------------------------------------------------------------

MOP_BENCH("rope") {
  CudaOps ops;
  const int64_t tokens = 4096, heads = 32, dim = 128;
  const float theta = 1e6f;
  const HostTensor x = pw::random_f32({tokens, heads, dim}, 21);
  HostTensor pos(DType::I32, {tokens});
  for (int64_t t = 0; t < tokens; ++t) pos.ptr<int32_t>()[t] = int32_t(t);
  HostTensor ref = x;
  pw::cpu().rope_fwd(ref, pos, theta);
  DeviceTensor d_x = pw::upload_at(x, DType::BF16), d_pos = pw::upload_at(pos, DType::I32);
  ops.rope_fwd(d_x.t, d_pos.t, theta);
  const bool valid = close(test::download(d_x.t), ref, kRopeAtol, pw::kBf16Rtol);
  const double bytes = 4.0 * double(tokens * heads * dim) + 4.0 * double(tokens);
  std::string shape = "[";
  shape += std::to_string(tokens) + "," + std::to_string(heads) + "," + std::to_string(dim) + "]";
  const double fwd_ms = time_ms([&] { ops.rope_fwd(d_x.t, d_pos.t, theta); }, ops.cuda_stream());
  report("rope_fwd q " + shape, valid, fwd_ms, 0, bytes, kHbmGBps);
  const double bwd_ms = time_ms([&] { ops.rope_bwd(d_x.t, d_pos.t, theta); }, ops.cuda_stream());
  report("rope_bwd q " + shape, valid, bwd_ms, 0, bytes, kHbmGBps);
}

// ---- Embedding --------------------------------------------------------------------------------

// Uniform ids, or Zipf(1) ids (p(k) ∝ 1/(k+1)): natural text, where a few tokens repeat hundreds
// of times per micro-batch and take the backward's long-run path.
std::vector<int32_t> make_ids(int64_t tokens, int64_t vocab, bool zipf, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  std::vector<double> cdf;
  if (zipf) {
    cdf.resize(size_t(vocab));
    double s = 0;
    for (int64_t k = 0; k < vocab; ++k) cdf[size_t(k)] = s += 1.0 / double(k + 1);
    for (double& c : cdf) c /= s;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const uint64_t r = philox_u64(seed, 8, uint64_t(t));
    if (!zipf) {
      ids[size_t(t)] = int32_t(r % uint64_t(vocab));
    } else {
      const double u = double(r >> 11) / 9007199254740992.0;
      const auto it = std::upper_bound(cdf.begin(), cdf.end(), u);
      ids[size_t(t)] = int32_t(std::min<int64_t>(it - cdf.begin(), vocab - 1));
    }
  }
  return ids;
}

HostTensor ids_tensor(const std::vector<int32_t>& ids) {
  HostTensor t(DType::I32, {int64_t(ids.size())});
  std::copy(ids.begin(), ids.end(), t.ptr<int32_t>());
  return t;
}

// Validation at V = 4096 (the same kernels; a host reference of the full table would be 1.2 GB).
bool validate_embedding(CudaOps& ops, int64_t tokens, bool zipf) {
  const int64_t vocab = 4096, hidden = kHidden;
  const HostTensor ids = ids_tensor(make_ids(tokens, vocab, zipf, 31));
  const HostTensor table = pw::random_f32({vocab, hidden}, 32);
  const HostTensor dout = pw::random_f32({tokens, hidden}, 33);
  HostTensor out_ref(DType::F32, {tokens, hidden}), dtable_ref(DType::F32, {vocab, hidden});
  pw::cpu().embedding_fwd(out_ref, ids, table);
  pw::cpu().embedding_bwd(dtable_ref, ids, dout);
  DeviceTensor d_ids = pw::upload_at(ids, DType::I32), d_table = pw::upload_at(table, DType::BF16);
  DeviceTensor d_dout = pw::upload_at(dout, DType::BF16);
  DeviceTensor out = pw::poisoned(DType::BF16, {tokens, hidden});
  DeviceTensor dtable = pw::upload_at(HostTensor(DType::F32, {vocab, hidden}), DType::F32);
  ops.embedding_fwd(out.t, d_ids.t, d_table.t);
  ops.embedding_bwd(dtable.t, d_ids.t, d_dout.t);
  // Σ|dout| per table element bounds the long runs' reordering (zero table to start with).
  HostTensor scale(DType::F32, {vocab, hidden});
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h)
      scale.ptr<float>()[ids.ptr<int32_t>()[t] * hidden + h] +=
          float(std::fabs(dout.get(t * hidden + h)));
  const HostTensor got = test::download(dtable.t);
  bool ok = test::bitwise_equal(test::download(out.t), pw::as_dtype(out_ref, DType::BF16));
  for (int64_t i = 0; i < vocab * hidden && ok; ++i)
    ok = std::fabs(got.get(i) - dtable_ref.get(i)) <= kLongRunRtol * 1.001 * scale.get(i);
  return ok;
}

void bench_embedding(int64_t tokens, bool zipf) {
  CudaOps ops;
  const bool valid = validate_embedding(ops, tokens, zipf);
  const std::vector<int32_t> idv = make_ids(tokens, kVocab, zipf, 34);
  const int64_t distinct = int64_t(std::unordered_set<int32_t>(idv.begin(), idv.end()).size());
  DeviceTensor ids = pw::upload_at(ids_tensor(idv), DType::I32);
  DeviceTensor table(DType::BF16, {kVocab, kHidden}), out(DType::BF16, {tokens, kHidden});
  DeviceTensor dtable(DType::F32, {kVocab, kHidden}), dout(DType::BF16, {tokens, kHidden});
  pw::settle();
  const double th = double(tokens) * double(kHidden);
  const std::string name = "[T=" + std::to_string(tokens) + " V=" + std::to_string(kVocab) +
                           " H=" + std::to_string(kHidden) +
                           (zipf ? " zipf ids]" : " uniform ids]");
  if (!zipf) {
    const double ms = time_ms([&] { ops.embedding_fwd(out.t, ids.t, table.t); }, ops.cuda_stream());
    report("embedding_fwd " + name, valid, ms, 0, 4 * th + 4.0 * double(tokens), kHbmGBps);
  }
  const double ms = time_ms([&] { ops.embedding_bwd(dtable.t, ids.t, dout.t); }, ops.cuda_stream());
  report("embedding_bwd " + name, valid, ms, 0,
         2 * th + 8.0 * double(distinct) * double(kHidden) + 4.0 * double(tokens), kHbmGBps,
         std::to_string(distinct) + " distinct ids");
}

MOP_BENCH("embedding T=4096") {
  bench_embedding(4096, false);
}
MOP_BENCH("embedding T=16384") {
  bench_embedding(16384, false);
}
MOP_BENCH("embedding zipf T=16384") {
  bench_embedding(16384, true);
}

// ---- AdamW ------------------------------------------------------------------------------------

MOP_BENCH("adamw") {
  CudaOps ops;
  AdamWArgs args;
  args.lr = 3e-4f;
  args.weight_decay = 0.1f;
  args.grad_scale = 0.5f;
  args.bias_correction1 = 1.0f - 0.9f;
  args.bias_correction2 = 1.0f - 0.95f;
  bool valid = true;
  {  // bitwise against the reference on 2^20 + 3 elements
    const int64_t n = (int64_t(1) << 20) + 3;
    HostTensor param = pw::random_f32({n}, 41), m = pw::random_f32({n}, 42, -0.01, 0.01);
    HostTensor v = pw::random_f32({n}, 43, 0, 1e-4), grad = pw::random_f32({n}, 44);
    DeviceTensor d_p = pw::upload_at(param, DType::F32), d_m = pw::upload_at(m, DType::F32);
    DeviceTensor d_v = pw::upload_at(v, DType::F32), d_g = pw::upload_at(grad, DType::F32);
    pw::cpu().adamw_step(param, m, v, grad, args);
    ops.adamw_step(d_p.t, d_m.t, d_v.t, d_g.t, args);
    valid = test::bitwise_equal(test::download(d_p.t), param) &&
            test::bitwise_equal(test::download(d_m.t), m) &&
            test::bitwise_equal(test::download(d_v.t), v);
  }
  const int64_t n = 400'000'000;
  DeviceTensor param(DType::F32, {n}), m(DType::F32, {n}), v(DType::F32, {n}),
      grad(DType::F32, {n});
  ops.fill(param.t, 0.5);
  ops.fill(grad.t, 1e-3);
  ops.synchronize();
  const double ms =
      time_ms([&] { ops.adamw_step(param.t, m.t, v.t, grad.t, args); }, ops.cuda_stream(), 10);
  report("adamw_step [400M params, f32 grad]", valid, ms, 0, 28.0 * double(n), kHbmGBps);
}

// ---- exact sum of squares (the global gradient norm) ------------------------------------------

MOP_BENCH("sumsq") {
  CudaOps ops;
  bool valid = true;
  {  // the words of the CPU reference, bit for bit, on 2^20 + 3 elements
    const int64_t n = (int64_t(1) << 20) + 3;
    const HostTensor g = pw::random_f32({n}, 45, -0.1, 0.1);
    HostTensor want(DType::I64, {4});
    pw::cpu().sumsq(want, g);
    DeviceTensor d_g = pw::upload_at(g, DType::F32), out(DType::I64, {4});
    ops.sumsq(out.t, d_g.t);
    valid = test::bitwise_equal(test::download(out.t), want);
  }
  const int64_t n = 400'000'000;
  DeviceTensor grad(DType::F32, {n}), out(DType::I64, {4});
  ops.fill(grad.t, 1e-3);
  ops.synchronize();
  const double ms = time_ms([&] { ops.sumsq(out.t, grad.t); }, ops.cuda_stream(), 10);
  report("sumsq [400M f32 gradients, exact]", valid, ms, 0, 4.0 * double(n), kHbmGBps);
}

}  // namespace
}  // namespace mop::bench

#endif  // MOP_HAVE_CUDA
