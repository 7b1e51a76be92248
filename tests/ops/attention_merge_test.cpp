// attention_merge: merging partial attention results (ring attention) — on the CPU two partial
// blocks equal one call over all the keys; the CUDA backend against the reference ([gpu]) over
// awkward shapes, empty accumulators and partials that saw no key.

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

}  // namespace

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

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include <sstream>
#include <stdlib.h>
#include <string>

#include "gpu/gpu_test_util.h"
#include "parallel/ring_attention.h"
#include "runtime/comm.h"

namespace cuda {
using namespace mop;
using namespace mop::test;

namespace {

}  // namespace

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

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
