// grouped_gemm: the CPU reference against per-expert GEMMs with copied weights (an expert with no
// rows included) and finite differences of both backwards; the CUDA backend ([gpu]) on every
// path (cutlass, grouped, loop, streams) against the reference on small-integer inputs (exact in
// fp32), more calls in flight than pointer slots, malformed offsets.

#include <limits>
#include <vector>

#include "ops/ops_test_util.h"

namespace reference {
using namespace mop;
using namespace mop::test;

namespace {

HostTensor offsets_tensor(const std::vector<int32_t>& offsets) {
  HostTensor o(DType::I32, {int64_t(offsets.size())});
  for (size_t e = 0; e < offsets.size(); ++e) o.ptr<int32_t>()[e] = offsets[e];
  return o;
}

}  // namespace

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

// Where the CUTLASS kernels are not built, MOP_GROUPED_GEMM=cutlass runs cuBLAS: say so.
void note_cutlass_build() {
#ifndef MOP_HAVE_CUTLASS_SM90
  WARN("CUTLASS sm90 kernels not built: the cutlass path runs cuBLAS");
#endif
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
    y_ref = bf16_rounded_f32(y_ref);
    dx_ref = bf16_rounded_f32(dx_ref);
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
    refs.push_back(bf16_rounded_f32(ref));
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

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
