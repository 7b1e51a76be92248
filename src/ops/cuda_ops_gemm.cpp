// CudaOps' GEMM family: dense GEMM (cuBLASLt, cuda_gemm_lt.h), grouped expert GEMMs, and the fused
// LM head + cross-entropy (cuBLASLt logits per token chunk, kernels/cross_entropy.cu). A grouped
// GEMM runs as one CUTLASS sm90 grouped kernel ("cutlass"; Hopper, n and k multiples of 8,
// kernels/grouped_gemm_sm90.cuh), one cublasGemmGroupedBatchedEx ("grouped"; bf16 C only), one
// cuBLASLt matmul per non-empty expert ("loop"), or those matmuls spread over side streams
// ("streams"). MOP_GROUPED_GEMM=cutlass|grouped|loop|streams|cublas|auto picks one, read at every
// call so a benchmark can switch; auto (the default) is cutlass where it can run, else cublas:
// grouped for small experts and streams otherwise (kLoopMinMeanRows). A call cutlass cannot take
// goes to cublas, one grouped cannot take to the loop. MOP_GROUPED_GEMM_CONFIG overrides the
// CUTLASS tile configuration (mop_bench's tuning knob; kernels/grouped_gemm_sm90*.cu list them).
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "runtime/cuda_check.h"
#include "kernels/cross_entropy.cuh"
#include "kernels/grouped_gemm_sm90.cuh"
#include "ops/cuda_gemm_lt.h"
#include "ops/cuda_ops.h"

namespace mop {
namespace {

constexpr size_t kMiB = size_t(1) << 20;
// cuBLASLt workspace of the op stream; NVIDIA's guidance for Hopper is at least 32 MiB.
constexpr size_t kWorkspaceBytes = 64 * kMiB;
// Every per-expert matmul is planned with this much workspace, on the op stream and on the side
// streams alike: loop and streams then use the same algorithms and agree bitwise.
constexpr size_t kExpertWorkspaceBytes = 8 * kMiB;
constexpr int kSideStreams = 4;
// Pinned argument-array slots of the grouped and cutlass paths: the host blocks only when it runs
// this many such calls ahead of the device (it must not overwrite a slot whose copy is queued).
constexpr int kPointerSlots = 32;
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

// Device tensor of the given dtype and exactly the given shape.
void expect_cuda(const Tensor& t, const char* name, DType dtype,
                 std::initializer_list<int64_t> dims) {
  expect_tensor(t, name, Device::CUDA, dtype, dims);
}

bool overlap(const Tensor& x, const Tensor& y) {
  const char *xb = static_cast<const char*>(x.data), *yb = static_cast<const char*>(y.data);
  return x.bytes() > 0 && y.bytes() > 0 && xb < yb + y.bytes() && yb < xb + x.bytes();
}

// Address of element i of t (any dtype).
template <class P = void>
P* elem(const Tensor& t, int64_t i) {
  return reinterpret_cast<P*>(static_cast<char*>(t.data) + size_t(i) * dtype_size(t.dtype));
}

// Host i32 [E+1] with 0 = o[0] ≤ … ≤ o[E] ≤ rows (the CPU reference's checks).
const int32_t* check_offsets(const Tensor& offsets, int64_t num_experts, int64_t rows,
                             const char* op) {
  MOP_CHECK(offsets.device == Device::CPU && offsets.dtype == DType::I32 && offsets.ndim == 1 &&
                offsets.shape[0] == num_experts + 1 && offsets.data,
            op, ": offsets must be host i32 [", num_experts + 1, "], is ",
            dtype_name(offsets.dtype), " ", offsets.shape_str(), " on ",
            device_name(offsets.device));
  const int32_t* o = offsets.ptr<int32_t>();
  MOP_CHECK(o[0] == 0, op, ": offsets[0] = ", o[0]);
  for (int64_t e = 0; e < num_experts; ++e)
    MOP_CHECK(o[e] <= o[e + 1], op, ": offsets decrease at expert ", e);
  MOP_CHECK(o[num_experts] <= rows, op, ": offsets[E] = ", o[num_experts], " > ", rows, " rows");
  return o;
}

}  // namespace

struct GemmState {
  explicit GemmState(cudaStream_t op_stream) : stream(op_stream) {
    workspace = Buffer(MemKind::Device, kWorkspaceBytes);
    side_workspace = Buffer(MemKind::Device, kSideStreams * kExpertWorkspaceBytes);
    for (int i = 0; i < kSideStreams; ++i) {
      MOP_CUDA_CHECK(cudaStreamCreateWithFlags(&side[i], cudaStreamNonBlocking));
      MOP_CUDA_CHECK(cudaEventCreateWithFlags(&side_done[i], cudaEventDisableTiming));
    }
    MOP_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    for (cudaEvent_t& e : slot_copied)
      MOP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
#if MOP_HAVE_CUTLASS_SM90
    // The sm_90a kernels run on compute capability 9.0 only.
    int device = 0, major = 0, minor = 0;
    MOP_CUDA_CHECK(cudaGetDevice(&device));
    MOP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    MOP_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (major == 9 && minor == 0)
      sm90_workspace = Buffer(MemKind::Device,
                              std::max<size_t>(kernels::grouped_gemm_sm90_workspace_bytes(), 1));
#endif
  }
  ~GemmState() {
    for (int i = 0; i < kSideStreams; ++i) {
      cudaStreamSynchronize(side[i]);
      cudaStreamDestroy(side[i]);
      cudaEventDestroy(side_done[i]);
    }
    cudaEventDestroy(fork);
    for (cudaEvent_t e : slot_copied) cudaEventDestroy(e);
  }
  GemmState(const GemmState&) = delete;
  GemmState& operator=(const GemmState&) = delete;

