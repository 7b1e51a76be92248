// The op front (ops.h): every op of op_list.inc has a name and a timing category; a call with a
// wrong shape, dtype or device fails in the front with the op's name and never reaches the
// backend's hook; a good call reaches the hook once; the observer (TimedOps) sees every op by its
// name without restating any of them.
#include <set>
#include <string>

#include "catch.h"
#include "ops/ops_test_util.h"
#include "ops/timed_ops.h"

using namespace mop;

namespace {

// A backend that records which hooks ran and computes nothing (the CPU dtypes, so the front's
// checks are the CPU backend's).
class RecordingBackend final : public OpsBackend {
 public:
  Device device() const override { return Device::CPU; }
  std::vector<DType> compute_dtypes() const override { return {DType::F32, DType::F64}; }
#define MOP_OP(name, category, params, args) \
  void name params override { calls.push_back(#name); }
#include "ops/op_list.inc"
#undef MOP_OP
  std::vector<std::string> calls;
};

}  // namespace

TEST_CASE("ops front: every op is listed once with a name and a category", "[cpu][ops]") {
  std::set<std::string> names;
  int count = 0;
#define MOP_OP(op, cat, params, args)                     \
  CHECK(std::string(op_info(OpId::op).name) == #op);      \
  CHECK(op_info(OpId::op).category == OpCategory::cat);   \
  names.insert(#op);                                      \
  ++count;
#include "ops/op_list.inc"
#undef MOP_OP
  CHECK(count == int(names.size()));
  CHECK(count == int(OpId::adamw_step_cast) + 1);  // ids run 0 … the last op listed
}

TEST_CASE("ops front: bad arguments fail before the hook, good ones reach it once", "[cpu][ops]") {
  auto backend = std::make_shared<RecordingBackend>();
  Ops ops(backend);
  test::HostTensor x(DType::F32, {4, 8}), y(DType::F32, {4, 8}), w(DType::F32, {8});
  test::HostTensor rstd(DType::F32, {4}), w_bad(DType::F32, {7}), x64(DType::F64, {4, 8});
  test::HostTensor xbf(DType::BF16, {4, 8});

  ops.rmsnorm_fwd(y, rstd, x, w, 1e-6f);
  CHECK(backend->calls == std::vector<std::string>{"rmsnorm_fwd"});

  CHECK_THROWS_WITH(ops.rmsnorm_fwd(y, rstd, x, w_bad, 1e-6f),
                    Catch::Contains("rmsnorm_fwd: w has shape [7], expected [8]"));
  CHECK_THROWS_WITH(ops.rmsnorm_fwd(y, rstd, x64, w, 1e-6f),
                    Catch::Contains("rmsnorm_fwd: y has dtype f32, expected f64"));
  CHECK_THROWS_WITH(ops.rmsnorm_fwd(y, rstd, xbf, w, 1e-6f),
                    Catch::Contains("the cpu backend computes in f32 or f64"));
  Tensor on_gpu = x.t;
  on_gpu.device = Device::CUDA;
  CHECK_THROWS_WITH(ops.add(y, x, on_gpu), Catch::Contains("add: out, a and b must be cpu"));
  // The GEMM's shapes: inner dimensions must agree; c may not alias an operand.
  test::HostTensor c(DType::F32, {4, 4}), b(DType::F32, {4, 7});
  CHECK_THROWS_WITH(ops.gemm(c, x, false, b, false, 1, 0), Catch::Contains("inner dims differ"));
  CHECK_THROWS_WITH(ops.gemm(c, c, false, c, false, 1, 0), Catch::Contains("must not alias"));
  CHECK(backend->calls.size() == 1);  // none of the bad calls reached the backend

  ops.gemm(c, x, false, y, true, 1, 0);
  CHECK(backend->calls.back() == "gemm");
}

TEST_CASE("ops front: the timer observes every op by its listed name", "[cpu][ops]") {
  auto backend = std::make_shared<RecordingBackend>();
  TimedOps timed(std::make_unique<Ops>(backend));
  test::HostTensor x(DType::F32, {4, 8}), y(DType::F32, {4, 8}), out(DType::I64, {4});
  timed.start_trace();
  timed.swiglu_fwd(test::HostTensor(DType::F32, {4, 4}), x);
  timed.sumsq(out, y);
  timed.inner().add(y, x, y);  // untimed: the inner front has no observer
  const std::vector<TraceEvent> trace = timed.stop_trace();
  REQUIRE(trace.size() == 2);
  CHECK(trace[0].name == "swiglu_fwd");
  CHECK(trace[0].category == op_category_name(OpCategory::Experts));
  CHECK(trace[1].name == "sumsq");
  CHECK(trace[1].category == op_category_name(OpCategory::Optimizer));
  CHECK(backend->calls == std::vector<std::string>{"swiglu_fwd", "sumsq", "add"});
}
