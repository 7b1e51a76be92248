// Internal to the CUDA backend: GemmState, the device state the GEMM stems share (gemm,
// grouped_gemm, lmhead) — the cuBLASLt plans and workspace of the op stream, the side streams of
// the per-expert matmuls, the pinned argument slots of grouped launches, the CUTLASS kernels'
// workspace and the LM head's dlogits chunk. Created by CudaBackend::gemm_state().
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <vector>

#include "kernels/grouped_gemm_sm90.cuh"
#include "ops/cuda/gemm_lt.h"
#include "runtime/cuda_check.h"
#include "runtime/memory.h"

namespace mop {

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

}  // namespace mop
