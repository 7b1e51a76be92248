// [gpu][gemm] CudaOps GEMMs against the CPU reference: dense gemm (all transposes, bf16/fp32 c,
// beta 0/1, sizes 1, primes, odd leading dimensions, tiny-model shapes) and the grouped expert
// GEMMs on every path (empty expert, one expert with all rows, E = 1, bwd_weight onto a nonzero dw,
// sizes the grouped and cutlass paths hand on, q3moe-8l expert shapes, bwd_weight accumulating over
// two calls, more calls in flight than pointer slots). Inputs are small integers (CUTLASS's trick):
// bf16-exact, every partial sum an integer < 2^24, exact in fp32.
#ifdef MOP_HAVE_CUDA

#include <stdlib.h>

#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "ops/ops_test_util.h"

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

// Where the CUTLASS kernels are not built, MOP_GROUPED_GEMM=cutlass runs cuBLAS: say so.
void note_cutlass_build() {
#ifndef MOP_HAVE_CUTLASS_SM90
  WARN("CUTLASS sm90 kernels not built: the cutlass path runs cuBLAS");
#endif
}

#define MOP_REQUIRE_GPU()              \
  do {                                 \
    if (!gpu_available()) {            \
      WARN("no CUDA device: skipped"); \
      return;                          \
    }                                  \
  } while (0)

// Integers in [lo, hi], as f32.
HostTensor int_tensor(std::initializer_list<int64_t> dims, uint64_t seed, int lo = -3, int hi = 3) {
  HostTensor t(DType::F32, dims);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.set(i, double(lo + int(philox_u64(seed, 5, uint64_t(i)) % uint64_t(hi - lo + 1))));
  // A draw of all zeros (likely for tiny tensors) would make the comparison vacuous.
  if (t.numel() > 0 && max_abs(t) == 0) t.set(0, 1.0);
  REQUIRE((t.numel() == 0 || max_abs(t) > 0));
  return t;
}

HostTensor rounded_to_bf16(HostTensor t) {
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, round_bf16(float(t.get(i))));
  return t;
}

HostTensor offsets_tensor(const std::vector<int32_t>& offsets) {
  HostTensor o(DType::I32, {int64_t(offsets.size())});
  for (size_t e = 0; e < offsets.size(); ++e) o.ptr<int32_t>()[e] = offsets[e];
  return o;
}

HostTensor filled(DType dtype, std::initializer_list<int64_t> dims, double value) {
  HostTensor t(dtype, dims);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, value);
  return t;
}

// Sets MOP_GROUPED_GEMM for one scope and restores the previous value.
class GroupedPathEnv {
 public:
  explicit GroupedPathEnv(const char* value) {
    if (const char* old = getenv("MOP_GROUPED_GEMM")) {
      old_ = old;
      had_ = true;
    }
    setenv("MOP_GROUPED_GEMM", value, 1);
  }
  ~GroupedPathEnv() {
    if (had_)
      setenv("MOP_GROUPED_GEMM", old_.c_str(), 1);
    else
      unsetenv("MOP_GROUPED_GEMM");
  }

 private:
  std::string old_;
  bool had_ = false;
};

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
            if (c_dtype == DType::BF16) ref = rounded_to_bf16(ref);
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

