// attention: the CPU reference GQA attention against an explicit softmax(QKᵀ·scale)V with and
// without the causal mask, finite differences of dq/dk/dv over GQA ratios 1, 2, 3 and batch > 1,
// thread-count independence, f32-vs-f64 agreement; the CUDA backend (cuDNN; S = 1 through
// cuBLAS) against the reference ([gpu]) on bf16-exact inputs, forward bitwise reproducible, the
// deterministic backward, prepare sizing the workspace, head dims cuDNN cannot run, and ring
// attention and tiled attention on one GPU against one causal call.

#include <cmath>
#include <vector>

#include "ops/attention_test_util.h"
#include "ops/ops_test_util.h"

namespace reference {
using namespace mop;
using namespace mop::test;
using namespace mop::test::attn;

namespace {

// fp64 evaluations of the same formula in a different order differ by a few ulps of O(1) values.
constexpr double kFp64Tol = 1e-12;

// Explicit reference in double: out[t,h] = Σ_j softmax_j(scale·q·k_j) v_j over j ≤ i (causal) or
// all j (full) in the same sequence, lse = log Σ_j exp(scale·q·k_j).
void reference_attention(HostTensor& out, HostTensor& lse, const HostTensor& q, const HostTensor& k,
                         const HostTensor& v, const AttnCase& c, double scale, bool causal) {
  const int64_t group = c.num_q_heads / c.num_kv_heads, d = c.head_dim;
  for (int b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.num_q_heads; ++h)
      for (int64_t i = 0; i < c.seq; ++i) {
        const int64_t qrow = ((b * c.seq + i) * c.num_q_heads + h) * d;
        const int64_t visible = causal ? i + 1 : c.seq;
        std::vector<double> s(static_cast<size_t>(visible));
        double m = -INFINITY;
        for (int64_t j = 0; j < visible; ++j) {
          const int64_t krow = ((b * c.seq + j) * c.num_kv_heads + h / group) * d;
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) dot += q.get(qrow + x) * k.get(krow + x);
          s[size_t(j)] = scale * dot;
          m = std::max(m, s[size_t(j)]);
        }
        double denom = 0;
        for (double sj : s) denom += std::exp(sj - m);
        for (int64_t x = 0; x < d; ++x) {
          double acc = 0;
          for (int64_t j = 0; j < visible; ++j) {
            const int64_t vrow = ((b * c.seq + j) * c.num_kv_heads + h / group) * d;
            acc += std::exp(s[size_t(j)] - m) / denom * v.get(vrow + x);
          }
          out.set(qrow + x, acc);
        }
        lse.set((b * c.num_q_heads + h) * c.seq + i, m + std::log(denom));
      }
}

}  // namespace

TEST_CASE("attention forward equals explicit softmax(QKᵀ)V, causal and full", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  // S = 70 spans three of the kernel's 32-row query blocks.
  const AttnCase cases[] = {{1, 1, 1, 1, 1}, {2, 7, 3, 1, 5},  {1, 13, 4, 2, 8},
                            {3, 5, 2, 2, 3}, {2, 70, 2, 1, 3}, {1, 64, 1, 1, 33}};
  for (bool causal : {true, false})
    for (const AttnCase& c : cases) {
      INFO((causal ? "causal" : "full") << " batch " << c.batch << " S " << c.seq << " Nq "
                                        << c.num_q_heads << " Nkv " << c.num_kv_heads << " D "
                                        << c.head_dim);
      const double scale = 0.9 / std::sqrt(double(c.head_dim));
      AttnTensors t(DType::F64, c, 1, false);
      HostTensor ref_out = t.out, ref_lse = t.lse;
      ops.fill(t.out, std::nan(""));
      ops.fill(t.lse, std::nan(""));
      ops.attention_fwd(t.out, t.lse, t.q, t.k, t.v, c.batch, float(scale), causal);
      reference_attention(ref_out, ref_lse, t.q, t.k, t.v, c, double(float(scale)), causal);
      CHECK(max_abs(ref_out) > 0);
      CHECK(max_abs_diff(t.out, ref_out) < kFp64Tol);
      CHECK(max_abs_diff(t.lse, ref_lse) < kFp64Tol);
    }
  // The masks differ wherever a query has later keys: not a vacuous comparison.
  const AttnCase c{1, 5, 2, 1, 4};
  AttnTensors a(DType::F64, c, 3, false), b = a;
  ops.attention_fwd(a.out, a.lse, a.q, a.k, a.v, 1, 0.5f, true);
  ops.attention_fwd(b.out, b.lse, b.q, b.k, b.v, 1, 0.5f, false);
  CHECK(max_abs_diff(a.out, b.out) > 1e-3);
}

