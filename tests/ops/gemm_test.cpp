// gemm: the CPU reference against a naive triple loop (every transpose, alpha/beta, thread-count
// independence, bad shapes); the CUDA backend (cuBLASLt) against the reference ([gpu]) with
// bf16/fp32 c, beta 0/1, sizes 1, primes and odd leading dimensions, and bitwise determinism.

#include <limits>
#include <vector>

#include "ops/ops_test_util.h"

namespace reference {
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

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include <stdlib.h>
#include <string>

#include "gpu/gpu_test_util.h"

namespace cuda {
using namespace mop;
using namespace mop::test;

namespace {

// fp32 C from integer inputs: exact (see the header).
constexpr double kExact = 0;
// bf16 C: the exact result rounded once to bf16 on each side; one bf16 ulp relative (8 significant
// bits: 2^-7 at the bottom of a binade) allows a different tie-break.
constexpr double kBf16Ulp = 1.0 / 128;
// Per-addition error of fp32 accumulation on random data, 1 ulp (2^-23) rather than ½: tensor
// cores need not round to nearest inside the MMA. Times K and Σ|a·b| it bounds a K-term dot
// product.
constexpr double kF32AddUlp = 1.0 / (1 << 23);

}  // namespace

TEST_CASE("cuda gemm equals the CPU reference: transposes, c dtype, alpha, beta, odd shapes",
          "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  CudaOps ops;
  // 1, primes, K not a multiple of 8 (rows of a/b not 16-byte aligned), and tiny-model shapes
  // (tokens × hidden 128, q projection 128, LM head over the 257-byte vocabulary, router E = 8,
  // one generated row).
  const int64_t shapes[][3] = {{1, 1, 1},    {7, 13, 5},     {37, 70, 9},
                               {5, 33, 1},   {64, 128, 128}, {33, 257, 128},
                               {64, 8, 128}, {1, 257, 128},  {96, 256, 64}};
  const std::pair<float, float> scalars[] = {{1, 0}, {1, 1}, {-0.5f, 2}};
  uint64_t seed = 100;
  for (auto& s : shapes)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (DType c_dtype : {DType::BF16, DType::F32})
          for (auto [alpha, beta] : scalars) {
            const int64_t m = s[0], n = s[1], k = s[2];
            INFO("m=" << m << " n=" << n << " k=" << k << " ta=" << ta << " tb=" << tb << " c "
                      << dtype_name(c_dtype) << " alpha=" << alpha << " beta=" << beta);
            HostTensor a = ta ? int_tensor({k, m}, ++seed) : int_tensor({m, k}, ++seed);
            HostTensor b = tb ? int_tensor({n, k}, ++seed) : int_tensor({k, n}, ++seed);
            HostTensor c0 = int_tensor({m, n}, ++seed);
            HostTensor ref = c0;
            cpu_ops().gemm(ref, a, ta, b, tb, alpha, beta);
            if (c_dtype == DType::BF16) ref = bf16_rounded_f32(ref);
            DeviceTensor da = upload(a, DType::BF16), db = upload(b, DType::BF16);
            DeviceTensor dc = upload(c0, c_dtype);
            if (beta == 0) poison(dc);  // beta = 0 must not read c
            ops.gemm(dc, da, ta, db, tb, alpha, beta);
            HostTensor got = download(dc);
            CHECK(count_mismatches(got, ref, 0, c_dtype == DType::F32 ? kExact : kBf16Ulp) == 0);
          }
}

TEST_CASE("cuda gemm on random bf16 inputs: fp32 accuracy bound and bitwise determinism",
          "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  CudaOps ops;
  const int64_t m = 67, n = 129, k = 300;
  HostTensor a(DType::F32, {k, m}), b(DType::F32, {n, k});
  fill_uniform(a, 1);
  fill_uniform(b, 2);
  HostTensor ref(DType::F32, {m, n}), bound(DType::F32, {m, n});
  cpu_ops().gemm(ref, a, true, b, true, 1, 0);
  HostTensor abs_a = a, abs_b = b;
  for (HostTensor* t : {&abs_a, &abs_b})
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, std::fabs(t->get(i)));
  cpu_ops().gemm(bound, abs_a, true, abs_b, true, 1, 0);  // Σ|a·b| per element
  DeviceTensor da = upload(a, DType::BF16), db = upload(b, DType::BF16);
  for (DType c_dtype : {DType::F32, DType::BF16}) {
    INFO("c " << dtype_name(c_dtype));
    DeviceTensor c1(c_dtype, {m, n}), c2(c_dtype, {m, n});
    poison(c1);
    poison(c2);
    ops.gemm(c1, da, true, db, true, 1, 0);
    ops.gemm(c2, da, true, db, true, 1, 0);
    HostTensor got = download(c1), again = download(c2);
    CHECK(bitwise_equal(got, again));
    int64_t bad = 0;
    for (int64_t i = 0; i < ref.numel(); ++i) {
      // Both sides sum in fp32 (2·K·ulp·Σ|a·b| covers the two orders), plus bf16 output rounding.
      const double tol = 2 * k * kF32AddUlp * bound.get(i) +
                         (c_dtype == DType::BF16 ? kBf16Ulp * std::fabs(ref.get(i)) : 0.0);
      if (!(std::fabs(got.get(i) - ref.get(i)) <= tol)) ++bad;
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("cuda gemm rejects bad dtypes, devices, shapes and aliasing", "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  CudaOps ops;
  DeviceTensor a(DType::BF16, {3, 4}), b(DType::BF16, {4, 5}), c(DType::F32, {3, 5});
  DeviceTensor a32(DType::F32, {3, 4}), b_bad(DType::BF16, {5, 5}), c16(DType::BF16, {3, 5});
  HostTensor host_c(DType::F32, {3, 5});
  CHECK_NOTHROW(ops.gemm(c, a, false, b, false, 1, 0));
  CHECK_NOTHROW(ops.gemm(c16, a, false, b, false, 1, 0));
  CHECK_THROWS_AS(ops.gemm(c, a32, false, b, false, 1, 0), Error);
  CHECK_THROWS_AS(ops.gemm(c, a, false, b_bad, false, 1, 0), Error);
  CHECK_THROWS_AS(ops.gemm(host_c, a, false, b, false, 1, 0), Error);
  CHECK_THROWS_AS(ops.gemm(c, a, true, b, false, 1, 0), Error);
  const Tensor c_over_a(a.t.data, DType::BF16, {3, 5}, Device::CUDA);  // rejected before any access
  CHECK_THROWS_AS(ops.gemm(c_over_a, a, false, b, false, 1, 0), Error);
  ops.synchronize();
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