namespace {

struct GroupedCase {
  const char* name;
  int64_t n, k;
  std::vector<int32_t> offsets;  // E + 1
  int64_t rows;                  // rows of x/y (≥ offsets[E]; the rest must stay untouched)
};

// Every output the three grouped ops produce for one case on the current path.
struct GroupedResult {
  HostTensor y, dx, dw, dw_written;  // dw_written: bwd_weight writing over a poisoned dw
};

GroupedResult run_grouped_case(CudaOps& ops, const GroupedCase& c, const HostTensor& x,
                               const HostTensor& w, const HostTensor& dy, const HostTensor& dw0,
                               const HostTensor& offsets) {
  DeviceTensor d_x = upload(x, DType::BF16), d_w = upload(w, DType::BF16);
  DeviceTensor d_dy = upload(dy, DType::BF16);
  // Rows past offsets[E] hold 7 and must keep it; empty experts' dw must keep dw0.
  DeviceTensor y = upload(filled(DType::F32, {c.rows, c.n}, 7), DType::BF16);
  DeviceTensor dx = upload(filled(DType::F32, {c.rows, c.k}, 7), DType::BF16);
  DeviceTensor dw = upload(dw0, DType::F32);
  ops.grouped_gemm_fwd(y, d_x, d_w, offsets);
  ops.grouped_gemm_bwd_data(dx, d_dy, d_w, offsets);
  ops.grouped_gemm_bwd_weight(dw, d_dy, d_x, offsets);
  DeviceTensor dw_written(DType::F32, {int64_t(c.offsets.size()) - 1, c.n, c.k});
  poison(dw_written);
  ops.grouped_gemm_bwd_weight(dw_written, d_dy, d_x, offsets, /*accumulate=*/false);
  return {download(y), download(dx), download(dw), download(dw_written)};
}

}  // namespace

TEST_CASE("cuda grouped gemms equal the CPU reference on every path", "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  note_cutlass_build();
  CudaOps ops;
  const std::vector<GroupedCase> cases = {
      {"aligned sizes, expert 1 empty, 3 rows past R", 24, 16, {0, 3, 3, 10, 16}, 19},
      {"odd sizes (the grouped path hands over to the loop)", 13, 7, {0, 5, 5, 6, 11}, 12},
      {"one expert takes every row", 32, 24, {0, 0, 9, 9}, 9},
      {"E = 1", 16, 40, {0, 21}, 21},
      {"no rows at all", 8, 8, {0, 0, 0}, 4},
      {"tiny model: 8 experts, H 128 → 2F 512",
       512,
       128,
       {0, 40, 70, 70, 130, 200, 260, 300, 512},
       512},
      {"tiny model down projection: F 256 → H 128", 128, 256, {0, 64, 64, 128, 192, 256}, 256},
      // q3moe-8l expert shapes (H 2048, F 768): rows per expert not multiples of any tile, an
      // empty expert, a single row, rows past R.
      {"q3moe gate_up: H 2048 → 2F 1536", 1536, 2048, {0, 256, 256, 356, 393}, 400},
      {"q3moe down: F 768 → H 2048", 2048, 768, {0, 1, 130, 130, 386}, 386}};
  uint64_t seed = 500;
  for (const GroupedCase& c : cases) {
    const int64_t num_experts = int64_t(c.offsets.size()) - 1;
    HostTensor offsets = offsets_tensor(c.offsets);
    HostTensor x = int_tensor({c.rows, c.k}, ++seed, -2, 2);
    HostTensor w = int_tensor({num_experts, c.n, c.k}, ++seed, -2, 2);
    HostTensor dy = int_tensor({c.rows, c.n}, ++seed, -2, 2);
    HostTensor dw0 = int_tensor({num_experts, c.n, c.k}, ++seed, -2, 2);
    HostTensor y_ref = filled(DType::F32, {c.rows, c.n}, 7);
    HostTensor dx_ref = filled(DType::F32, {c.rows, c.k}, 7), dw_ref = dw0;
    HostTensor dw_written_ref = filled(DType::F32, {num_experts, c.n, c.k}, 7);
    cpu_ops().grouped_gemm_fwd(y_ref, x, w, offsets);
    cpu_ops().grouped_gemm_bwd_data(dx_ref, dy, w, offsets);
    cpu_ops().grouped_gemm_bwd_weight(dw_ref, dy, x, offsets);
    cpu_ops().grouped_gemm_bwd_weight(dw_written_ref, dy, x, offsets, /*accumulate=*/false);
    y_ref = rounded_to_bf16(y_ref);
    dx_ref = rounded_to_bf16(dx_ref);
    GroupedResult loop;
    for (const char* path : {"loop", "streams", "grouped", "cutlass", "cublas", "auto"}) {
      INFO(c.name << ", MOP_GROUPED_GEMM=" << path);
      GroupedPathEnv env(path);
      GroupedResult r = run_grouped_case(ops, c, x, w, dy, dw0, offsets);
      CHECK(count_mismatches(r.y, y_ref, 0, kBf16Ulp) == 0);
      CHECK(count_mismatches(r.dx, dx_ref, 0, kBf16Ulp) == 0);
      CHECK(count_mismatches(r.dw, dw_ref, 0, kExact) == 0);
      CHECK(count_mismatches(r.dw_written, dw_written_ref, 0, kExact) == 0);
      if (std::string(path) == "loop") loop = r;
      if (std::string(path) == "streams") {
        // Same per-expert algorithms on other streams: bitwise the loop's results.
        CHECK(bitwise_equal(r.y, loop.y));
        CHECK(bitwise_equal(r.dx, loop.dx));
        CHECK(bitwise_equal(r.dw, loop.dw));
        CHECK(bitwise_equal(r.dw_written, loop.dw_written));
      }
    }
  }
}

