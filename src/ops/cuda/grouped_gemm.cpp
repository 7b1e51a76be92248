// CUDA backend, grouped_gemm stem: the grouped expert GEMMs. A grouped GEMM runs as one CUTLASS sm90 grouped kernel ("cutlass"; Hopper, n and k multiples of 8,
// kernels/grouped_gemm_sm90.cuh), one cublasGemmGroupedBatchedEx ("grouped"; bf16 C only), one
// cuBLASLt matmul per non-empty expert ("loop"), or those matmuls spread over side streams
// ("streams"). MOP_GROUPED_GEMM=cutlass|grouped|loop|streams|cublas|auto picks one, read at every
// call so a benchmark can switch; auto (the default) is cutlass where it can run, else cublas:
// grouped for small experts and streams otherwise (kLoopMinMeanRows). A call cutlass cannot take
// goes to cublas, one grouped cannot take to the loop. MOP_GROUPED_GEMM_CONFIG overrides the
// CUTLASS tile configuration (mop_bench's tuning knob; kernels/grouped_gemm_sm90*.cu list them).
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/grouped_gemm_sm90.cuh"
#include "ops/cuda/backend.h"
#include "ops/cuda/gemm_state.h"
#include "runtime/cuda_check.h"

namespace mop {
namespace {

// auto takes cutlass wherever it can run: on the H200 at the q3moe-8l expert shapes (E=128) it
// ran fwd/dgrad at 497–608 TFLOP/s vs ≤ 314 for the best cuBLAS path at 256 rows per expert and
// 617–712 vs ≤ 536 at 1024, wgrad at 196–204 vs ≤ 171 (256 rows) and 444–507 vs streams 332–509
// (1024: a tie on gate_up, 34% ahead on down).
// cublas: cublasGemmGroupedBatchedEx below this mean number of rows per non-empty expert, a call
// per expert spread over the side streams from it on (and always for the fp32-output weight
// gradient, which the grouped call cannot do). Measured with `mop_bench grouped` on the H200 at
// the q3moe-8l expert shapes (E=128): at 256 rows grouped 277–308 TFLOP/s vs loop 106–224 and
// streams 80–170 (fwd/dgrad); wgrad streams 166 vs loop 112 (gate_up); at 1024 rows streams
// 315–524 vs grouped 291–328 (fwd/dgrad) and wgrad streams 312–506 vs loop 300–340.
constexpr int64_t kLoopMinMeanRows = 512;

enum class GroupedPath { Auto, Cutlass, Cublas, Grouped, Loop, Streams };

GroupedPath requested_grouped_path() {
  const char* v = std::getenv("MOP_GROUPED_GEMM");
  if (!v || !*v || !std::strcmp(v, "auto")) return GroupedPath::Auto;
  if (!std::strcmp(v, "cutlass")) return GroupedPath::Cutlass;
  if (!std::strcmp(v, "cublas")) return GroupedPath::Cublas;
  if (!std::strcmp(v, "grouped")) return GroupedPath::Grouped;
  if (!std::strcmp(v, "loop")) return GroupedPath::Loop;
  if (!std::strcmp(v, "streams")) return GroupedPath::Streams;
  throw_user_error("MOP_GROUPED_GEMM=", v,
                   ": expected cutlass, grouped, loop, streams, cublas or auto");
  return GroupedPath::Auto;
}

using kernels::GroupedGemmSm90Op;

#if MOP_HAVE_CUTLASS_SM90
// MOP_GROUPED_GEMM_CONFIG: the CUTLASS tile configuration, one index for every op or three
// ("fwd,bwd_data,bwd_weight"); -1 (unset) for the op's default.
int requested_sm90_config(GroupedGemmSm90Op op) {
  const char* v = std::getenv("MOP_GROUPED_GEMM_CONFIG");
  if (!v || !*v) return -1;
  long c[3] = {-1, -1, -1};
  int count = 0;
  const char* at = v;
  for (char* end = nullptr; count < 3; at = end + 1) {
    c[count++] = std::strtol(at, &end, 10);
    if (end == at || *end != ',') {
      at = end;
      break;
    }
  }
  const long mine = count == 1 ? c[0] : c[op == GroupedGemmSm90Op::BwdWeightWrite ? 2 : int(op)];
  const int num = kernels::grouped_gemm_sm90_num_configs(op);
  if (*at || (count != 1 && count != 3) || mine < 0 || mine >= num)
    throw_user_error("MOP_GROUPED_GEMM_CONFIG=", v, ": expected one index or three (fwd,",
                     "bwd_data,bwd_weight), each below the op's ", num, " configurations");
  return int(mine);
}
#endif

// cublasGemmGroupedBatchedEx wants bf16 C, int sizes, and 16-byte aligned matrices and rows
// (otherwise it may fault on a misaligned vector access rather than report an error).
bool grouped_capable(const std::vector<GemmCall>& calls) {
  for (const GemmCall& g : calls) {
    const ColMajorGemm cm = to_col_major(g);
    if (g.c_dtype != DType::BF16 || std::max({cm.m, cm.n, cm.k}) > INT_MAX) return false;
    for (int64_t ld : {cm.lda, cm.ldb, cm.ldc})
      if (ld * 2 % 16 != 0) return false;
    for (const void* p : {cm.a, cm.b, static_cast<const void*>(g.c)})
      if (pointer_alignment(p) < 16) return false;
  }
  return true;
}

// One cublasGemmGroupedBatchedEx over st.calls, each expert its own group (sizes differ). Returns
// false when cuBLAS does not support the problem (the caller then loops).
bool run_grouped(GemmState& st) {
  const auto& calls = st.calls;
  const int64_t num = int64_t(calls.size());
  st.reserve_groups(num);
  int slot = 0;
  const void** host = static_cast<const void**>(st.acquire_slot(&slot));
  for (auto* v : {&st.m, &st.n, &st.k, &st.lda, &st.ldb, &st.ldc, &st.group_size}) v->clear();
  st.trans_a.clear();
  st.trans_b.clear();
  st.alpha.clear();
  st.beta.clear();
  for (int64_t j = 0; j < num; ++j) {
    const GemmCall& g = calls[size_t(j)];
    const ColMajorGemm cm = to_col_major(g);
    host[j] = cm.a;
    host[num + j] = cm.b;
    host[2 * num + j] = g.c;
    st.trans_a.push_back(cm.trans_a);
    st.trans_b.push_back(cm.trans_b);
    st.m.push_back(int(cm.m));
    st.n.push_back(int(cm.n));
    st.k.push_back(int(cm.k));
    st.lda.push_back(int(cm.lda));
    st.ldb.push_back(int(cm.ldb));
    st.ldc.push_back(int(cm.ldc));
    st.alpha.push_back(g.alpha);
    st.beta.push_back(g.beta);
    st.group_size.push_back(1);
  }
  MOP_CUDA_CHECK(cudaMemcpyAsync(st.args.data(), host, size_t(3 * num) * sizeof(void*),
                                 cudaMemcpyHostToDevice, st.stream));
  st.release_slot(slot);
  void** dev = static_cast<void**>(st.args.data());
  st.lt.bind_blas(st.lane());
  const cublasStatus_t status = cublasGemmGroupedBatchedEx(
      st.lt.blas(), st.trans_a.data(), st.trans_b.data(), st.m.data(), st.n.data(), st.k.data(),
      st.alpha.data(), dev, CUDA_R_16BF, st.lda.data(), dev + num, CUDA_R_16BF, st.ldb.data(),
      st.beta.data(), dev + 2 * num, CUDA_R_16BF, st.ldc.data(), int(num), st.group_size.data(),
      CUBLAS_COMPUTE_32F);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  MOP_CUBLAS_CHECK(status);
  return true;
}

// The per-expert matmuls round-robin over the side streams, which wait for the op stream's work
// so far; the op stream then waits for all of them. Experts write disjoint outputs.
void run_streams(GemmState& st) {
  const int used = int(std::min<size_t>(kSideStreams, st.calls.size()));
  MOP_CUDA_CHECK(cudaEventRecord(st.fork, st.stream));
  for (int i = 0; i < used; ++i)
    MOP_CUDA_CHECK(cudaStreamWaitEvent(st.side[size_t(i)], st.fork, 0));
  for (size_t j = 0; j < st.calls.size(); ++j)
    st.lt.run(st.calls[j], st.expert_lane(int(j % used)));
  for (int i = 0; i < used; ++i) {
    MOP_CUDA_CHECK(cudaEventRecord(st.side_done[size_t(i)], st.side[size_t(i)]));
    MOP_CUDA_CHECK(cudaStreamWaitEvent(st.stream, st.side_done[size_t(i)], 0));
  }
}

// The CUTLASS kernels take the call when they are built and the device is sm_90, and every row
// is 16-byte aligned for TMA (n and k multiples of 8, aligned pointers). n, k are the weight's
// [n,k] for all three ops.
bool sm90_capable(const GemmState& st, int64_t n, int64_t k) {
  if (!st.sm90_ready() || n % kernels::kGroupedGemmSm90Multiple != 0 ||
      k % kernels::kGroupedGemmSm90Multiple != 0 || std::max(n, k) > INT_MAX)
    return false;
  for (const GemmCall& g : st.calls) {
    if (std::max({g.m, g.n, g.k}) > INT_MAX) return false;
    for (const void* p : {g.a, g.b, static_cast<const void*>(g.c)})
      if (pointer_alignment(p) < 16) return false;
  }
  return true;
}

// One CUTLASS launch over st.calls. The ops built the calls in row-major GEMM terms; the kernel
// takes each expert's (a, b, d, rows) in the op's own terms (grouped_gemm_sm90.cuh): rows is the
// call's m for fwd and bwd_data, its k (the summed dimension) for bwd_weight.
void run_sm90(GemmState& st, GroupedGemmSm90Op op, int64_t n, int64_t k) {
#if MOP_HAVE_CUTLASS_SM90
  const int64_t num = int64_t(st.calls.size());
  st.reserve_groups(num);
  st.sm90_experts.clear();
  const bool by_rows = op == GroupedGemmSm90Op::Fwd || op == GroupedGemmSm90Op::BwdData;
  for (const GemmCall& g : st.calls) st.sm90_experts.push_back({g.a, g.b, g.c, by_rows ? g.m : g.k});
  int slot = 0;
  void* host = st.acquire_slot(&slot);
  kernels::grouped_gemm_sm90(op, st.sm90_experts.data(), num, n, k, host, st.args.data(),
                             st.sm90_workspace.data(), st.sm90_workspace.bytes(),
                             requested_sm90_config(op), st.stream);
  st.release_slot(slot);
#else
  MOP_UNREACHABLE("run_sm90 without the CUTLASS kernels (sm90_ready() is false)");
#endif
}

void run_expert_gemms(GemmState& st, GroupedGemmSm90Op op, int64_t n, int64_t k) {
  if (st.calls.empty()) return;
  GroupedPath path = requested_grouped_path();
  if (path == GroupedPath::Cutlass || path == GroupedPath::Auto) {
    if (sm90_capable(st, n, k)) {
      run_sm90(st, op, n, k);
      return;
    }
    path = GroupedPath::Cublas;
  }
  const bool capable = grouped_capable(st.calls);
  if (path == GroupedPath::Cublas) {
    int64_t rows = 0;
    for (const GemmCall& g : st.calls) rows += g.m;
    path = capable && rows < kLoopMinMeanRows * int64_t(st.calls.size()) ? GroupedPath::Grouped
                                                                         : GroupedPath::Streams;
  }
  if (path == GroupedPath::Grouped && capable && run_grouped(st)) return;
  if (path == GroupedPath::Streams) {
    run_streams(st);
    return;
  }
  for (const GemmCall& g : st.calls) st.lt.run(g, st.expert_lane(-1));
}

}  // namespace

void CudaBackend::grouped_gemm_fwd(Tensor y, const Tensor& x, const Tensor& w, const Tensor& offsets) {
  const int64_t num_experts = w.shape[0], n = w.shape[1], k = w.shape[2];
  const int32_t* o = offsets.ptr<int32_t>();
  GemmState& st = gemm_state();
  st.calls.clear();
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = o[e + 1] - o[e];
    if (rows == 0) continue;
    // y_e[rows,n] = x_e[rows,k] · w_eᵀ (w_e is [n,k]).
    st.calls.push_back({elem(y, o[e] * n), DType::BF16, elem(x, o[e] * k), false,
                        elem(w, e * n * k), true, rows, n, k, 1, 0});
  }
  run_expert_gemms(st, GroupedGemmSm90Op::Fwd, n, k);
}