TEST_CASE("attention backward matches finite differences (fp64, GQA 1/2/3, batch > 1)",
          "[cpu][ops]") {
  Ops& ops = cpu_ops();
  // S = 70 crosses two of the kernel's 32-row query block boundaries.
  const AttnCase cases[] = {
      {2, 7, 3, 1, 5}, {1, 5, 2, 2, 3}, {3, 4, 4, 2, 4}, {2, 2, 6, 3, 1}, {1, 70, 2, 1, 2}};
  for (bool causal : {true, false})
    for (const AttnCase& c : cases) {
      INFO((causal ? "causal" : "full") << " batch " << c.batch << " S " << c.seq << " Nq "
                                        << c.num_q_heads << " Nkv " << c.num_kv_heads << " D "
                                        << c.head_dim);
      const float scale = 0.8f;
      AttnTensors t(DType::F64, c, 10, false);
      HostTensor weights = random_tensor(DType::F64, {c.tokens(), c.num_q_heads, c.head_dim}, 20);
      auto loss = [&] {
        ops.attention_fwd(t.out, t.lse, t.q, t.k, t.v, c.batch, scale, causal);
        return weighted_sum(weights, t.out);
      };
      loss();
      HostTensor dq = t.q, dk = t.k, dv = t.v;
      for (HostTensor* g : {&dq, &dk, &dv}) ops.fill(*g, std::nan(""));  // must be overwritten
      ops.attention_bwd(dq, dk, dv, weights, t.q, t.k, t.v, t.out, t.lse, c.batch, scale, causal);
      check_grad("q", t.q, dq, loss);
      check_grad("k", t.k, dk, loss);
      check_grad("v", t.v, dv, loss);
    }
}

TEST_CASE("attention forward and backward are bit-identical with 1 and 2 threads", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const AttnCase c{2, 37, 4, 2, 8};
  for (DType dt : {DType::F32, DType::F64}) {
    AttnTensors a(dt, c, 30, false), b = a;
    HostTensor dout = random_tensor(dt, {c.tokens(), c.num_q_heads, c.head_dim}, 40);
    HostTensor dq1 = a.q, dk1 = a.k, dv1 = a.v, dq2 = a.q, dk2 = a.k, dv2 = a.v;
    with_threads(1, [&] {
      ops.attention_fwd(a.out, a.lse, a.q, a.k, a.v, c.batch, 0.3f, true);
      ops.attention_bwd(dq1, dk1, dv1, dout, a.q, a.k, a.v, a.out, a.lse, c.batch, 0.3f, true);
    });
    with_threads(2, [&] {
      ops.attention_fwd(b.out, b.lse, b.q, b.k, b.v, c.batch, 0.3f, true);
      ops.attention_bwd(dq2, dk2, dv2, dout, b.q, b.k, b.v, b.out, b.lse, c.batch, 0.3f, true);
    });
    INFO(dtype_name(dt));
    CHECK(max_abs(a.out) > 0);
    CHECK(bitwise_equal(a.out, b.out));
    CHECK(bitwise_equal(a.lse, b.lse));
    CHECK(bitwise_equal(dq1, dq2));
    CHECK(bitwise_equal(dk1, dk2));
    CHECK(bitwise_equal(dv1, dv2));
  }
}

