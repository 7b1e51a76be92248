// Hopper grouped expert GEMMs on CUTLASS's sm90 "ptr-array" grouped kernels (TMA loads, WGMMA,
// warp-specialized and persistent over the tiles of all experts): one launch per call, whatever
// the number of rows per expert. Built only with the CUTLASS headers and sm_90a
// (MOP_HAVE_CUTLASS_SM90); src/ops/cuda/grouped_gemm.cpp falls back to cuBLAS without them. Plain
// declarations only, so host C++ files include this header.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace mop::kernels {

// The three expert GEMMs of src/ops/ops.h, per expert e (w_e is bf16 [n,k], rows_e ≥ 1):
//   Fwd        y_e[rows_e,n]  = x_e[rows_e,k] · w_eᵀ     a = x_e,  b = w_e, d = y_e  (bf16)
//   BwdData    dx_e[rows_e,k] = dy_e[rows_e,n] · w_e     a = dy_e, b = w_e, d = dx_e (bf16)
//   BwdWeight  dw_e[n,k]     += dy_eᵀ · x_e              a = dy_e, b = x_e, d = dw_e (fp32)
//   BwdWeightWrite  dw_e[n,k] = dy_eᵀ · x_e              the same, dw_e written, never read
// All operands are contiguous row-major; accumulation is fp32.
enum class GroupedGemmSm90Op { Fwd, BwdData, BwdWeight, BwdWeightWrite };

struct GroupedGemmSm90Expert {
  const void* a;
  const void* b;
  void* d;
  int64_t rows;
};

// TMA moves 16-byte aligned rows: n and k multiples of 8, every pointer 16-byte aligned, sizes
// within int32. The caller takes another path for anything else.
constexpr int64_t kGroupedGemmSm90Multiple = 8;

// Host or pinned bytes of one call's argument arrays for num_experts experts (problem shapes,
// pointers, strides), and the device copy of the same size.
size_t grouped_gemm_sm90_args_bytes(int64_t num_experts);
// Device workspace every call needs (per-SM TMA descriptors), allocated once by the caller.
size_t grouped_gemm_sm90_workspace_bytes();

// Number of tile configurations built for op (a tuning knob for mop_bench), and the name of one.
int grouped_gemm_sm90_num_configs(GroupedGemmSm90Op op);
const char* grouped_gemm_sm90_config_name(GroupedGemmSm90Op op, int config);

// One launch over experts[0..num_experts) (every rows ≥ 1; experts with no rows are left out by
// the caller). Writes the argument arrays to host_args (pinned; the caller guarantees no queued
// copy still reads it), copies them to dev_args on the stream, then launches there. config < 0
// picks the op's default tile configuration (chosen by measurement on the H200). No allocation,
// no synchronisation.
void grouped_gemm_sm90(GroupedGemmSm90Op op, const GroupedGemmSm90Expert* experts,
                       int64_t num_experts, int64_t n, int64_t k, void* host_args, void* dev_args,
                       void* workspace, size_t workspace_bytes, int config, cudaStream_t stream);

}  // namespace mop::kernels
