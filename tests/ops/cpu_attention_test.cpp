// CPU reference causal GQA attention: forward against an explicit softmax(QKᵀ·scale)V with a
// causal mask, finite-difference checks of dq/dk/dv over GQA ratios 1, 2, 3 and batch > 1,
// thread-count independence, and f32-vs-f64 agreement.
#include <cmath>
#include <vector>

#include "ops/ops_test_util.h"

using namespace mop;
using namespace mop::test;

namespace {

// fp64 evaluations of the same formula in a different order differ by a few ulps of O(1) values.
constexpr double kFp64Tol = 1e-12;

struct AttnCase {
  int batch;
  int64_t seq, num_q_heads, num_kv_heads, head_dim;
  int64_t tokens() const { return batch * seq; }
};

// Explicit reference in double: out[t,h] = Σ_j softmax_j(scale·q·k_j) v_j over j ≤ i in the same
// sequence, lse = log Σ_j exp(scale·q·k_j).
void reference_attention(HostTensor& out, HostTensor& lse, const HostTensor& q, const HostTensor& k,
                         const HostTensor& v, const AttnCase& c, double scale) {
  const int64_t group = c.num_q_heads / c.num_kv_heads, d = c.head_dim;
  for (int b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.num_q_heads; ++h)
      for (int64_t i = 0; i < c.seq; ++i) {
        const int64_t qrow = ((b * c.seq + i) * c.num_q_heads + h) * d;
        std::vector<double> s(size_t(i + 1));
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
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
          for (int64_t j = 0; j <= i; ++j) {
            const int64_t vrow = ((b * c.seq + j) * c.num_kv_heads + h / group) * d;
            acc += std::exp(s[size_t(j)] - m) / denom * v.get(vrow + x);
          }
          out.set(qrow + x, acc);
        }
        lse.set((b * c.num_q_heads + h) * c.seq + i, m + std::log(denom));
      }
}

struct AttnTensors {
  HostTensor q, k, v, out, lse;
  AttnTensors(DType dt, const AttnCase& c, uint64_t seed, bool bf16_exact)
      : q(dt, {c.tokens(), c.num_q_heads, c.head_dim}),
        k(dt, {c.tokens(), c.num_kv_heads, c.head_dim}),
        v(dt, {c.tokens(), c.num_kv_heads, c.head_dim}),
        out(dt, {c.tokens(), c.num_q_heads, c.head_dim}),
        lse(acc_dtype(dt), {c.batch, c.num_q_heads, c.seq}) {
    for (HostTensor* t : {&q, &k, &v}) {
      if (bf16_exact)
        fill_uniform(*t, seed++, -2, 2);
      else
        fill_random(*t, seed++, -2, 2);
    }
  }
};

}  // namespace

TEST_CASE("attention forward equals explicit causal softmax(QKᵀ)V", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  // S = 70 spans three of the kernel's 32-row query blocks.
  const AttnCase cases[] = {{1, 1, 1, 1, 1}, {2, 7, 3, 1, 5},  {1, 13, 4, 2, 8},
                            {3, 5, 2, 2, 3}, {2, 70, 2, 1, 3}, {1, 64, 1, 1, 33}};
  for (const AttnCase& c : cases) {
    INFO("batch " << c.batch << " S " << c.seq << " Nq " << c.num_q_heads << " Nkv "
                  << c.num_kv_heads << " D " << c.head_dim);
    const double scale = 0.9 / std::sqrt(double(c.head_dim));
    AttnTensors t(DType::F64, c, 1, false);
    HostTensor ref_out = t.out, ref_lse = t.lse;
    ops.fill(t.out, std::nan(""));
    ops.fill(t.lse, std::nan(""));
    ops.attention_fwd(t.out, t.lse, t.q, t.k, t.v, c.batch, float(scale));
    reference_attention(ref_out, ref_lse, t.q, t.k, t.v, c, double(float(scale)));
    CHECK(max_abs(ref_out) > 0);
    CHECK(max_abs_diff(t.out, ref_out) < kFp64Tol);
    CHECK(max_abs_diff(t.lse, ref_lse) < kFp64Tol);
  }
}

