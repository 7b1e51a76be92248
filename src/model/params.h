// ParamStore: the model's compute weights and their gradients, each in one flat buffer laid out
// by the ModelLayout (parameter p at offset(p) elements, aligned to kParamAlign elements), so
// optimizer state, checkpoints and communication address the same offsets.
#pragma once

#include <vector>

#include "core/memory.h"
#include "model/model_spec.h"

namespace mop {

constexpr int64_t kParamAlign = 64;  // elements: keeps every parameter 128-byte aligned in bf16
constexpr int64_t aligned_numel(int64_t n) { return (n + kParamAlign - 1) / kParamAlign * kParamAlign; }

// The step's segments, in forward order: 0 the embedding, 1..L the layers, L+1 the final norm and
// the LM head. Host updates, weight uploads and gradient sums are pipelined per segment.
inline int num_segments(const ModelDims& d) { return int(d.layers) + 2; }
// The segment whose forward first reads parameter p (a tied LM head: the embedding's).
int param_segment(const ModelLayout& layout, int p);

class ParamStore {
 public:
  // allocate = false gives a store of shapes only (for planning memory without using it).
  ParamStore(const ModelLayout& layout, DType weight_dtype, DType grad_dtype, MemKind mem,
             bool allocate = true);

  const ModelLayout& layout() const { return layout_; }
  int num_params() const { return int(layout_.params.size()); }
  int64_t offset(int p) const { return offsets_[p]; }
  int64_t total_elements() const { return total_; }  // including alignment padding

  Tensor weight(int p) const { return shaped(weights_, weight_dtype_, p); }
  Tensor grad(int p) const { return shaped(grads_, grad_dtype_, p); }
  Tensor weights_flat() const;
  Tensor grads_flat() const;
  DType weight_dtype() const { return weight_dtype_; }
  DType grad_dtype() const { return grad_dtype_; }

  // A parameter's slot in any flat buffer with the same layout (master weights, Adam m and v).
  Tensor shaped(const Buffer& flat, DType dtype, int p) const;
  Tensor shaped_view(void* flat_base, DType dtype, Device device, int p) const;

 private:
  const ModelLayout& layout_;
  DType weight_dtype_, grad_dtype_;
  std::vector<int64_t> offsets_;
  int64_t total_ = 0;
  Buffer weights_, grads_;
};

// Initial fp32 values of parameter p into dst (its numel() floats): weight matrices
// ~ N(0, init_std²), norm weights 1. Each value is a pure function of (seed, checkpoint tensor
// name, index), so it does not depend on the fused layout or on sharding.
void init_param(const ModelLayout& layout, int p, float* dst, uint64_t seed);

}  // namespace mop
