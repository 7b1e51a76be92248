// [gpu][attention] CudaOps GQA attention, causal and full (cuDNN flash attention; S = 1 through
// cuBLAS), against the CPU reference on bf16-exact inputs: out, lse, dq, dk, dv for S = 1 (MHA and
// GQA), a tiny MHA sequence, a prime S with GQA 2, MQA (8 query heads on one kv head) and GQA 2
// with B = 3; outputs poisoned first; forward bitwise reproducible, backward reproducibility
// reported (cuDNN's default dq uses atomics) and checked in the opt-in deterministic mode; prepare
// sizes the workspace for the step's shapes (both masks); head dims cuDNN cannot run are a
// UserError. The merge of partial results (ring attention) against the CPU reference over awkward
// shapes, with empty accumulators and partials that saw no key; ring attention on one GPU (its
// causal and full blocks, merges and gradient sums) against one causal call.
#ifdef MOP_HAVE_CUDA

#include <stdlib.h>

#include <cmath>
#include <sstream>
#include <string>

#include "gpu/gpu_test_util.h"
#include "parallel/ring_attention.h"
#include "ops/ops_test_util.h"
#include "parallel/comm.h"

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

#define MOP_REQUIRE_GPU()              \
  do {                                 \
    if (!gpu_available()) {            \
      WARN("no CUDA device: skipped"); \
      return;                          \
    }                                  \
  } while (0)

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

namespace {

// The merge reads fp32 values, forms its two weights with expf/log1pf and adds in fp32, as the CPU
// reference does with std::exp/std::log in float: a few fp32 ulps apart (2^-23 ≈ 1.2e-7 relative
// each). 1e-5 relative plus 1e-6 of the tensor's max leaves a wide margin; a wrong weight (a
// missing rescale, log2 for ln) is off by O(1).
constexpr double kMergeRtol = 1e-5;
constexpr double kMergeAtolPerMax = 1e-6;

// lse elements compared with equal infinities as equal (both sides empty stays −inf).
int64_t lse_mismatches(const HostTensor& got, const HostTensor& ref, double rtol) {
  int64_t bad = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double x = got.get(i), y = ref.get(i);
    if (!(x == y || std::fabs(x - y) <= rtol * (1 + std::fabs(y)))) ++bad;
  }
  return bad;
}

}  // namespace

TEST_CASE("cuda attention merge equals the CPU reference (awkward shapes, empty sides)",
          "[gpu][attention]") {
  MOP_REQUIRE_GPU();
  CudaOps ops;
  struct MergeCase {
    int batch;
    int64_t seq, heads, dim;
  };
  // 1s, primes, a head dim that is not a multiple of the warp, and a usual one.
  const MergeCase cases[] = {{1, 1, 1, 1}, {2, 7, 3, 5}, {3, 13, 2, 127}, {1, 37, 4, 128}, {2, 1, 5, 31}};
  uint64_t seed = 5000;
  for (const MergeCase& c : cases) {
    INFO("B=" << c.batch << " S=" << c.seq << " H=" << c.heads << " D=" << c.dim);
    const int64_t rows = c.batch * c.seq;
    HostTensor acc = bf16_exact_tensor(DType::F32, {rows, c.heads, c.dim}, seed++);
    HostTensor o = bf16_exact_tensor(DType::F32, {rows, c.heads, c.dim}, seed++);
    HostTensor lse_acc = bf16_exact_tensor(DType::F32, {c.batch, c.heads, c.seq}, seed++, -3, 3);
    HostTensor lse = bf16_exact_tensor(DType::F32, {c.batch, c.heads, c.seq}, seed++, -3, 3);
    // lse element i = (b·H + h)·S + s; its row of out is (b·S + s)·H + h. Every 3rd accumulator
    // is empty (its out poisoned with NaN: it must not be read), every 5th partial saw no key, so
    // every 15th pair is empty on both sides.
    int64_t empty = 0;
    for (int64_t i = 0; i < lse.numel(); ++i) {
      const int64_t b = i / (c.heads * c.seq), h = i / c.seq % c.heads, s = i % c.seq;
      const int64_t row = (b * c.seq + s) * c.heads + h;
      if (i % 5 == 0) lse.set(i, -INFINITY);
      if (i % 3 == 0) {
        lse_acc.set(i, -INFINITY);
        ++empty;
        if (i % 5 != 0)
          for (int64_t x = 0; x < c.dim; ++x) acc.set(row * c.dim + x, std::nan(""));
      }
    }
    CHECK(empty > 0);
    HostTensor ref = acc, ref_lse = lse_acc;
    cpu_ops().attention_merge(ref, ref_lse, o, lse, c.batch);
    DeviceTensor dacc = upload(acc), dlse_acc = upload(lse_acc), d_o = upload(o, DType::BF16);
    DeviceTensor dlse = upload(lse);
    ops.attention_merge(dacc, dlse_acc, d_o, dlse, c.batch);
    const HostTensor got = download(dacc), got_lse = download(dlse_acc);
    double max_ref = 0;
    for (int64_t i = 0; i < ref.numel(); ++i)
      if (std::isfinite(ref.get(i))) max_ref = std::max(max_ref, std::fabs(ref.get(i)));
    CHECK(max_ref > 0);
    // Pairs empty on both sides keep their (here NaN-free) accumulator; no NaN may appear.
    CHECK(count_mismatches(got, ref, kMergeAtolPerMax * max_ref, kMergeRtol) == 0);
    CHECK(lse_mismatches(got_lse, ref_lse, kMergeRtol) == 0);
  }
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

#endif  // MOP_HAVE_CUDA