TEST_CASE("attention in f32 agrees with f64 to fp32 tolerance", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const AttnCase c{2, 11, 4, 2, 6};
  AttnTensors t64(DType::F64, c, 50, true);
  AttnTensors t32(DType::F32, c, 50, true);
  REQUIRE(max_abs_diff(t32.q, t64.q) == 0);
  HostTensor dout64 = bf16_exact_tensor(DType::F64, {c.tokens(), c.num_q_heads, c.head_dim}, 60);
  HostTensor dout32 = converted(dout64, DType::F32);
  HostTensor dq64 = t64.q, dk64 = t64.k, dv64 = t64.v, dq32 = t32.q, dk32 = t32.k, dv32 = t32.v;
  ops.attention_fwd(t64.out, t64.lse, t64.q, t64.k, t64.v, c.batch, 0.4f, true);
  ops.attention_fwd(t32.out, t32.lse, t32.q, t32.k, t32.v, c.batch, 0.4f, true);
  ops.attention_bwd(dq64, dk64, dv64, dout64, t64.q, t64.k, t64.v, t64.out, t64.lse, c.batch, 0.4f, true);
  ops.attention_bwd(dq32, dk32, dv32, dout32, t32.q, t32.k, t32.v, t32.out, t32.lse, c.batch, 0.4f, true);
  CHECK(max_abs_diff(t32.out, t64.out) < kF32VsF64Tol);
  CHECK(max_abs_diff(t32.lse, t64.lse) < kF32VsF64Tol);
  CHECK(max_abs_diff(dq32, dq64) < kF32VsF64Tol);
  CHECK(max_abs_diff(dk32, dk64) < kF32VsF64Tol);
  CHECK(max_abs_diff(dv32, dv64) < kF32VsF64Tol);
}

TEST_CASE("attention rejects inconsistent shapes and dtypes", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const AttnCase c{2, 3, 4, 2, 2};
  AttnTensors t(DType::F32, c, 70, false);
  CHECK_NOTHROW(ops.attention_fwd(t.out, t.lse, t.q, t.k, t.v, 2, 1.0f, true));
  CHECK_THROWS_AS(ops.attention_fwd(t.out, t.lse, t.q, t.k, t.v, 4, 1.0f, true), Error);  // 6 % 4
  CHECK_THROWS_AS(ops.attention_fwd(t.out, t.lse, t.q, t.k, t.v, 3, 1.0f, true), Error);  // lse shape
  HostTensor k3(DType::F32, {6, 3, 2}), lse64(DType::F64, {2, 4, 3}), qb(DType::BF16, {6, 4, 2});
  CHECK_THROWS_AS(ops.attention_fwd(t.out, t.lse, t.q, k3, k3, 2, 1.0f, true), Error);  // 4 % 3 heads
  CHECK_THROWS_AS(ops.attention_fwd(t.out, lse64, t.q, t.k, t.v, 2, 1.0f, true), Error);
  CHECK_THROWS_AS(ops.attention_fwd(t.out, t.lse, qb, t.k, t.v, 2, 1.0f, true), Error);
}

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include <sstream>
#include <stdlib.h>
#include <string>

#include "gpu/gpu_test_util.h"
#include "model/tiled_attention.h"
#include "parallel/ring_attention.h"
#include "runtime/comm.h"