TEST_CASE("attention backward matches finite differences (fp64, GQA 1/2/3, batch > 1)",
          "[cpu][ops]") {
  Ops& ops = cpu_ops();
  // S = 70 crosses two of the kernel's 32-row query block boundaries.
  const AttnCase cases[] = {
      {2, 7, 3, 1, 5}, {1, 5, 2, 2, 3}, {3, 4, 4, 2, 4}, {2, 2, 6, 3, 1}, {1, 70, 2, 1, 2}};
  for (const AttnCase& c : cases) {
    INFO("batch " << c.batch << " S " << c.seq << " Nq " << c.num_q_heads << " Nkv "
                  << c.num_kv_heads << " D " << c.head_dim);
    const float scale = 0.8f;
    AttnTensors t(DType::F64, c, 10, false);
    HostTensor weights = random_tensor(DType::F64, {c.tokens(), c.num_q_heads, c.head_dim}, 20);
    auto loss = [&] {
      ops.attention_fwd(t.out, t.lse, t.q, t.k, t.v, c.batch, scale);
      return weighted_sum(weights, t.out);
    };
    loss();
    HostTensor dq = t.q, dk = t.k, dv = t.v;
    for (HostTensor* g : {&dq, &dk, &dv}) ops.fill(*g, std::nan(""));  // must be overwritten
    ops.attention_bwd(dq, dk, dv, weights, t.q, t.k, t.v, t.out, t.lse, c.batch, scale);
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
      ops.attention_fwd(a.out, a.lse, a.q, a.k, a.v, c.batch, 0.3f);
      ops.attention_bwd(dq1, dk1, dv1, dout, a.q, a.k, a.v, a.out, a.lse, c.batch, 0.3f);
    });
    with_threads(2, [&] {
      ops.attention_fwd(b.out, b.lse, b.q, b.k, b.v, c.batch, 0.3f);
      ops.attention_bwd(dq2, dk2, dv2, dout, b.q, b.k, b.v, b.out, b.lse, c.batch, 0.3f);
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
  ops.attention_fwd(t64.out, t64.lse, t64.q, t64.k, t64.v, c.batch, 0.4f);
  ops.attention_fwd(t32.out, t32.lse, t32.q, t32.k, t32.v, c.batch, 0.4f);
  ops.attention_bwd(dq64, dk64, dv64, dout64, t64.q, t64.k, t64.v, t64.out, t64.lse, c.batch, 0.4f);
  ops.attention_bwd(dq32, dk32, dv32, dout32, t32.q, t32.k, t32.v, t32.out, t32.lse, c.batch, 0.4f);
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
  CHECK_NOTHROW(ops.attention_fwd(t.out, t.lse, t.q, t.k, t.v, 2, 1.0f));
  CHECK_THROWS_AS(ops.attention_fwd(t.out, t.lse, t.q, t.k, t.v, 4, 1.0f), Error);  // 6 % 4
  CHECK_THROWS_AS(ops.attention_fwd(t.out, t.lse, t.q, t.k, t.v, 3, 1.0f), Error);  // lse shape
  HostTensor k3(DType::F32, {6, 3, 2}), lse64(DType::F64, {2, 4, 3}), qb(DType::BF16, {6, 4, 2});
  CHECK_THROWS_AS(ops.attention_fwd(t.out, t.lse, t.q, k3, k3, 2, 1.0f), Error);  // 4 % 3 heads
  CHECK_THROWS_AS(ops.attention_fwd(t.out, lse64, t.q, t.k, t.v, 2, 1.0f), Error);
  CHECK_THROWS_AS(ops.attention_fwd(t.out, t.lse, qb, t.k, t.v, 2, 1.0f), Error);
}