  GemmLane lane() const { return {stream, workspace.data(), workspace.bytes()}; }
  // Lane of a per-expert matmul: side stream i, or the op stream for i < 0.
  GemmLane expert_lane(int i) const {
    if (i < 0) return {stream, workspace.data(), kExpertWorkspaceBytes};
    return {side[i], static_cast<char*>(side_workspace.data()) + size_t(i) * kExpertWorkspaceBytes,
            kExpertWorkspaceBytes};
  }

  // Buffers grow only outside prepare (tests, generation): the op stream is drained first, since
  // queued work may still read the old ones.
  void reserve_groups(int64_t groups) {
    if (groups <= group_capacity) return;
    MOP_CUDA_CHECK(cudaStreamSynchronize(stream));
    slot_bytes = size_t(3 * groups) * sizeof(void*);
#if MOP_HAVE_CUTLASS_SM90
    slot_bytes = std::max(slot_bytes, kernels::grouped_gemm_sm90_args_bytes(groups));
#endif
    slot_bytes = (slot_bytes + 255) / 256 * 256;
    args = Buffer(MemKind::Device, slot_bytes);
    args_pinned = Buffer(MemKind::Pinned, kPointerSlots * slot_bytes);
    group_capacity = groups;
    calls.reserve(size_t(groups));
    sm90_experts.reserve(size_t(groups));
    for (auto* v : {&m, &n, &k, &lda, &ldb, &ldc, &group_size}) v->reserve(size_t(groups));
    for (auto* v : {&trans_a, &trans_b}) v->reserve(size_t(groups));
    for (auto* v : {&alpha, &beta}) v->reserve(size_t(groups));
  }
  void reserve_dlogits(int64_t elems) {
    const size_t bytes = size_t(elems) * sizeof(__nv_bfloat16);
    if (bytes <= dlogits.bytes()) return;
    MOP_CUDA_CHECK(cudaStreamSynchronize(stream));
    dlogits = Buffer(MemKind::Device, bytes);
  }
  // The next pinned argument slot, once the launch that last read it has been queued past (see
  // args below); release_slot() after the launch that uses it.
  void* acquire_slot(int* slot) {
    *slot = next_slot;
    next_slot = (next_slot + 1) % kPointerSlots;
    MOP_CUDA_CHECK(cudaEventSynchronize(slot_copied[size_t(*slot)]));
    return static_cast<char*>(args_pinned.data()) + size_t(*slot) * slot_bytes;
  }
  void release_slot(int slot) {
    MOP_CUDA_CHECK(cudaEventRecord(slot_copied[size_t(slot)], stream));
  }
  bool sm90_ready() const { return sm90_workspace.bytes() > 0; }
  size_t bytes() const {
    return workspace.bytes() + side_workspace.bytes() + args.bytes() + args_pinned.bytes() +
           sm90_workspace.bytes() + dlogits.bytes();
  }