namespace cuda {
using namespace mop;
using namespace mop::test;

namespace {

// Tolerances. u = 2^-8 is bf16's unit roundoff (8 significant bits).
// out: rounded to bf16 once (≤ u·|out|), and P is rounded to bf16 before the P·V product, each term
// erring ≤ u relative, so Σ_j P_j v_j / l errs ≤ u·max|v|. Both bounds doubled for margin.
constexpr double kOutRtol = 2.0 / 256;
constexpr double kOutAtolPerMaxV = 2.0 / 256;
// Each of those two roundings adds ≈ u²/3·E[1/m²] ≈ 2.8e-6 relative variance (m the significand):
// ≈ 6e-6 expected NMSE, 2e-5 allowed. (A wrong mask or scale gives NMSE ≥ 1e-3.)
constexpr double kOutNmse = 2e-5;
// lse is fp32 throughout (fp32 scores, exp2/log with ~1e-6 error at |lse| ≲ 10); 1e-4 absolute
// still catches a log2 instead of ln (44% off) or a missing scale.
constexpr double kLseAtol = 1e-4;
constexpr double kLseNmse = 1e-8;
// Gradients: P and dS are rounded to bf16 before the dV, dK and dQ GEMMs, delta = rowsum(dO ⊙ O)
// uses the bf16 O, and dq/dk/dv are rounded to bf16: about four u-sized roundings, ≈ 1.1e-5
// expected NMSE; 1e-4 allowed. Elementwise errors of a few times u·rms(grad) stay under 2^-6 of the
// tensor's max |grad| (≈ 4·rms) plus 2^-6 relative.
constexpr double kGradRtol = 1.0 / 64;
constexpr double kGradAtolPerMax = 1.0 / 64;
constexpr double kGradNmse = 1e-4;

constexpr const char* kDeterministicEnv = "MOP_ATTN_DETERMINISTIC";

struct AttnCase {
  int batch;
  int64_t seq, num_q_heads, num_kv_heads, head_dim;
  bool causal = true;
  int64_t tokens() const { return batch * seq; }
  // Not 1/√D, so a scale that does not reach cuDNN shows.
  float scale() const { return float(1.25 / std::sqrt(double(head_dim))); }
  std::string str() const {
    std::ostringstream os;
    os << "B=" << batch << " S=" << seq << " Nq=" << num_q_heads << " Nkv=" << num_kv_heads
       << " D=" << head_dim << (causal ? " causal" : " full");
    return os.str();
  }
};

// Inputs (f32 holding bf16-exact values) and the CPU reference's results on them.
struct Reference {
  AttnCase c;
  HostTensor q, k, v, dout, out, lse, dq, dk, dv;
  Reference(const AttnCase& c_, uint64_t seed)
      : c(c_),
        q(bf16_exact_tensor(DType::F32, {c.tokens(), c.num_q_heads, c.head_dim}, seed, -2, 2)),
        k(bf16_exact_tensor(DType::F32, {c.tokens(), c.num_kv_heads, c.head_dim}, seed + 1, -2, 2)),
        v(bf16_exact_tensor(DType::F32, {c.tokens(), c.num_kv_heads, c.head_dim}, seed + 2)),
        dout(bf16_exact_tensor(DType::F32, {c.tokens(), c.num_q_heads, c.head_dim}, seed + 3)),
        out(DType::F32, {c.tokens(), c.num_q_heads, c.head_dim}),
        lse(DType::F32, {c.batch, c.num_q_heads, c.seq}),
        dq(DType::F32, {c.tokens(), c.num_q_heads, c.head_dim}),
        dk(DType::F32, {c.tokens(), c.num_kv_heads, c.head_dim}),
        dv(DType::F32, {c.tokens(), c.num_kv_heads, c.head_dim}) {
    cpu_ops().attention_fwd(out, lse, q, k, v, c.batch, c.scale(), c.causal);
    cpu_ops().attention_bwd(dq, dk, dv, dout, q, k, v, out, lse, c.batch, c.scale(), c.causal);
  }
};

// cudaMemcpy from pageable memory and cudaMemset may still be in flight on the legacy stream when
// they return, and CudaOps' non-blocking stream does not wait for it: drain the device first.
void settle() {
  MOP_CUDA_CHECK(cudaDeviceSynchronize());
}

// The same problem on the device (bf16 compute tensors, fp32 lse).
struct DeviceCase {
  DeviceTensor q, k, v, dout, out, lse, dq, dk, dv;
  explicit DeviceCase(const Reference& r)
      : q(upload(r.q, DType::BF16)),
        k(upload(r.k, DType::BF16)),
        v(upload(r.v, DType::BF16)),
        dout(upload(r.dout, DType::BF16)),
        out(DType::BF16, {r.c.tokens(), r.c.num_q_heads, r.c.head_dim}),
        lse(DType::F32, {r.c.batch, r.c.num_q_heads, r.c.seq}),
        dq(DType::BF16, {r.c.tokens(), r.c.num_q_heads, r.c.head_dim}),
        dk(DType::BF16, {r.c.tokens(), r.c.num_kv_heads, r.c.head_dim}),
        dv(DType::BF16, {r.c.tokens(), r.c.num_kv_heads, r.c.head_dim}) {
    settle();
  }
};

void run_fwd(Ops& ops, DeviceCase& d, const AttnCase& c) {
  poison(d.out);
  poison(d.lse);
  settle();
  ops.attention_fwd(d.out, d.lse, d.q, d.k, d.v, c.batch, c.scale(), c.causal);
}

void run_bwd(Ops& ops, DeviceCase& d, const AttnCase& c) {
  poison(d.dq);
  poison(d.dk);
  poison(d.dv);
  settle();
  ops.attention_bwd(d.dq, d.dk, d.dv, d.dout, d.q, d.k, d.v, d.out, d.lse, c.batch, c.scale(),
                    c.causal);
}

void check_close(const char* what, const HostTensor& got, const HostTensor& ref, double atol,
                 double rtol, double max_nmse) {
  const int64_t bad = count_mismatches(got, ref, atol, rtol);
  const double err = nmse(got, ref);
  INFO(what << ": " << bad << " of " << ref.numel() << " elements outside " << atol << " + " << rtol
            << "·|ref|; NMSE " << err << "; max |ref| " << max_abs(ref));
  CHECK(max_abs(ref) > 0);
  CHECK(bad == 0);
  CHECK(err < max_nmse);
}

void check_forward(const Reference& r, const HostTensor& out, const HostTensor& lse) {
  check_close("out", out, r.out, kOutAtolPerMaxV * max_abs(r.v), kOutRtol, kOutNmse);
  check_close("lse", lse, r.lse, kLseAtol, 0, kLseNmse);
}

void check_backward(const Reference& r, const HostTensor& dq, const HostTensor& dk,
                    const HostTensor& dv) {
  if (r.c.seq == 1) {
    // One key: P = 1 has no gradient, so dq = dk = 0 exactly (the reference, summing dO·v two
    // ways, may leave fp32 rounding noise); dv is the sum of dout over the group's query heads.
    CHECK(max_abs(dq) == 0);
    CHECK(max_abs(dk) == 0);
    CHECK(max_abs(r.dq) < 1e-5);
    CHECK(max_abs(r.dk) < 1e-5);
  } else {
    check_close("dq", dq, r.dq, kGradAtolPerMax * max_abs(r.dq), kGradRtol, kGradNmse);
    check_close("dk", dk, r.dk, kGradAtolPerMax * max_abs(r.dk), kGradRtol, kGradNmse);
  }
  check_close("dv", dv, r.dv, kGradAtolPerMax * max_abs(r.dv), kGradRtol, kGradNmse);
}

// Sets MOP_ATTN_DETERMINISTIC for one scope (read when a CudaOps first runs attention).
class DeterministicEnv {
 public:
  explicit DeterministicEnv(const char* value) {
    if (const char* old = getenv(kDeterministicEnv)) {
      old_ = old;
      had_ = true;
    }
    setenv(kDeterministicEnv, value, 1);
  }
  ~DeterministicEnv() {
    if (had_)
      setenv(kDeterministicEnv, old_.c_str(), 1);
    else
      unsetenv(kDeterministicEnv);
  }

