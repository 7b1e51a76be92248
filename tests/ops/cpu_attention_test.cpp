// CPU reference GQA attention: forward against an explicit softmax(QKᵀ·scale)V with and without
// the causal mask, finite-difference checks of dq/dk/dv (both masks) over GQA ratios 1, 2, 3 and
// batch > 1, thread-count independence, f32-vs-f64 agreement, and the merge of partial results
// (ring attention) against one attention call over all the keys.
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

namespace {

// Sequence b of a [batch·S, heads, D] tensor, rows [r0, r0 + n) of it, copied into rows [d0, …) of
// sequence b of dst (S_dst rows per sequence).
void copy_rows(HostTensor& dst, int64_t dst_seq, int64_t d0, const HostTensor& src, int64_t src_seq,
               int64_t r0, int64_t n, int b) {
  const int64_t w = src.t.row_numel();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t x = 0; x < w; ++x)
      dst.set((b * dst_seq + d0 + i) * w + x, src.get((b * src_seq + r0 + i) * w + x));
}
}  // namespace

TEST_CASE("attention merge: two partial blocks equal one call over all keys", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  // Keys in two blocks of S: queries see block 1 fully, block 2 fully (both "full") or causally
  // (block 2 holds the queries' own positions, as ring attention's diagonal block does).
  const AttnCase cases[] = {{1, 1, 1, 1, 1}, {2, 7, 3, 1, 5}, {1, 13, 4, 2, 8}, {3, 37, 2, 2, 3}};
  for (DType dt : {DType::F64, DType::F32})
    for (bool causal_second : {false, true})
      for (const AttnCase& c : cases) {
        INFO(dtype_name(dt) << (causal_second ? " causal" : " full") << " second block, batch "
                            << c.batch << " S " << c.seq << " Nq " << c.num_q_heads << " Nkv "
                            << c.num_kv_heads << " D " << c.head_dim);
        const float scale = 0.7f;
        AttnTensors first(dt, c, 80, false), second(dt, c, 90, false);
        second.q = first.q;  // the same queries against two key blocks
        ops.attention_fwd(first.out, first.lse, first.q, first.k, first.v, c.batch, scale, false);
        ops.attention_fwd(second.out, second.lse, second.q, second.k, second.v, c.batch, scale,
                          causal_second);
        // Empty accumulator: lse −inf, out NaN (must not be read).
        HostTensor acc = first.out, acc_lse = first.lse;
        ops.fill(acc, std::nan(""));
        ops.fill(acc_lse, -INFINITY);
        ops.attention_merge(acc, acc_lse, first.out, first.lse, c.batch);
        CHECK(bitwise_equal(acc, first.out));  // weights exactly 0 and 1
        CHECK(bitwise_equal(acc_lse, first.lse));
        ops.attention_merge(acc, acc_lse, second.out, second.lse, c.batch);
        // Reference: queries [q; q] (2S per sequence) against keys [k1; k2], causal: the second
        // half of the queries sits at positions S..2S−1 and sees all of k1 and k2 up to itself.
        AttnCase c2{c.batch, 2 * c.seq, c.num_q_heads, c.num_kv_heads, c.head_dim};
        AttnTensors all(dt, c2, 0, false);
        for (int b = 0; b < c.batch; ++b) {
          copy_rows(all.q, c2.seq, 0, first.q, c.seq, 0, c.seq, b);
          copy_rows(all.q, c2.seq, c.seq, first.q, c.seq, 0, c.seq, b);
          copy_rows(all.k, c2.seq, 0, first.k, c.seq, 0, c.seq, b);
          copy_rows(all.k, c2.seq, c.seq, second.k, c.seq, 0, c.seq, b);
          copy_rows(all.v, c2.seq, 0, first.v, c.seq, 0, c.seq, b);
          copy_rows(all.v, c2.seq, c.seq, second.v, c.seq, 0, c.seq, b);
        }
        ops.attention_fwd(all.out, all.lse, all.q, all.k, all.v, c.batch, scale, causal_second);
        // Causal: the second half of the queries are the rows that see k1 fully and k2 causally;
        // full: either half (the first).
        HostTensor ref(dt, {c.tokens(), c.num_q_heads, c.head_dim}), ref_lse(acc_dtype(dt), {c.batch, c.num_q_heads, c.seq});
        for (int b = 0; b < c.batch; ++b)
          copy_rows(ref, c.seq, 0, all.out, c2.seq, causal_second ? c.seq : 0, c.seq, b);
        for (int64_t bh = 0; bh < c.batch * c.num_q_heads; ++bh)
          for (int64_t i = 0; i < c.seq; ++i)
            ref_lse.set(bh * c.seq + i, all.lse.get(bh * c2.seq + (causal_second ? c.seq : 0) + i));
        // fp32: the merge rescales by exp(lse − lse'), a few ulps of O(1) values per step.
        const double tol = dt == DType::F64 ? kFp64Tol : 1e-5;
        CHECK(max_abs(ref) > 0);
        CHECK(max_abs_diff(acc, ref) < tol);
        CHECK(max_abs_diff(acc_lse, ref_lse) < tol);
        // A partial that saw no keys (lse −inf) leaves the accumulator as it is.
        HostTensor before = acc, before_lse = acc_lse, none_lse = second.lse;
        ops.fill(none_lse, -INFINITY);
        ops.attention_merge(acc, acc_lse, second.out, none_lse, c.batch);
        CHECK(bitwise_equal(acc, before));
        CHECK(bitwise_equal(acc_lse, before_lse));
      }
}

TEST_CASE("attention merge rejects mismatched shapes and dtypes", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  HostTensor acc(DType::F32, {6, 2, 3}), lse(DType::F32, {2, 2, 3}), o(DType::F32, {6, 2, 3});
  ops.fill(lse, 0);
  CHECK_NOTHROW(ops.attention_merge(acc, lse, o, lse, 2));
  CHECK_THROWS_AS(ops.attention_merge(acc, lse, o, lse, 3), Error);  // lse is [2,2,3]
  HostTensor acc64(DType::F64, {6, 2, 3}), o4(DType::F32, {6, 2, 4});
  CHECK_THROWS_AS(ops.attention_merge(acc64, lse, o, lse, 2), Error);
  CHECK_THROWS_AS(ops.attention_merge(acc, lse, o4, lse, 2), Error);
}