  cudaStream_t stream;
  LtGemm lt;
  Buffer workspace;       // device, kWorkspaceBytes: every op-stream cuBLASLt/cuBLAS call
  Buffer side_workspace;  // device, kSideStreams × kExpertWorkspaceBytes
  std::array<cudaStream_t, kSideStreams> side{};
  std::array<cudaEvent_t, kSideStreams> side_done{};
  cudaEvent_t fork = nullptr;

  // Per-expert matmuls of the current grouped call (non-empty experts only).
  std::vector<GemmCall> calls;
  // Argument arrays of one grouped launch (cublasGemmGroupedBatchedEx's [A(G) | B(G) | C(G)]
  // pointers, or the CUTLASS kernel's shapes, pointers and strides): written on the host into
  // pinned slot s of [kPointerSlots][slot_bytes], copied by one cudaMemcpyAsync into `args`, which
  // the launch reads. `args` is reused in stream order; slot_copied[s] is recorded after the launch
  // and waited on before slot s is written again, so the host never blocks on the device unless
  // it runs kPointerSlots launches ahead.
  int64_t group_capacity = 0;
  size_t slot_bytes = 0;
  Buffer args, args_pinned;
  std::array<cudaEvent_t, kPointerSlots> slot_copied{};
  int next_slot = 0;
  // CUTLASS kernels: their per-SM TMA descriptors (allocated once; empty when the kernels are not
  // built or the device is not sm_90), and the experts of the current call.
  Buffer sm90_workspace;
  std::vector<kernels::GroupedGemmSm90Expert> sm90_experts;
  std::vector<cublasOperation_t> trans_a, trans_b;
  std::vector<int> m, n, k, lda, ldb, ldc, group_size;
  std::vector<float> alpha, beta;

