// Parameter storage layout and deterministic initialisation.
#include "model/params.h"

#include <algorithm>

#include "core/rng.h"

namespace mop {

int param_segment(const ModelLayout& layout, int p) {
  const ParamDef& def = layout.params[p];
  if (def.layer >= 0) return def.layer + 1;
  if (p == layout.embedding) return 0;
  return int(layout.dims.layers) + 1;  // final norm, untied LM head
}

StepSlots step_slots(bool sliced, bool pool_grads, bool streams, bool tied) {
  StepSlots s;
  if (sliced) {
    s.shared_weights = kSharedSlots, s.tied_weights = tied;
    if (!pool_grads) s.grads_per_group = true;
  }
  if ((sliced && pool_grads) || (!sliced && streams)) s.shared_grads = kSharedSlots, s.tied_grads = tied;
  return s;
}

ParamStore::ParamStore(const ModelLayout& layout, DType weight_dtype, DType grad_dtype, MemKind mem,
                       bool allocate, std::vector<bool> segments)
    : layout_(layout), weight_dtype_(weight_dtype), grad_dtype_(grad_dtype) {
  MOP_CHECK(segments.empty() || int(segments.size()) == num_segments(layout.dims), "a stage of ",
            segments.size(), " segments for a model of ", num_segments(layout.dims));
  for (int p = 0; p < num_params(); ++p) {
    if (!segments.empty()) held_.push_back(segments[size_t(param_segment(layout, p))]);
    offsets_.push_back(total_);
    if (held(p)) total_ += aligned_numel(layout.params[p].numel());
  }
  if (!allocate) return;
  weights_ = Buffer(mem, size_t(total_) * dtype_size(weight_dtype));
  grads_ = Buffer(mem, size_t(total_) * dtype_size(grad_dtype));
}

ParamStore::ParamStore(const ModelLayout& layout, DType weight_dtype, DType grad_dtype, MemKind mem,
                       ParamSlices slices, std::vector<bool> stage)
    : ParamStore(layout, weight_dtype, grad_dtype, mem, /*allocate=*/false, std::move(stage)) {
  const int n = num_params();
  MOP_CHECK(int(slices.n.size()) == n && int(slices.index.size()) == n, "slices of ",
            slices.n.size(), " parameters for ", n);
  slices_ = std::move(slices);
  const int segments = num_segments(layout.dims);
  const bool tied = layout.lm_head == layout.embedding;
  group_params_.assign(size_t(segments + (tied ? 1 : 0)), {});
  int64_t slice_total = 0;
  std::vector<int64_t> group_elems(group_params_.size(), 0);
  for (int p = 0; p < n; ++p) {
    const int parts = slices_.n[size_t(p)];
    MOP_CHECK(parts >= 1 && slices_.index[size_t(p)] >= 0 && slices_.index[size_t(p)] < parts,
              "slice ", slices_.index[size_t(p)], " of ", parts);
    // Another stage's parameter: no slice, no room in its group's slot.
    const int64_t k = held(p) ? mop::slice_numel(layout.params[p].numel(), parts) : 0;
    slice_numel_.push_back(k);
    slice_off_.push_back(slice_total);
    slice_total += aligned_numel(k);
    const int g = tied && p == layout.embedding ? segments : param_segment(layout, p);
    group_of_.push_back(g);
    group_params_[size_t(g)].push_back(p);
    // One replica: the slice is the whole parameter, used in place (no slot, nothing gathered).
    slot_off_.push_back(parts == 1 || !held(p) ? -1 : group_elems[size_t(g)]);
    if (parts > 1 && held(p)) group_elems[size_t(g)] += aligned_numel(parts * k);
  }
  const int64_t shared = *std::max_element(group_elems.begin(), group_elems.begin() + segments);
  const int groups = num_gather_groups();
  // Slot sizes (StepSlots): the shared ones of the largest segment and the tied embedding's own,
  // for the weights; the same for pooled gradients, else one per group.
  slots_ = step_slots(/*sliced=*/true, slices_.pool_grads, /*streams=*/false, tied);
  std::vector<int64_t> wslots(size_t(slots_.shared_weights), shared), gslots;
  if (slots_.tied_weights) wslots.push_back(group_elems[size_t(segments)]);
  if (slots_.grads_per_group) {
    gslots = group_elems;
  } else {
    gslots.assign(size_t(slots_.shared_grads), shared);
    if (slots_.tied_grads) gslots.push_back(group_elems[size_t(segments)]);
  }
  weight_bytes_ = size_t(slice_total) * dtype_size(weight_dtype);
  grad_bytes_ = size_t(slice_total) * dtype_size(grad_dtype);
  for (int64_t e : wslots) weight_bytes_ += size_t(e) * dtype_size(weight_dtype);
  for (int64_t e : gslots) grad_bytes_ += size_t(e) * dtype_size(grad_dtype);
  weight_slot_.assign(size_t(groups), -1);
  weight_owner_.assign(wslots.size(), -1);
  weight_freed_.assign(wslots.size(), 0);
  pooled_group_.assign(size_t(groups), slices_.pool_grads);
  if (slices_.pool_grads) {
    grad_slot_.assign(size_t(groups), -1);
    grad_owner_.assign(gslots.size(), -1);
    grad_freed_.assign(gslots.size(), 0);
  } else {  // every group's gradients for the whole step
    for (int g = 0; g < groups; ++g) grad_slot_.push_back(g);
  }
  if (!slices_.allocate) return;
  slice_weights_ = Buffer(mem, size_t(slice_total) * dtype_size(weight_dtype));
  slice_grads_ = Buffer(mem, size_t(slice_total) * dtype_size(grad_dtype));
  for (int64_t e : wslots) weight_slots_.emplace_back(mem, size_t(e) * dtype_size(weight_dtype));
  for (int64_t e : gslots) grad_slots_.emplace_back(mem, size_t(e) * dtype_size(grad_dtype));
}

ParamStore::ParamStore(const ModelLayout& layout, DType weight_dtype, DType grad_dtype, MemKind mem,
                       PooledGrads pooled, std::vector<bool> stage)
    : ParamStore(layout, weight_dtype, grad_dtype, mem, /*allocate=*/false, std::move(stage)) {
  const int segments = num_segments(layout.dims);
  MOP_CHECK(int(pooled.segments.size()) == segments, "pooled gradients for ", pooled.segments.size(),
            " segments of ", segments);
  const bool tied = layout.lm_head == layout.embedding;
  const int groups = segments + (tied ? 1 : 0);
  group_params_.assign(size_t(groups), {});
  pooled_group_.assign(size_t(groups), 0);
  for (int s = 0; s < segments; ++s) pooled_group_[size_t(s)] = pooled.segments[size_t(s)];
  if (tied) pooled_group_[size_t(segments)] = pooled.segments[0];
  std::vector<int64_t> group_elems(size_t(groups), 0);
  int64_t resident = 0;
  for (int p = 0; p < num_params(); ++p) {
    const int g = tied && p == layout.embedding ? segments : param_segment(layout, p);
    const int64_t a = held(p) ? aligned_numel(layout.params[p].numel()) : 0;
    group_of_.push_back(g);
    group_params_[size_t(g)].push_back(p);
    if (pooled_group_[size_t(g)]) {
      slot_off_.push_back(group_elems[size_t(g)]), grad_off_.push_back(-1);
      group_elems[size_t(g)] += a;
    } else {
      slot_off_.push_back(-1), grad_off_.push_back(resident);
      resident += a;
    }
  }
  const int64_t shared = *std::max_element(group_elems.begin(), group_elems.begin() + segments);
  slots_ = step_slots(/*sliced=*/false, /*pool_grads=*/false, /*streams=*/true, tied);
  std::vector<int64_t> gslots(size_t(slots_.shared_grads), shared);
  if (slots_.tied_grads) gslots.push_back(group_elems[size_t(segments)]);
  grad_slot_.assign(size_t(groups), -1);
  grad_owner_.assign(gslots.size(), -1);
  grad_freed_.assign(gslots.size(), 0);
  weight_bytes_ = size_t(total_) * dtype_size(weight_dtype);
  grad_bytes_ = size_t(resident) * dtype_size(grad_dtype);
  for (int64_t e : gslots) grad_bytes_ += size_t(e) * dtype_size(grad_dtype);
  if (!pooled.allocate) return;
  weights_ = Buffer(mem, size_t(total_) * dtype_size(weight_dtype));
  grads_ = Buffer(mem, size_t(resident) * dtype_size(grad_dtype));
  for (int64_t e : gslots) grad_slots_.emplace_back(mem, size_t(e) * dtype_size(grad_dtype));
}

void ParamStore::check_held(int p) const {
  MOP_CHECK(p >= 0 && p < num_params(), "parameter index ", p);
  MOP_CHECK(held(p), layout_.params[p].name, " belongs to another pipeline stage");
}

Tensor ParamStore::resident_grad(int p) const {
  check_held(p);
  MOP_CHECK(p >= 0 && p < num_params() && grad_off_[size_t(p)] >= 0, "parameter ", p, "'s gradients are pooled");
  return shaped_view(static_cast<char*>(grads_.data()) + size_t(grad_off_[size_t(p)] - offsets_[p]) * dtype_size(grad_dtype_),
                     grad_dtype_, grads_.device(), p);
}

Tensor ParamStore::slice_weight(int p) const {
  check_held(p);
  return Tensor(static_cast<char*>(slice_weights_.data()) + size_t(slice_off_[size_t(p)]) * dtype_size(weight_dtype_),
                weight_dtype_, {slice_numel_[size_t(p)]}, slice_weights_.device());
}

Tensor ParamStore::slice_grad(int p) const {
  check_held(p);
  return Tensor(static_cast<char*>(slice_grads_.data()) + size_t(slice_off_[size_t(p)]) * dtype_size(grad_dtype_),
                grad_dtype_, {slice_numel_[size_t(p)]}, slice_grads_.device());
}

Tensor ParamStore::in_slot(const std::vector<Buffer>& slots, const std::vector<int>& bound, DType dtype,
                           int p, bool padded, const char* what) const {
  check_held(p);
  const int slot = bound[size_t(group_of_[size_t(p)])];
  MOP_CHECK(slot >= 0, "the ", what, " of ", layout_.params[p].name, " are not gathered");
  const bool weights = &slots == &weight_slots_;
  Tensor t;
  if (slot_off_[size_t(p)] < 0) {  // one replica: its slice, in place
    t = weights ? slice_weight(p) : slice_grad(p);
  } else {
    const Buffer& b = slots[size_t(slot)];
    t = Tensor(static_cast<char*>(b.data()) + size_t(slot_off_[size_t(p)]) * dtype_size(dtype), dtype, {},
               b.device());
  }
  if (padded) return Tensor(t.data, dtype, {slices_.n[size_t(p)] * slice_numel_[size_t(p)]}, t.device);
  const auto& shape = layout_.params[p].shape;
  t.ndim = int(shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape[i];
  return t;
}

Tensor ParamStore::gathered_weight(int p) const {
  return in_slot(weight_slots_, weight_slot_, weight_dtype_, p, true, "weights");
}

Tensor ParamStore::padded_grad(int p) const {
  return in_slot(grad_slots_, grad_slot_, grad_dtype_, p, true, "gradients");
}

int ParamStore::bind(std::vector<int>& bound, std::vector<int>& owner, std::vector<uint64_t>& freed, int shared,
                     int g) {
  MOP_CHECK(g >= 0 && g < num_gather_groups(), "gather group ", g);
  if (bound[size_t(g)] >= 0) return bound[size_t(g)];
  int slot = -1;
  if (g == num_segments(layout_.dims)) {
    slot = shared;  // the tied embedding's own, after the shared ones
  } else {
    for (int i = 0; i < shared; ++i)  // of the free shared slots the one freed longest ago
      if (owner[size_t(i)] < 0 && (slot < 0 || freed[size_t(i)] < freed[size_t(slot)])) slot = i;
  }
  MOP_CHECK(slot >= 0, "no free gather slot for group ", g, " (all ", shared, " shared slots are bound)");
  owner[size_t(slot)] = g;
  return bound[size_t(g)] = slot;
}

void ParamStore::release(std::vector<int>& bound, std::vector<int>& owner, std::vector<uint64_t>& freed, int g) {
  const int slot = bound[size_t(g)];
  if (slot < 0) return;
  owner[size_t(slot)] = -1, bound[size_t(g)] = -1;
  freed[size_t(slot)] = ++releases_;
}

void ParamStore::bind_weights(int g) { bind(weight_slot_, weight_owner_, weight_freed_, slots_.shared_weights, g); }

void ParamStore::release_weights(int g) { release(weight_slot_, weight_owner_, weight_freed_, g); }

void ParamStore::bind_grads(int g) {
  MOP_CHECK(group_pooled(g), "bind_grads: group ", g, "'s gradients are not pooled");
  bind(grad_slot_, grad_owner_, grad_freed_, slots_.shared_grads, g);
}

void ParamStore::release_grads(int g) {
  if (group_pooled(g)) release(grad_slot_, grad_owner_, grad_freed_, g);
}

size_t ParamStore::weight_bytes() const {
  return sliced() || streams_grads() ? weight_bytes_ : size_t(total_) * dtype_size(weight_dtype_);
}

size_t ParamStore::grad_bytes() const {
  return sliced() || streams_grads() ? grad_bytes_ : size_t(total_) * dtype_size(grad_dtype_);
}

Tensor ParamStore::weights_flat() const {
  return Tensor(weights_.data(), weight_dtype_, {total_}, weights_.device());
}

Tensor ParamStore::grads_flat() const {
  MOP_CHECK(!streams_grads(), "grads_flat: some gradients are pooled");
  return Tensor(grads_.data(), grad_dtype_, {total_}, grads_.device());
}

Tensor ParamStore::shaped(const Buffer& flat, DType dtype, int p) const {
  MOP_CHECK(flat.bytes() >= size_t(total_) * dtype_size(dtype), "flat buffer too small");
  return shaped_view(flat.data(), dtype, flat.device(), p);
}

Tensor ParamStore::shaped_view(void* flat_base, DType dtype, Device device, int p) const {
  check_held(p);
  const auto& def = layout_.params[p];
  Tensor t(static_cast<char*>(flat_base) + size_t(offsets_[p]) * dtype_size(dtype), dtype, {},
           device);
  t.ndim = int(def.shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = def.shape[i];
  return t;
}

void init_param(const ModelLayout& layout, int p, float* dst, uint64_t seed) {
  // Work items: (checkpoint tensor, chunk of its elements), so one large tensor (the embedding)
  // is spread over all threads too; Philox makes each element independent of the split.
  constexpr int64_t kChunk = int64_t(1) << 20;
  struct Item {
    const HfView* view;
    uint64_t stream;
    int64_t begin, end;
  };
  std::vector<HfView> views;
  for (const HfView& v : layout.hf_views())
    if (v.param == p) views.push_back(v);
  std::vector<Item> items;
  for (const HfView& v : views) {
    int64_t n = 1;
    for (int64_t s : v.shape) n *= s;
    for (int64_t b = 0; b < n; b += kChunk) items.push_back({&v, fnv1a64(v.name), b, std::min(n, b + kChunk)});
  }
  const double std_dev = layout.dims.init_std;
  const bool norm = layout.params[p].kind == ParamKind::Norm;
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    float* out = dst + it.view->offset;
    for (int64_t j = it.begin; j < it.end; ++j)
      out[j] = norm ? 1.0f : float(std_dev * philox_normal(seed, it.stream, uint64_t(j)));
  }
}

}  // namespace mop