void CudaBackend::grouped_gemm_bwd_data(Tensor dx, const Tensor& dy, const Tensor& w,
                                    const Tensor& offsets) {
  const int64_t num_experts = w.shape[0], n = w.shape[1], k = w.shape[2];
  const int32_t* o = offsets.ptr<int32_t>();
  GemmState& st = gemm_state();
  st.calls.clear();
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = o[e + 1] - o[e];
    if (rows == 0) continue;
    // dx_e[rows,k] = dy_e[rows,n] · w_e[n,k].
    st.calls.push_back({elem(dx, o[e] * k), DType::BF16, elem(dy, o[e] * n), false,
                        elem(w, e * n * k), false, rows, k, n, 1, 0});
  }
  run_expert_gemms(st, GroupedGemmSm90Op::BwdData, n, k);
}

void CudaBackend::grouped_gemm_bwd_weight(Tensor dw, const Tensor& dy, const Tensor& x,
                                      const Tensor& offsets, bool accumulate) {
  const int64_t num_experts = dw.shape[0], n = dw.shape[1], k = dw.shape[2];
  const int32_t* o = offsets.ptr<int32_t>();
  GemmState& st = gemm_state();
  st.calls.clear();
  int64_t zero_from = -1;  // writing: a run of experts without rows [zero_from, e) is set to 0
  for (int64_t e = 0; e <= num_experts; ++e) {
    const int64_t rows = e < num_experts ? o[e + 1] - o[e] : -1;
    if (!accumulate && rows == 0 && zero_from < 0) zero_from = e;
    if (rows != 0 && zero_from >= 0) {
      MOP_CUDA_CHECK(cudaMemsetAsync(elem(dw, zero_from * n * k), 0,
                                     size_t((e - zero_from) * n * k) * sizeof(float), stream_));
      zero_from = -1;
    }
    if (rows <= 0) continue;  // accumulating: dw_e += 0 leaves it untouched
    // dw_e[n,k] (+)= dy_e[rows,n]ᵀ · x_e[rows,k]; fp32 C, so never the grouped path.
    st.calls.push_back({elem(dw, e * n * k), DType::F32, elem(dy, o[e] * n), true,
                        elem(x, o[e] * k), false, n, k, rows, 1, accumulate ? 1.0f : 0.0f});
  }
  run_expert_gemms(
      st, accumulate ? GroupedGemmSm90Op::BwdWeight : GroupedGemmSm90Op::BwdWeightWrite, n, k);
}

}  // namespace mop