 private:
  std::string old_;
  bool had_ = false;
};

// One case per shape family: S = 1 (the cuBLAS path; MHA and GQA 3 with B = 3), a tiny MHA
// sequence (h_q = h_kv is a separate branch of cuDNN's graph), a prime S with GQA 2, MQA at
// S = 256, and GQA 2 with B = 3.
const AttnCase kCases[] = {{1, 1, 4, 4, 64},  {3, 1, 6, 2, 16},    {2, 3, 2, 2, 64},
                           {2, 37, 4, 2, 64}, {1, 256, 8, 1, 128}, {3, 128, 6, 3, 128}};

}  // namespace

TEST_CASE("cuda attention equals the CPU reference: out, lse, dq, dk, dv", "[gpu][attention]") {
  MOP_REQUIRE_GPU();
  DeterministicEnv env("0");
  CudaOps ops;
  uint64_t seed = 1000;
  for (const AttnCase& c : kCases) {
    INFO(c.str() << " scale " << c.scale());
    const Reference r(c, seed += 10);
    DeviceCase d(r);
    run_fwd(ops, d, c);
    check_forward(r, download(d.out), download(d.lse));
    run_bwd(ops, d, c);
    check_backward(r, download(d.dq), download(d.dk), download(d.dv));
  }
}

TEST_CASE("cuda attention without the causal mask equals the CPU reference", "[gpu][attention]") {
  MOP_REQUIRE_GPU();
  DeterministicEnv env("0");
  CudaOps ops;
  uint64_t seed = 1500;
  for (AttnCase c : kCases) {
    c.causal = false;
    INFO(c.str() << " scale " << c.scale());
    const Reference r(c, seed += 10);
    DeviceCase d(r);
    run_fwd(ops, d, c);
    check_forward(r, download(d.out), download(d.lse));
    run_bwd(ops, d, c);
    check_backward(r, download(d.dq), download(d.dk), download(d.dv));
  }
}

TEST_CASE("cuda attention forward is bitwise reproducible; backward reproducibility reported",
          "[gpu][attention]") {
  MOP_REQUIRE_GPU();
  DeterministicEnv env("0");
  CudaOps ops;
  const AttnCase c{2, 300, 8, 2, 128};  // several key blocks per query block: dq is a true sum
  const Reference r(c, 2000);
  DeviceCase d(r);
  run_fwd(ops, d, c);
  const HostTensor out1 = download(d.out), lse1 = download(d.lse);
  run_bwd(ops, d, c);
  const HostTensor dq1 = download(d.dq), dk1 = download(d.dk), dv1 = download(d.dv);
  run_fwd(ops, d, c);
  CHECK(bitwise_equal(download(d.out), out1));
  CHECK(bitwise_equal(download(d.lse), lse1));
  run_bwd(ops, d, c);
  const bool same = bitwise_equal(download(d.dq), dq1) && bitwise_equal(download(d.dk), dk1) &&
                    bitwise_equal(download(d.dv), dv1);
  // cuDNN's default backward adds dq contributions with fp32 atomics; not a failure by design.
  if (!same)
    WARN(
        "cuDNN attention backward differed between two runs (default, non-deterministic mode; "
        "set MOP_ATTN_DETERMINISTIC=1 for bitwise reproducibility)");
  check_backward(r, dq1, dk1, dv1);
}

TEST_CASE("cuda attention backward in deterministic mode is bitwise reproducible and accurate",
          "[gpu][attention]") {
  MOP_REQUIRE_GPU();
  DeterministicEnv env("1");
  CudaOps ops;
  for (const AttnCase& c : {AttnCase{2, 300, 8, 2, 128}, AttnCase{2, 37, 4, 2, 64}}) {
    INFO(c.str());
    const Reference r(c, 3000 + uint64_t(c.seq));
    DeviceCase d(r);
    run_fwd(ops, d, c);
    check_forward(r, download(d.out), download(d.lse));
    run_bwd(ops, d, c);
    const HostTensor dq1 = download(d.dq), dk1 = download(d.dk), dv1 = download(d.dv);
    check_backward(r, dq1, dk1, dv1);
    run_bwd(ops, d, c);
    CHECK(bitwise_equal(download(d.dq), dq1));
    CHECK(bitwise_equal(download(d.dk), dk1));
    CHECK(bitwise_equal(download(d.dv), dv1));
  }
}

TEST_CASE("cuda attention: prepare sizes the workspace, calls at that shape do not grow it",
          "[gpu][attention]") {
  MOP_REQUIRE_GPU();
  DeterministicEnv env("0");
  CudaOps ops;
  const AttnCase c{2, 96, 4, 2, 64};
  OpShapes shapes;  // small values for the other families, which prepare too
  shapes.max_tokens = c.tokens(), shapes.batch = c.batch, shapes.seq = c.seq;
  shapes.heads = c.num_q_heads, shapes.kv_heads = c.num_kv_heads, shapes.head_dim = c.head_dim;
  shapes.hidden = 64, shapes.experts = 4, shapes.top_k = 2, shapes.expert_ffn = 32;
  shapes.vocab = 128, shapes.lm_head_chunk = 16;
  shapes.attention_non_causal = true;  // ring attention's blocks: both masks
  ops.prepare(shapes);
  const size_t prepared = ops.workspace_bytes();
  for (bool causal : {true, false}) {
    AttnCase cm = c;
    cm.causal = causal;
    INFO(cm.str());
    const Reference r(cm, 4000);
    DeviceCase d(r);
    run_fwd(ops, d, cm);
    run_bwd(ops, d, cm);
    CHECK(ops.workspace_bytes() == prepared);
    check_forward(r, download(d.out), download(d.lse));
    check_backward(r, download(d.dq), download(d.dk), download(d.dv));
  }
}

TEST_CASE("cuda attention rejects head dims cuDNN cannot run", "[gpu][attention]") {
  MOP_REQUIRE_GPU();
  CudaOps ops;
  const AttnCase c{1, 4, 2, 1, 12};  // 12 bf16 = 24-byte head rows: not 16-byte aligned
  DeviceTensor q(DType::BF16, {c.tokens(), c.num_q_heads, c.head_dim});
  DeviceTensor kv(DType::BF16, {c.tokens(), c.num_kv_heads, c.head_dim});
  DeviceTensor out(DType::BF16, {c.tokens(), c.num_q_heads, c.head_dim});
  DeviceTensor lse(DType::F32, {c.batch, c.num_q_heads, c.seq});
  CHECK_USER_ERROR(ops.attention_fwd(out, lse, q, kv, kv, c.batch, c.scale(), true), "D=12");
  CHECK_USER_ERROR(ops.attention_fwd(out, lse, q, kv, kv, c.batch, c.scale(), true), "head dim");
}

TEST_CASE("cuda ring attention on one rank equals causal attention (blocks, merges, sums)",
          "[gpu][attention]") {
  MOP_REQUIRE_GPU();
  DeterministicEnv env("0");
  CudaOps ops;
  auto self = make_self_comm();
  // With one rank the sequence is [chunk 0 ; chunk 1]: three blocks (two causal, one full) per
  // sequence, merged, and dk/dv of chunk 0 summed over two blocks. Tolerances as for one call: the
  // blocks' bf16 outputs and gradients add one rounding each, well inside them.
  const AttnCase cases[] = {{2, 74, 4, 2, 64}, {1, 4, 6, 3, 16}, {3, 128, 8, 1, 128}, {1, 16, 8, 4, 8}};
  uint64_t seed = 6000;
  for (const AttnCase& c : cases) {
    INFO(c.str());
    const int64_t chunk = c.seq / 2;
    const Reference r(c, seed += 10);
    DeviceCase d(r);
    DeviceTensor lse(DType::F32, {2 * c.batch, c.num_q_heads, chunk});
    RingAttention ring(*self, ops, c.batch, int(c.seq), c.num_q_heads, c.num_kv_heads, c.head_dim,
                       DType::BF16);
    poison(d.out);
    poison(lse);
    ring.forward(d.out, lse, d.q, d.k, d.v, c.batch, c.scale());
    // Ring lse block (b, half) row i is position half·c + i of sequence b.
    const HostTensor ring_lse = download(lse);
    HostTensor got_lse(DType::F32, {c.batch, c.num_q_heads, c.seq});
    for (int b = 0; b < c.batch; ++b)
      for (int half = 0; half < 2; ++half)
        for (int64_t h = 0; h < c.num_q_heads; ++h)
          for (int64_t i = 0; i < chunk; ++i)
            got_lse.set((b * c.num_q_heads + h) * c.seq + half * chunk + i,
                        ring_lse.get(((2 * b + half) * c.num_q_heads + h) * chunk + i));
    check_forward(r, download(d.out), got_lse);
    poison(d.dq);
    poison(d.dk);
    poison(d.dv);
    ring.backward(d.dq, d.dk, d.dv, d.dout, d.q, d.k, d.v, d.out, lse, c.batch, c.scale());
    check_backward(r, download(d.dq), download(d.dk), download(d.dv));
  }
}

TEST_CASE("cuda tiled attention equals the CPU reference (blocks, merges, sums)", "[gpu][attention]") {
  MOP_REQUIRE_GPU();
  DeterministicEnv env("0");
  CudaOps ops;
  // (case, tile): several tiles per sequence with batch > 1, GQA 8 with head dim 128, and tiles of
  // two tokens. Tolerances as for one call: every block's bf16 output or gradient adds one
  // rounding before the fp32 merge or sum, well inside them.
  const std::pair<AttnCase, int64_t> cases[] = {{{2, 64, 4, 2, 64}, 16}, {{1, 96, 8, 1, 128}, 32},
                                                {{3, 128, 6, 3, 128}, 64}, {{1, 16, 8, 4, 8}, 2}};
  uint64_t seed = 6500;
  for (const auto& [c, tile] : cases) {
    INFO(c.str() << ", tile " << tile);
    const Reference r(c, seed += 10);
    DeviceCase d(r);
    DeviceTensor lse(DType::F32, {c.batch * c.num_q_heads * c.seq});
    TiledAttention tiled(ops, tile, c.seq, c.num_q_heads, c.num_kv_heads, c.head_dim, DType::BF16);
    poison(d.out);
    poison(lse);
    tiled.forward(d.out, lse, d.q, d.k, d.v, c.batch, c.scale());
    // The tiled lse is tile-major: tile i of sequence b is [Nq, tile] at (b·S + i·tile)·Nq.
    const HostTensor tiled_lse = download(lse);
    HostTensor got_lse(DType::F32, {c.batch, c.num_q_heads, c.seq});
    for (int b = 0; b < c.batch; ++b)
      for (int64_t s = 0; s < c.seq; ++s)
        for (int64_t h = 0; h < c.num_q_heads; ++h) {
          const int64_t i0 = s / tile * tile;
          got_lse.set((b * c.num_q_heads + h) * c.seq + s,
                      tiled_lse.get((b * c.seq + i0) * c.num_q_heads + h * tile + (s - i0)));
        }
    check_forward(r, download(d.out), got_lse);
    poison(d.dq);
    poison(d.dk);
    poison(d.dv);
    tiled.backward(d.dq, d.dk, d.dv, d.dout, d.q, d.k, d.v, d.out, lse, c.batch, c.scale());
    check_backward(r, download(d.dq), download(d.dk), download(d.dv));
  }
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
