// ParamStore: the model's compute weights and their gradients, each in one flat buffer laid out
// by the ModelLayout (parameter p at offset(p) elements, aligned to kParamAlign elements), so
// optimizer state, checkpoints and communication address the same offsets.
#pragma once

#include <vector>

#include "core/exact_sum.h"
#include "model/model_spec.h"
#include "runtime/memory.h"

namespace mop {

constexpr int64_t kParamAlign = 64;  // elements: keeps every parameter 128-byte aligned in bf16
constexpr int64_t aligned_numel(int64_t n) { return (n + kParamAlign - 1) / kParamAlign * kParamAlign; }

// The step's segments, in forward order: 0 the embedding, 1..L the layers, L+1 the final norm and
// the LM head. Host updates, weight uploads and gradient sums are pipelined per segment.
inline int num_segments(const ModelDims& d) { return int(d.layers) + 2; }
// The segment whose forward first reads parameter p (a tied LM head: the embedding's).
int param_segment(const ModelLayout& layout, int p);

// Elements of each of `parts` slices of a parameter of `numel`: ceil(numel / parts) rounded up to
// kParamAlign (the last slice padded with zeros), so every slice starts at a multiple of the
// sumsq op's blocks and the slices' exact sums of squares add up to the whole parameter's (the
// gradient norm is the same on every layout); one slice is the parameter itself.
inline int64_t slice_numel(int64_t numel, int parts) {
  static_assert(kParamAlign % kSumsqBlock == 0, "slices start at whole sumsq blocks");
  return parts == 1 ? numel : aligned_numel((numel + parts - 1) / parts);
}

// The slots a step binds parameter groups to, declared once: the step program records them
// (plan/program.h, StepProgram::slots) and its passes count against them, the store allocates
// them, the plan's memory prices them. Two shared slots: a segment's in use while the next one's
// weights are gathered into the other (its gradients: written by a backward while the segment
// before is reduce-scattered or copied out). A tied embedding is read by the first and the last
// segment: it has a slot of its own, after the shared ones.
constexpr int kSharedSlots = 2;
struct StepSlots {
  int shared_weights = 0;        // sliced: gathered segments' whole weights, in turn
  bool tied_weights = false;     // sliced, tied embedding: its own weight slot
  int shared_grads = 0;          // whole gradients in flight (sliced with one micro-batch, streamed)
  bool tied_grads = false;       // ... the tied embedding's own gradient slot
  bool grads_per_group = false;  // sliced over several micro-batches: every group's for the step
  bool operator==(const StepSlots&) const = default;
};
// sliced: parallel.shard: slice; pool_grads: sliced with one micro-batch; streams: some segments'
// gradients streamed (whole parameters); tied: the LM head reads the embedding.
StepSlots step_slots(bool sliced, bool pool_grads, bool streams, bool tied);

// Sliced parameters (ZeRO-3): parameter p is cut into n[p] slices of slice_numel(p) =
// slice_numel(numel, n[p]) elements and this rank keeps slice index[p].
// The whole weights of a segment exist only while it is bound to a gather slot (StepSlots: the
// schedule gathers every replica's slice into it); the whole gradients likewise with pool_grads
// (one micro-batch per step: a segment's are final after its backward), else for the whole step.
// A parameter of one replica (n = 1) is its own slice and is used in place: no slot, no copies.
struct ParamSlices {
  std::vector<int> n, index;  // per parameter
  bool pool_grads = true;
  bool allocate = true;  // false: sizes only (the plan's memory)
};

// Streamed gradients (whole parameters, optim.gradients: host): the gradients of the segments
// marked in `segments` (a tied embedding's with segment 0's, in a slot of its own) exist only
// while their group is bound to a slot (StepSlots: shared by the segments), so only the segments
// in flight have them; every other parameter's are in one buffer for the whole step.
struct PooledGrads {
  std::vector<bool> segments;  // per segment
  bool allocate = true;
};

// A pipeline stage's store (`segments`: per segment whether this rank runs it; empty: every
// segment) holds only the parameters of its segments: the others take no memory, and asking for
// their weights or gradients is an internal error (held() says which are here).
class ParamStore {
 public:
  // allocate = false gives a store of shapes only (for planning memory without using it).
  ParamStore(const ModelLayout& layout, DType weight_dtype, DType grad_dtype, MemKind mem,
             bool allocate = true, std::vector<bool> segments = {});
  // Sliced (see ParamSlices).
  ParamStore(const ModelLayout& layout, DType weight_dtype, DType grad_dtype, MemKind mem,
             ParamSlices slices, std::vector<bool> segments = {});
  // Whole parameters, some segments' gradients pooled (see PooledGrads).
  ParamStore(const ModelLayout& layout, DType weight_dtype, DType grad_dtype, MemKind mem,
             PooledGrads pooled, std::vector<bool> segments = {});

  const ModelLayout& layout() const { return layout_; }
  int num_params() const { return int(layout_.params.size()); }
  bool held(int p) const { return held_.empty() || held_[size_t(p)]; }  // by this pipeline stage
  int64_t offset(int p) const { return offsets_[p]; }
  int64_t total_elements() const { return total_; }  // including alignment padding