  Buffer dlogits;  // device bf16 [C,V]: one LM-head chunk's dlogits
};

void GemmStateDeleter::operator()(GemmState* s) const {
  delete s;
}

namespace {

GemmState& gemm_state(std::unique_ptr<GemmState, GemmStateDeleter>& slot, cudaStream_t stream) {
  if (!slot) slot.reset(new GemmState(stream));
  return *slot;
}

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

struct LmHeadShape {
  int64_t tokens, hidden, vocab, chunk;
};

LmHeadShape check_lmhead(const Tensor& x, const Tensor& w, const Tensor& targets,
                         const Tensor& workspace, const char* op) {
  MOP_CHECK(x.ndim == 2 && w.ndim == 2 && workspace.ndim == 2, op, ": x ", x.shape_str(), ", w ",
            w.shape_str(), ", workspace ", workspace.shape_str());
  const LmHeadShape s{x.shape[0], x.shape[1], w.shape[0], workspace.shape[0]};
  MOP_CHECK(s.chunk >= 1, op, ": the workspace holds no rows");
  MOP_CHECK(s.vocab >= 1, op, ": empty vocabulary");
  expect_cuda(x, "lmhead_ce: x", DType::BF16, {s.tokens, s.hidden});
  expect_cuda(w, "lmhead_ce: w", DType::BF16, {s.vocab, s.hidden});
  expect_cuda(workspace, "lmhead_ce: workspace", DType::F32, {s.chunk, s.vocab});
  expect_cuda(targets, "lmhead_ce: targets", DType::I32, {s.tokens});
  return s;
}

// logits[rows,V] (fp32, the workspace) = x[t0 : t0+rows] · wᵀ.
GemmCall chunk_logits(const Tensor& workspace, const Tensor& x, const Tensor& w, int64_t t0,
                      int64_t rows, const LmHeadShape& s) {
  return {workspace.data,
          DType::F32,
          elem(x, t0 * s.hidden),
          false,
          w.data,
          true,
          rows,
          s.vocab,
          s.hidden,
          1,
          0};
}

}  // namespace

void CudaOps::prepare_gemm(const OpShapes& shapes) {
  GemmState& st = gemm_state(gemm_, stream_);
  if (shapes.experts > 0) st.reserve_groups(shapes.experts);
  if (shapes.lm_head_chunk > 0 && shapes.vocab > 0)
    st.reserve_dlogits(shapes.lm_head_chunk * shapes.vocab);
}

size_t CudaOps::gemm_workspace_bytes() const {
  return gemm_ ? gemm_->bytes() : 0;
}

void CudaOps::gemm(Tensor c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                   float alpha, float beta) {
  MOP_CHECK(a.ndim == 2 && b.ndim == 2 && c.ndim == 2, "gemm: a ", a.shape_str(), ", b ",
            b.shape_str(), ", c ", c.shape_str(), " must be matrices");
  const int64_t m = trans_a ? a.shape[1] : a.shape[0];
  const int64_t k = trans_a ? a.shape[0] : a.shape[1];
  const int64_t n = trans_b ? b.shape[0] : b.shape[1];
  const int64_t kb = trans_b ? b.shape[1] : b.shape[0];
  MOP_CHECK(k == kb, "gemm: inner dims differ: op(a) is [", m, ",", k, "], op(b) is [", kb, ",", n,
            "]");
  expect_cuda(a, "gemm: a", DType::BF16, {a.shape[0], a.shape[1]});
  expect_cuda(b, "gemm: b", DType::BF16, {b.shape[0], b.shape[1]});
  MOP_CHECK(c.dtype == DType::BF16 || c.dtype == DType::F32, "gemm: c has dtype ",
            dtype_name(c.dtype), ", expected bf16 or f32");
  expect_cuda(c, "gemm: c", c.dtype, {m, n});
  MOP_CHECK(!overlap(c, a) && !overlap(c, b), "gemm: c must not alias a or b");
  GemmState& st = gemm_state(gemm_, stream_);
  st.lt.run({c.data, c.dtype, a.data, trans_a, b.data, trans_b, m, n, k, alpha, beta}, st.lane());
}

void CudaOps::grouped_gemm_fwd(Tensor y, const Tensor& x, const Tensor& w, const Tensor& offsets) {
  MOP_CHECK(w.ndim == 3 && x.ndim == 2 && y.ndim == 2, "grouped_gemm_fwd: w ", w.shape_str(),
            ", x ", x.shape_str(), ", y ", y.shape_str());
  const int64_t num_experts = w.shape[0], n = w.shape[1], k = w.shape[2];
  expect_cuda(w, "grouped_gemm_fwd: w", DType::BF16, {num_experts, n, k});
  expect_cuda(x, "grouped_gemm_fwd: x", DType::BF16, {x.shape[0], k});
  expect_cuda(y, "grouped_gemm_fwd: y", DType::BF16, {y.shape[0], n});
  const int32_t* o =
      check_offsets(offsets, num_experts, std::min(x.shape[0], y.shape[0]), "grouped_gemm_fwd");
  GemmState& st = gemm_state(gemm_, stream_);
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

void CudaOps::grouped_gemm_bwd_data(Tensor dx, const Tensor& dy, const Tensor& w,
                                    const Tensor& offsets) {
  MOP_CHECK(w.ndim == 3 && dx.ndim == 2 && dy.ndim == 2, "grouped_gemm_bwd_data: w ", w.shape_str(),
            ", dx ", dx.shape_str(), ", dy ", dy.shape_str());
  const int64_t num_experts = w.shape[0], n = w.shape[1], k = w.shape[2];
  expect_cuda(w, "grouped_gemm_bwd_data: w", DType::BF16, {num_experts, n, k});
  expect_cuda(dx, "grouped_gemm_bwd_data: dx", DType::BF16, {dx.shape[0], k});
  expect_cuda(dy, "grouped_gemm_bwd_data: dy", DType::BF16, {dy.shape[0], n});
  const int32_t* o = check_offsets(offsets, num_experts, std::min(dx.shape[0], dy.shape[0]),
                                   "grouped_gemm_bwd_data");
  GemmState& st = gemm_state(gemm_, stream_);
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

void CudaOps::grouped_gemm_bwd_weight(Tensor dw, const Tensor& dy, const Tensor& x,
                                      const Tensor& offsets, bool accumulate) {
  MOP_CHECK(dw.ndim == 3 && x.ndim == 2 && dy.ndim == 2, "grouped_gemm_bwd_weight: dw ",
            dw.shape_str(), ", x ", x.shape_str(), ", dy ", dy.shape_str());
  const int64_t num_experts = dw.shape[0], n = dw.shape[1], k = dw.shape[2];
  expect_cuda(dw, "grouped_gemm_bwd_weight: dw", DType::F32, {num_experts, n, k});
  expect_cuda(x, "grouped_gemm_bwd_weight: x", DType::BF16, {x.shape[0], k});
  expect_cuda(dy, "grouped_gemm_bwd_weight: dy", DType::BF16, {dy.shape[0], n});
  const int32_t* o = check_offsets(offsets, num_experts, std::min(x.shape[0], dy.shape[0]),
                                   "grouped_gemm_bwd_weight");
  GemmState& st = gemm_state(gemm_, stream_);
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

void CudaOps::lmhead_ce_fwd(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w,
                            const Tensor& targets, Tensor workspace) {
  const LmHeadShape s = check_lmhead(x, w, targets, workspace, "lmhead_ce_fwd");
  expect_cuda(loss, "lmhead_ce_fwd: loss", DType::F32, {s.tokens});
  expect_cuda(lse, "lmhead_ce_fwd: lse", DType::F32, {s.tokens});
  GemmState& st = gemm_state(gemm_, stream_);
  for (int64_t t0 = 0; t0 < s.tokens; t0 += s.chunk) {
    const int64_t rows = std::min(s.chunk, s.tokens - t0);
    st.lt.run(chunk_logits(workspace, x, w, t0, rows, s), st.lane());
    kernels::cross_entropy_fwd(loss.ptr<float>() + t0, lse.ptr<float>() + t0,
                               workspace.ptr<float>(), targets.ptr<int32_t>() + t0, rows, s.vocab,
                               stream_);
  }
}

void CudaOps::lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w,
                            const Tensor& targets, const Tensor& lse, float grad_scale,
                            Tensor workspace) {
  lmhead(nullptr, lse, dx, dw, x, w, targets, grad_scale, workspace, "lmhead_ce_bwd");
}

void CudaOps::lmhead_ce_fwd_bwd(Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                                const Tensor& w, const Tensor& targets, float grad_scale,
                                Tensor workspace) {
  lmhead(&loss, lse, dx, dw, x, w, targets, grad_scale, workspace, "lmhead_ce_fwd_bwd");
}

// The gradient passes, with the forward's too when `loss` is given (each chunk's logits computed
// once; the same kernels and GEMMs as forward then backward, so the same bits).
void CudaOps::lmhead(Tensor* loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                     const Tensor& w, const Tensor& targets, float grad_scale, Tensor workspace,
                     const char* op) {
  const LmHeadShape s = check_lmhead(x, w, targets, workspace, op);
  if (loss) expect_cuda(*loss, "lmhead_ce: loss", DType::F32, {s.tokens});
  expect_cuda(lse, "lmhead_ce: lse", DType::F32, {s.tokens});
  expect_cuda(dx, "lmhead_ce: dx", DType::BF16, {s.tokens, s.hidden});
  expect_cuda(dw, "lmhead_ce: dw", DType::F32, {s.vocab, s.hidden});
  if (s.tokens == 0) return;
  GemmState& st = gemm_state(gemm_, stream_);
  st.reserve_dlogits(std::min(s.chunk, s.tokens) * s.vocab);
  auto* dlogits = static_cast<__nv_bfloat16*>(st.dlogits.data());
  for (int64_t t0 = 0; t0 < s.tokens; t0 += s.chunk) {
    const int64_t rows = std::min(s.chunk, s.tokens - t0);
    st.lt.run(chunk_logits(workspace, x, w, t0, rows, s), st.lane());
    if (loss)
      kernels::cross_entropy_fwd(loss->ptr<float>() + t0, lse.ptr<float>() + t0,
                                 workspace.ptr<float>(), targets.ptr<int32_t>() + t0, rows,
                                 s.vocab, stream_);
    kernels::cross_entropy_bwd(dlogits, workspace.ptr<float>(), lse.ptr<float>() + t0,
                               targets.ptr<int32_t>() + t0, grad_scale, rows, s.vocab, stream_);
    // dx[chunk] = dlogits[rows,V] · w[V,H] (overwrite);  dw[V,H] += dlogits[rows,V]ᵀ · x[chunk].
    st.lt.run({elem(dx, t0 * s.hidden), DType::BF16, dlogits, false, w.data, false, rows, s.hidden,
               s.vocab, 1, 0},
              st.lane());
    st.lt.run({dw.data, DType::F32, dlogits, true, elem(x, t0 * s.hidden), false, s.vocab,
               s.hidden, rows, 1, 1},
              st.lane());
  }
}

}  // namespace mop
