// swiglu: the CPU reference forward is silu(g)·u and its backward matches finite differences;
// the CUDA backend against the reference ([gpu]).

#include <cmath>
#include <cstring>
#include <vector>

#include "ops/ops_test_util.h"

namespace reference {
using namespace mop;
using namespace mop::test;

namespace {

// fp64 evaluations of the same formula in a different order differ by a few ulps of O(1) values.
constexpr double kFp64Tol = 1e-12;

}  // namespace

TEST_CASE("swiglu forward is silu(g)·u; backward matches finite differences", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t rows = 7, width = 13;
  HostTensor gu = random_tensor(DType::F64, {rows, 2 * width}, 7, -4, 4);
  HostTensor h(DType::F64, {rows, width});
  ops.swiglu_fwd(h, gu);
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) {
      const double g = gu.get(r * 2 * width + c), u = gu.get(r * 2 * width + width + c);
      worst = std::max(worst, std::fabs(h.get(r * width + c) - g / (1 + std::exp(-g)) * u));
    }
  CHECK(worst < kFp64Tol);

  HostTensor weights = random_tensor(DType::F64, {rows, width}, 8);
  auto loss = [&] {
    ops.swiglu_fwd(h, gu);
    return weighted_sum(weights, h);
  };
  HostTensor dgu(DType::F64, {rows, 2 * width});
  ops.fill(dgu, std::nan(""));
  ops.swiglu_bwd(dgu, weights, gu);
  check_grad("swiglu gu", gu, dgu, loss);

  // f32 agrees with f64.
  HostTensor gu64 = bf16_exact_tensor(DType::F64, {rows, 2 * width}, 9, -4, 4);
  HostTensor h32(DType::F32, {rows, width}), d32(DType::F32, {rows, 2 * width});
  HostTensor d64(DType::F64, {rows, 2 * width});
  ops.swiglu_fwd(h, gu64);
  ops.swiglu_fwd(h32, converted(gu64, DType::F32));
  ops.swiglu_bwd(d64, weights, gu64);
  ops.swiglu_bwd(d32, converted(weights, DType::F32), converted(gu64, DType::F32));
  CHECK(max_abs_diff(h32, h) < kF32VsF64Tol);
  CHECK(max_abs_diff(d32, d64) < kF32VsF64Tol);
  HostTensor odd(DType::F64, {rows, 2 * width + 1});
  CHECK_THROWS_AS(ops.swiglu_fwd(h, odd), Error);
}

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include "catch.h"
#include "gpu/pointwise_test_util.h"
#include "ops/cuda_ops.h"

namespace cuda {
using namespace mop;
using namespace mop::test;
using namespace mop::test::pw;

namespace {

// SwiGLU in fp32 on both sides, with the GPU's fast exponential (≤ ~6 ulp for |x| ≤ 4): values
// agree to ~1e-6 relative before the bf16 rounding.
constexpr double kSwigluRtol = kBf16Rtol + 1e-5;
// dg's factor 1 + g·(1 − σ) cancels near g ≈ −1.28, where σ's ~1e-6 relative error times
// |dh·u·g| ≤ 4·4·1.3 leaves ~2e-5 absolute at most; 1e-4 absolute covers it.
constexpr double kSwigluAtol = 1e-4;

}  // namespace

TEST_CASE("swiglu forward and backward on the device match the reference", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  const int64_t shapes[][3] = {{1, 1, 0},    {3, 5, 0},    {7, 13, 0}, {5, 8, 0},
                               {64, 768, 0}, {257, 24, 0}, {9, 16, 1}, {2, 1000, 0}};
  for (auto& s : shapes) {
    const int64_t rows = s[0], width = s[1], offset = s[2];
    INFO("rows " << rows << " width " << width << " offset " << offset);
    const HostTensor gu = random_f32({rows, 2 * width}, 11, -4, 4);
    const HostTensor dh = random_f32({rows, width}, 12, -1, 1);
    HostTensor h_ref(DType::F32, {rows, width}), dgu_ref(DType::F32, {rows, 2 * width});
    cpu().swiglu_fwd(h_ref, gu);
    cpu().swiglu_bwd(dgu_ref, dh, gu);
    DeviceTensor dgu_in = upload_at(gu, DType::BF16, offset);
    DeviceTensor h = poisoned(DType::BF16, {rows, width}, offset);
    ops.swiglu_fwd(h.t, dgu_in.t);
    {
      std::string first;
      const int64_t bad = mismatches(download(h.t), h_ref, 1e-6, kSwigluRtol, &first);
      INFO("h: " << first);
      CHECK(bad == 0);
    }
    DeviceTensor ddh = upload_at(dh, DType::BF16, offset);
    DeviceTensor dgu = poisoned(DType::BF16, {rows, 2 * width}, offset);
    ops.swiglu_bwd(dgu.t, ddh.t, dgu_in.t);
    const HostTensor got = download(dgu.t);
    {
      std::string first;
      const int64_t bad = mismatches(got, dgu_ref, kSwigluAtol, kSwigluRtol, &first);
      INFO("dgu: " << first);
      CHECK(bad == 0);
    }
    ops.swiglu_bwd(dgu_in.t, ddh.t, dgu_in.t);  // in place over gu
    CHECK(bitwise_equal(download(dgu_in.t), got));
  }
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
