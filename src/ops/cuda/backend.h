// CudaBackend: the hooks of the CUDA backend. Compute tensors are bf16, acc tensors (weight
// gradients, statistics, router tensors, losses) fp32. Everything runs on one stream in issue
// order; hooks return without synchronising except where a host tensor is written (copy to host).
// The front has checked every argument's shape, dtype and device; hooks check only the limits of
// their kernels. Each stem's hooks are in src/ops/cuda/<stem>.cpp; a family of stems that shares
// device state keeps it in one struct, defined in its own file:
//   backend.cpp      context, copy(), prepare, workspace bytes
//   elementwise.cpp  PointwiseState (reduction partials, RMSNorm dw partials, embedding sort
//                    buffers, RoPE tables; pointwise.h), shared by embedding, rmsnorm, rope
//   gemm.cpp         GemmState (cuBLASLt, side streams, grouped arguments; gemm_state.h), shared
//                    by grouped_gemm and lmhead
//   router.cpp       MoeState (route plan histograms, aux-loss partials; moe_state.h), shared by
//                    moe_permute
//   attention.cpp    AttentionState (cuDNN plans and workspace)
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "ops/ops.h"
#include "runtime/memory.h"

namespace mop {

// Per-family state, defined in the family's file (opaque here).
struct GemmState;
struct AttentionState;
struct MoeState;
struct PointwiseState;
struct GemmStateDeleter { void operator()(GemmState*) const; };
struct AttentionStateDeleter { void operator()(AttentionState*) const; };
struct MoeStateDeleter { void operator()(MoeState*) const; };
struct PointwiseStateDeleter { void operator()(PointwiseState*) const; };

class CudaBackend final : public OpsBackend {
 public:
  CudaBackend();
  ~CudaBackend() override;
  Device device() const override { return Device::CUDA; }
  std::vector<DType> compute_dtypes() const override { return {DType::BF16}; }
  void synchronize() override;
  void prepare(const OpShapes& shapes) override;
  size_t workspace_bytes() const override;
  Stream stream() const override { return Stream::wrap(Device::CUDA, stream_); }
  cudaStream_t cuda_stream() const { return stream_; }

#define MOP_OP(name, category, params, args) void name params override;
#include "ops/op_list.inc"
#undef MOP_OP

  // Family state, created at first use (prepare or the first call); defined in the family files.
  GemmState& gemm_state();
  AttentionState& attention_state();
  MoeState& moe_state();
  PointwiseState& pointwise_state();
  // Elementwise dtype conversion of n elements between device buffers (elementwise.cpp).
  void convert_device(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n);

 private:
  void prepare_gemm(const OpShapes& shapes);
  void prepare_attention(const OpShapes& shapes);
  void prepare_moe(const OpShapes& shapes);
  void prepare_pointwise(const OpShapes& shapes);
  size_t gemm_workspace_bytes() const;
  size_t attention_workspace_bytes() const;
  size_t moe_workspace_bytes() const;
  size_t pointwise_workspace_bytes() const;

  cudaStream_t stream_ = nullptr;
  Buffer staging_;  // pinned: host side of small cross-device conversions
  std::unique_ptr<GemmState, GemmStateDeleter> gemm_;
  std::unique_ptr<AttentionState, AttentionStateDeleter> attention_;
  std::unique_ptr<MoeState, MoeStateDeleter> moe_;
  std::unique_ptr<PointwiseState, PointwiseStateDeleter> pointwise_;
};

// Address of element i of t (any dtype).
template <class P = void>
P* elem(const Tensor& t, int64_t i) {
  return reinterpret_cast<P*>(static_cast<char*>(t.data) + size_t(i) * dtype_size(t.dtype));
}

}  // namespace mop