TEST_CASE("cuda grouped gemm: more calls in flight than pinned pointer slots", "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  // 40 back-to-back calls (more than the 32 slots), each with its own offsets and output, and no
  // synchronisation in between: a slot overwritten too early would send a call's results to
  // another call's output. bwd_weight accumulates all 40 into one dw.
  const int64_t num_calls = 40, num_experts = 4, n = 16, k = 16, rows = 24;
  HostTensor x = int_tensor({rows, k}, 900, -2, 2), w = int_tensor({num_experts, n, k}, 901, -2, 2);
  HostTensor dy = int_tensor({rows, n}, 902, -2, 2);
  HostTensor dw0 = int_tensor({num_experts, n, k}, 903, -2, 2);
  std::vector<HostTensor> offsets, refs;
  HostTensor dw_ref = dw0;
  for (int64_t i = 0; i < num_calls; ++i) {
    const int32_t a = int32_t(i % 7), b = int32_t(7 + i % 11), c = int32_t(18 + i % 5);
    offsets.push_back(offsets_tensor({0, a, b, c, c + int32_t(i % 2)}));
    HostTensor ref = filled(DType::F32, {rows, n}, 7);
    cpu_ops().grouped_gemm_fwd(ref, x, w, offsets.back());
    refs.push_back(rounded_to_bf16(ref));
    cpu_ops().grouped_gemm_bwd_weight(dw_ref, dy, x, offsets.back());
  }
  for (const char* path : {"grouped", "cutlass"}) {
    INFO("MOP_GROUPED_GEMM=" << path);
    GroupedPathEnv env(path);
    CudaOps ops;
    DeviceTensor d_x = upload(x, DType::BF16), d_w = upload(w, DType::BF16);
    DeviceTensor d_dy = upload(dy, DType::BF16), d_dw = upload(dw0, DType::F32);
    std::vector<DeviceTensor> ys;
    for (int64_t i = 0; i < num_calls; ++i)
      ys.push_back(upload(filled(DType::F32, {rows, n}, 7), DType::BF16));
    for (int64_t i = 0; i < num_calls; ++i) {
      ops.grouped_gemm_fwd(ys[size_t(i)], d_x, d_w, offsets[size_t(i)]);
      ops.grouped_gemm_bwd_weight(d_dw, d_dy, d_x, offsets[size_t(i)]);
    }
    for (int64_t i = 0; i < num_calls; ++i) {
      INFO("call " << i);
      CHECK(count_mismatches(download(ys[size_t(i)]), refs[size_t(i)], 0, kBf16Ulp) == 0);
    }
    CHECK(count_mismatches(download(d_dw), dw_ref, 0, kExact) == 0);
  }
}