  Tensor weight(int p) const {
    return sliced() ? in_slot(weight_slots_, weight_slot_, weight_dtype_, p, false, "weights")
                    : shaped(weights_, weight_dtype_, p);
  }
  Tensor grad(int p) const {
    if (sliced() || grad_pooled(p)) return in_slot(grad_slots_, grad_slot_, grad_dtype_, p, false, "gradients");
    return grad_off_.empty() ? shaped(grads_, grad_dtype_, p) : resident_grad(p);
  }
  Tensor weights_flat() const;
  Tensor grads_flat() const;
  DType weight_dtype() const { return weight_dtype_; }
  DType grad_dtype() const { return grad_dtype_; }

  // A parameter's slot in any flat buffer with the same layout (master weights, Adam m and v).
  Tensor shaped(const Buffer& flat, DType dtype, int p) const;
  Tensor shaped_view(void* flat_base, DType dtype, Device device, int p) const;

  // Sliced stores. weight(p) and grad(p) need p's gather group bound (else an internal error).
  bool sliced() const { return !slices_.n.empty(); }
  int slice_count(int p) const { return slices_.n[size_t(p)]; }
  int slice_index(int p) const { return slices_.index[size_t(p)]; }
  int64_t slice_numel(int p) const { return slice_numel_[size_t(p)]; }
  Tensor slice_weight(int p) const;  // [slice_numel]: this rank's weights (compute dtype)
  Tensor slice_grad(int p) const;    // [slice_numel]: its summed gradients (grad dtype)
  // p's whole weights / gradients as [n · slice_numel] (padding included): what a gather fills
  // and a reduce-scatter reads.
  Tensor gathered_weight(int p) const;
  Tensor padded_grad(int p) const;
  // Gather groups: segment s's parameters, or (tied embedding) the group num_segments() of its
  // own. bind_* gives the group a slot (slots(): shared by the segments, the tied embedding's its
  // own; a group bound twice is bound once); release_* frees it.
  int gather_group(int p) const { return group_of_[size_t(p)]; }
  int num_gather_groups() const { return int(group_params_.size()); }
  const std::vector<int>& group_params(int g) const { return group_params_[size_t(g)]; }
  bool weights_bound(int g) const { return weight_slot_[size_t(g)] >= 0; }
  bool grads_bound(int g) const { return !group_pooled(g) || grad_slot_[size_t(g)] >= 0; }
  bool pools_grads() const { return slices_.pool_grads; }
  const StepSlots& slots() const { return slots_; }
  // Pooled gradients (sliced with pool_grads, or PooledGrads): whether group g's / parameter p's
  // gradients live in a slot, and which slot group g has (-1: none).
  bool group_pooled(int g) const { return !pooled_group_.empty() && pooled_group_[size_t(g)]; }
  bool grad_pooled(int p) const { return !group_of_.empty() && group_pooled(group_of_[size_t(p)]); }
  bool streams_grads() const { return !sliced() && !pooled_group_.empty(); }  // a PooledGrads store
  int grad_slot(int g) const { return grad_slot_[size_t(g)]; }
  void bind_weights(int g);
  void release_weights(int g);
  // A pooled group's gradients get a slot (the caller zeroes them or fills them): of the free
  // shared slots the one freed longest ago, so what still reads the slot freed last (a copy to
  // the host) can go on beside the next segment.
  void bind_grads(int g);
  void release_grads(int g);
  // Device bytes of the weights and the gradients (sliced: slices and slots together).
  size_t weight_bytes() const;
  size_t grad_bytes() const;

 private:
  Tensor in_slot(const std::vector<Buffer>& slots, const std::vector<int>& bound, DType dtype, int p,
                 bool padded, const char* what) const;
  int bind(std::vector<int>& bound, std::vector<int>& owner, std::vector<uint64_t>& freed, int shared, int g);
  void release(std::vector<int>& bound, std::vector<int>& owner, std::vector<uint64_t>& freed, int g);
  Tensor resident_grad(int p) const;  // a PooledGrads store's unpooled gradients
  void check_held(int p) const;

  const ModelLayout& layout_;
  DType weight_dtype_, grad_dtype_;
  std::vector<int64_t> offsets_;
  std::vector<char> held_;  // per parameter (empty: all)
  int64_t total_ = 0;
  Buffer weights_, grads_;
  // Sliced: per parameter its slice's length and offset in the slice buffers, its gather group
  // and offset in the group's slot; per group its slot (-1: released); per slot its group.
  ParamSlices slices_;
  StepSlots slots_;
  std::vector<int64_t> slice_numel_, slice_off_, slot_off_;
  std::vector<int> group_of_;
  std::vector<std::vector<int>> group_params_;
  std::vector<int> weight_slot_, grad_slot_, weight_owner_, grad_owner_;
  std::vector<uint64_t> weight_freed_, grad_freed_;  // per slot: when it was last released
  uint64_t releases_ = 0;
  std::vector<char> pooled_group_;  // per group: its gradients in a slot
  std::vector<int64_t> grad_off_;   // PooledGrads: per parameter its offset in grads_ (-1: pooled)
  Buffer slice_weights_, slice_grads_;
  size_t weight_bytes_ = 0, grad_bytes_ = 0;
  // The shared slots first, then the tied embedding's (sliced over several micro-batches: the
  // gradients' one per group).
  std::vector<Buffer> weight_slots_, grad_slots_;
};

// Initial fp32 values of parameter p into dst (its numel() floats): weight matrices
// ~ N(0, init_std²), norm weights 1. Each value is a pure function of (seed, checkpoint tensor
// name, index), so it does not depend on the fused layout or on sharding.
void init_param(const ModelLayout& layout, int p, float* dst, uint64_t seed);

}  // namespace mop
