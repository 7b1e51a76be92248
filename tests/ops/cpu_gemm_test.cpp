// CPU reference GEMM and grouped GEMM: all transpose combinations against a naive triple loop,
// alpha/beta, thread-count independence, grouped GEMM against per-expert GEMMs (an expert with no
// rows included) and finite-difference checks of both grouped backwards.
#include <limits>
#include <vector>

#include "ops/ops_test_util.h"

using namespace mop;
using namespace mop::test;

namespace {

// Small-integer inputs make every product and partial sum exact in fp32 (|sum| < 2^24), so the
// fp32 kernel must equal the naive loop bit for bit.
constexpr double kExact = 0;

// The transposed view's element (i, j) of a row-major [rows, cols] matrix.
double elem(const HostTensor& x, bool trans, int64_t i, int64_t j) {
  const int64_t cols = x.t.shape[1];
  return trans ? x.get(j * cols + i) : x.get(i * cols + j);
}

// Independent reference: c = alpha·op(a)·op(b) + beta·c, summed in double.
HostTensor naive_gemm(const HostTensor& c0, const HostTensor& a, bool ta, const HostTensor& b,
                      bool tb, double alpha, double beta) {
  HostTensor c = c0;
  const int64_t m = c.t.shape[0], n = c.t.shape[1];
  const int64_t k = ta ? a.t.shape[0] : a.t.shape[1];
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t kk = 0; kk < k; ++kk) s += elem(a, ta, i, kk) * elem(b, tb, kk, j);
      c.set(i * n + j, alpha * s + beta * c0.get(i * n + j));
    }
  return c;
}

void fill_small_ints(HostTensor& x, uint64_t seed) {
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, double(int(philox_u64(seed, 3, i) % 9) - 4));
}

HostTensor offsets_tensor(const std::vector<int32_t>& offsets) {
  HostTensor o(DType::I32, {int64_t(offsets.size())});
  for (size_t e = 0; e < offsets.size(); ++e) o.ptr<int32_t>()[e] = offsets[e];
  return o;
}

}  // namespace

TEST_CASE("gemm: every transpose combination equals a naive triple loop", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  // Sizes: 1, primes and non-multiples of the 4×32 tile; 37×70 crosses tile edges in both dims.
  const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 5}, {37, 70, 9}, {4, 32, 16}, {5, 33, 1}};
  for (DType dt : {DType::F32, DType::F64})
    for (auto& s : shapes)
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          const int64_t m = s[0], n = s[1], k = s[2];
          HostTensor a = ta ? HostTensor(dt, {k, m}) : HostTensor(dt, {m, k});
          HostTensor b = tb ? HostTensor(dt, {n, k}) : HostTensor(dt, {k, n});
          HostTensor c(dt, {m, n});
          fill_small_ints(a, 1);
          fill_small_ints(b, 2);
          fill_small_ints(c, 3);
          REQUIRE(max_abs(a) > 0);
          for (auto [alpha, beta] :
               std::initializer_list<std::pair<float, float>>{{1, 0}, {2, 1}, {-0.5f, 3}}) {
            INFO(dtype_name(dt) << " m=" << m << " n=" << n << " k=" << k << " ta=" << ta
                                << " tb=" << tb << " alpha=" << alpha << " beta=" << beta);
            HostTensor got = c;
            ops.gemm(got, a, ta, b, tb, alpha, beta);
            CHECK(max_abs_diff(got, naive_gemm(c, a, ta, b, tb, alpha, beta)) == kExact);
          }
        }
}

TEST_CASE("gemm: beta = 0 ignores NaN in c; non-integer inputs match in f32 and f64",
          "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t m = 19, n = 41, k = 23;
  HostTensor a = bf16_exact_tensor(DType::F64, {m, k}, 4);
  HostTensor b = bf16_exact_tensor(DType::F64, {n, k}, 5);
  HostTensor c64(DType::F64, {m, n});
  ops.fill(c64, std::nan(""));
  ops.gemm(c64, a, false, b, true, 1.0f, 0.0f);
  HostTensor ref = naive_gemm(HostTensor(DType::F64, {m, n}), a, false, b, true, 1, 0);
  // Both sum the same fp64 products in k order.
  CHECK(max_abs_diff(c64, ref) == kExact);
  HostTensor c32(DType::F32, {m, n});
  ops.fill(c32, std::nan(""));
  ops.gemm(c32, converted(a, DType::F32), false, converted(b, DType::F32), true, 1.0f, 0.0f);
  CHECK(max_abs_diff(c32, ref) < kF32VsF64Tol);
}