TEST_CASE("cuda grouped gemm cutlass path: bwd_weight accumulates, results repeat bitwise",
          "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  note_cutlass_build();
  GroupedPathEnv env("cutlass");
  CudaOps ops;
  // q3moe-8l down projection (F 768 → H 2048) over 3 experts, the middle one empty.
  const int64_t n = 2048, k = 768, rows = 300;
  HostTensor offsets = offsets_tensor({0, 170, 170, rows});
  HostTensor x = int_tensor({rows, k}, 950, -2, 2), w = int_tensor({3, n, k}, 951, -2, 2);
  HostTensor dy = int_tensor({rows, n}, 952, -2, 2), dw0 = int_tensor({3, n, k}, 953, -2, 2);
  HostTensor dw_ref = dw0;
  cpu_ops().grouped_gemm_bwd_weight(dw_ref, dy, x, offsets);
  cpu_ops().grouped_gemm_bwd_weight(dw_ref, dy, x, offsets);
  DeviceTensor d_x = upload(x, DType::BF16), d_w = upload(w, DType::BF16);
  DeviceTensor d_dy = upload(dy, DType::BF16), d_dw = upload(dw0, DType::F32);
  ops.grouped_gemm_bwd_weight(d_dw, d_dy, d_x, offsets);
  ops.grouped_gemm_bwd_weight(d_dw, d_dy, d_x, offsets);
  CHECK(count_mismatches(download(d_dw), dw_ref, 0, kExact) == 0);
  // Random bf16 inputs (rounding inside the MMA matters): two runs agree bit for bit.
  HostTensor rx(DType::F32, {rows, k}), rw(DType::F32, {3, n, k}), rdy(DType::F32, {rows, n});
  fill_uniform(rx, 7);
  fill_uniform(rw, 8);
  fill_uniform(rdy, 9);
  DeviceTensor r_x = upload(rx, DType::BF16), r_w = upload(rw, DType::BF16);
  DeviceTensor r_dy = upload(rdy, DType::BF16);
  std::vector<HostTensor> runs[3];
  for (int rep = 0; rep < 2; ++rep) {
    DeviceTensor y(DType::BF16, {rows, n}), dx(DType::BF16, {rows, k});
    DeviceTensor dw = upload(filled(DType::F32, {3, n, k}, 0), DType::F32);
    poison(y);
    poison(dx);
    ops.grouped_gemm_fwd(y, r_x, r_w, offsets);
    ops.grouped_gemm_bwd_data(dx, r_dy, r_w, offsets);
    ops.grouped_gemm_bwd_weight(dw, r_dy, r_x, offsets);
    runs[0].push_back(download(y));
    runs[1].push_back(download(dx));
    runs[2].push_back(download(dw));
  }
  for (auto& r : runs) CHECK(bitwise_equal(r[0], r[1]));
}

TEST_CASE("cuda grouped gemm rejects malformed offsets and an unknown MOP_GROUPED_GEMM",
          "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  CudaOps ops;
  DeviceTensor x(DType::BF16, {4, 8}), w(DType::BF16, {2, 8, 8}), y(DType::BF16, {4, 8});
  CHECK_NOTHROW(ops.grouped_gemm_fwd(y, x, w, offsets_tensor({0, 2, 4})));
  CHECK_THROWS_AS(ops.grouped_gemm_fwd(y, x, w, offsets_tensor({0, 3, 2})), Error);
  CHECK_THROWS_AS(ops.grouped_gemm_fwd(y, x, w, offsets_tensor({0, 2, 5})), Error);
  DeviceTensor offsets_on_device = upload(offsets_tensor({0, 2, 4}));
  CHECK_THROWS_AS(ops.grouped_gemm_fwd(y, x, w, offsets_on_device), Error);
  {
    GroupedPathEnv env("fastest");
    CHECK_USER_ERROR(ops.grouped_gemm_fwd(y, x, w, offsets_tensor({0, 2, 4})), "MOP_GROUPED_GEMM");
  }
  ops.synchronize();
}

#endif  // MOP_HAVE_CUDA