TEST_CASE("gemm: results are bit-identical with 1 and 2 threads", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t m = 67, n = 129, k = 45;
  for (DType dt : {DType::F32, DType::F64}) {
    HostTensor a = random_tensor(dt, {k, m}, 6);
    HostTensor b = random_tensor(dt, {k, n}, 7);
    HostTensor c1 = random_tensor(dt, {m, n}, 8), c2 = c1;
    with_threads(1, [&] { ops.gemm(c1, a, true, b, false, 1.5f, 0.25f); });
    with_threads(2, [&] { ops.gemm(c2, a, true, b, false, 1.5f, 0.25f); });
    CHECK(bitwise_equal(c1, c2));
    CHECK(max_abs(c1) > 0);
  }
}

TEST_CASE("gemm: rejects bad shapes, dtypes and devices", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  HostTensor a(DType::F32, {3, 4}), b(DType::F32, {4, 5}), c(DType::F32, {3, 5});
  HostTensor b_bad(DType::F32, {5, 5}), b64(DType::F64, {4, 5}), a16(DType::BF16, {3, 4});
  CHECK_NOTHROW(ops.gemm(c, a, false, b, false, 1, 0));
  CHECK_THROWS_AS(ops.gemm(c, a, false, b_bad, false, 1, 0), Error);
  CHECK_THROWS_AS(ops.gemm(c, a, false, b64, false, 1, 0), Error);
  CHECK_THROWS_AS(ops.gemm(c, a16, false, b, false, 1, 0), Error);
  CHECK_THROWS_AS(ops.gemm(c, a, true, b, false, 1, 0), Error);
  Tensor on_gpu = c.t;
  on_gpu.device = Device::CUDA;
  CHECK_THROWS_AS(ops.gemm(on_gpu, a, false, b, false, 1, 0), Error);
}

TEST_CASE("grouped gemm forward equals per-expert gemm with copied weights", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t num_experts = 4, n = 11, k = 7;
  // Expert 2 gets no rows; 3 rows past offsets[E] = 9 must stay untouched.
  const std::vector<int32_t> offs = {0, 3, 8, 8, 9};
  const int64_t rows = 12;
  for (DType dt : {DType::F32, DType::F64}) {
    HostTensor offsets = offsets_tensor(offs);
    HostTensor x = random_tensor(dt, {rows, k}, 9);
    HostTensor w = random_tensor(dt, {num_experts, n, k}, 10);
    HostTensor y(dt, {rows, n});
    ops.fill(y, 7.0);
    ops.grouped_gemm_fwd(y, x, w, offsets);
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t r = offs[e + 1] - offs[e];
      if (r == 0) continue;
      HostTensor xe(dt, {r, k}), we(dt, {n, k}), ye(dt, {r, n});
      ops.copy(xe, x.t.rows(offs[e], offs[e + 1]));
      ops.copy(we, w.t.at(e));
      ops.gemm(ye, xe, false, we, true, 1, 0);
      HostTensor got(dt, {r, n});
      ops.copy(got, y.t.rows(offs[e], offs[e + 1]));
      INFO(dtype_name(dt) << " expert " << e);
      CHECK(bitwise_equal(got, ye));
    }
    for (int64_t i = 9 * n; i < rows * n; ++i) CHECK(y.get(i) == 7.0);

    // bwd_data equals dy_e · w_e per expert, bwd_weight adds dy_eᵀ · x_e (and 0 for expert 2).
    HostTensor dy = random_tensor(dt, {rows, n}, 11);
    HostTensor dx(dt, {rows, k});
    ops.grouped_gemm_bwd_data(dx, dy, w, offsets);
    HostTensor dw0 = random_tensor(dt, {num_experts, n, k}, 12), dw = dw0;
    ops.grouped_gemm_bwd_weight(dw, dy, x, offsets);
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t r = offs[e + 1] - offs[e];
      HostTensor we(dt, {n, k}), dwe(dt, {n, k});
      ops.copy(we, w.t.at(e));
      ops.copy(dwe, dw0.t.at(e));
      if (r > 0) {
        HostTensor dye(dt, {r, n}), xe(dt, {r, k}), dxe(dt, {r, k}), got(dt, {r, k});
        ops.copy(dye, dy.t.rows(offs[e], offs[e + 1]));
        ops.copy(xe, x.t.rows(offs[e], offs[e + 1]));
        ops.gemm(dxe, dye, false, we, false, 1, 0);
        ops.copy(got, dx.t.rows(offs[e], offs[e + 1]));
        CHECK(bitwise_equal(got, dxe));
        ops.gemm(dwe, dye, true, xe, false, 1, 1);
      }
      HostTensor got_dw(dt, {n, k});
      ops.copy(got_dw, dw.t.at(e));
      INFO(dtype_name(dt) << " expert " << e);
      CHECK(bitwise_equal(got_dw, dwe));
    }

    // Writing instead of adding (the first micro-batch of a step): the bits of adding to zeros,
    // whatever dw held before (NaN here), and zeros for expert 2, which has no rows.
    HostTensor added(dt, {num_experts, n, k}), written(dt, {num_experts, n, k});
    ops.fill(added, 0);
    ops.fill(written, std::numeric_limits<double>::quiet_NaN());
    ops.grouped_gemm_bwd_weight(added, dy, x, offsets);
    ops.grouped_gemm_bwd_weight(written, dy, x, offsets, /*accumulate=*/false);
    INFO(dtype_name(dt));
    CHECK(bitwise_equal(written, added));
    for (int64_t i = 2 * n * k; i < 3 * n * k; ++i) CHECK(written.get(i) == 0.0);
  }
}

TEST_CASE("grouped gemm backward matches finite differences (fp64)", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const DType dt = DType::F64;
  const int64_t num_experts = 3, n = 5, k = 7, rows = 6;
  HostTensor offsets = offsets_tensor({0, 0, 4, 6});  // expert 0 receives nothing
  HostTensor x = random_tensor(dt, {rows, k}, 13);
  HostTensor w = random_tensor(dt, {num_experts, n, k}, 14);
  HostTensor weights = random_tensor(dt, {rows, n}, 15);
  HostTensor y(dt, {rows, n});
  auto loss = [&] {
    ops.grouped_gemm_fwd(y, x, w, offsets);
    return weighted_sum(weights, y);
  };
  HostTensor dx(dt, {rows, k}), dw(dt, {num_experts, n, k});
  ops.grouped_gemm_bwd_data(dx, weights, w, offsets);
  ops.grouped_gemm_bwd_weight(dw, weights, x, offsets);
  check_grad("grouped_gemm x", x, dx, loss);
  check_grad("grouped_gemm w", w, dw, loss);
  // The empty expert's weight gradient stays exactly zero.
  for (int64_t i = 0; i < n * k; ++i) CHECK(dw.get(i) == 0.0);
}

TEST_CASE("grouped gemm rejects malformed offsets", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  HostTensor x(DType::F32, {4, 3}), w(DType::F32, {2, 5, 3}), y(DType::F32, {4, 5});
  CHECK_NOTHROW(ops.grouped_gemm_fwd(y, x, w, offsets_tensor({0, 2, 4})));
  CHECK_THROWS_AS(ops.grouped_gemm_fwd(y, x, w, offsets_tensor({0, 3, 2})), Error);
  CHECK_THROWS_AS(ops.grouped_gemm_fwd(y, x, w, offsets_tensor({1, 2, 4})), Error);
  CHECK_THROWS_AS(ops.grouped_gemm_fwd(y, x, w, offsets_tensor({0, 2, 5})), Error);
  CHECK_THROWS_AS(ops.grouped_gemm_fwd(y, x, w, offsets_tensor({0, 4})), Error);
}
