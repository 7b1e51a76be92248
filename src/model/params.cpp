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

ParamStore::ParamStore(const ModelLayout& layout, DType weight_dtype, DType grad_dtype, MemKind mem,
                       bool allocate)
    : layout_(layout), weight_dtype_(weight_dtype), grad_dtype_(grad_dtype) {
  for (const auto& def : layout.params) {
    offsets_.push_back(total_);
    total_ += aligned_numel(def.numel());
  }
  if (!allocate) return;
  weights_ = Buffer(mem, size_t(total_) * dtype_size(weight_dtype));
  grads_ = Buffer(mem, size_t(total_) * dtype_size(grad_dtype));
}

ParamStore::ParamStore(const ModelLayout& layout, DType weight_dtype, DType grad_dtype, MemKind mem,
                       ParamSlices slices)
    : ParamStore(layout, weight_dtype, grad_dtype, mem, /*allocate=*/false) {
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
    const int64_t k = (layout.params[p].numel() + parts - 1) / parts;
    slice_numel_.push_back(k);
    slice_off_.push_back(slice_total);
    slice_total += aligned_numel(k);
    const int g = tied && p == layout.embedding ? segments : param_segment(layout, p);
    group_of_.push_back(g);
    group_params_[size_t(g)].push_back(p);
    // One replica: the slice is the whole parameter, used in place (no slot, nothing gathered).
    slot_off_.push_back(parts == 1 ? -1 : group_elems[size_t(g)]);
    if (parts > 1) group_elems[size_t(g)] += aligned_numel(parts * k);
  }
  const int64_t shared = *std::max_element(group_elems.begin(), group_elems.begin() + segments);
  const int groups = num_gather_groups();
  // Slot sizes: two shared by the segments and the tied embedding's own, for the weights; the
  // same for pooled gradients, else one per group.
  std::vector<int64_t> wslots = {shared, shared}, gslots;
  if (tied) wslots.push_back(group_elems[size_t(segments)]);
  if (slices_.pool_grads) gslots = wslots;
  else gslots = group_elems;
  weight_bytes_ = size_t(slice_total) * dtype_size(weight_dtype);
  grad_bytes_ = size_t(slice_total) * dtype_size(grad_dtype);
  for (int64_t e : wslots) weight_bytes_ += size_t(e) * dtype_size(weight_dtype);
  for (int64_t e : gslots) grad_bytes_ += size_t(e) * dtype_size(grad_dtype);
  weight_slot_.assign(size_t(groups), -1);
  weight_owner_.assign(wslots.size(), -1);
  if (slices_.pool_grads) {
    grad_slot_.assign(size_t(groups), -1);
    grad_owner_.assign(gslots.size(), -1);
  } else {  // every group's gradients for the whole step
    for (int g = 0; g < groups; ++g) grad_slot_.push_back(g);
  }
  if (!slices_.allocate) return;
  slice_weights_ = Buffer(mem, size_t(slice_total) * dtype_size(weight_dtype));
  slice_grads_ = Buffer(mem, size_t(slice_total) * dtype_size(grad_dtype));
  for (int64_t e : wslots) weight_slots_.emplace_back(mem, size_t(e) * dtype_size(weight_dtype));
  for (int64_t e : gslots) grad_slots_.emplace_back(mem, size_t(e) * dtype_size(grad_dtype));
}

Tensor ParamStore::slice_weight(int p) const {
  return Tensor(static_cast<char*>(slice_weights_.data()) + size_t(slice_off_[size_t(p)]) * dtype_size(weight_dtype_),
                weight_dtype_, {slice_numel_[size_t(p)]}, slice_weights_.device());
}

Tensor ParamStore::slice_grad(int p) const {
  return Tensor(static_cast<char*>(slice_grads_.data()) + size_t(slice_off_[size_t(p)]) * dtype_size(grad_dtype_),
                grad_dtype_, {slice_numel_[size_t(p)]}, slice_grads_.device());
}

Tensor ParamStore::in_slot(const std::vector<Buffer>& slots, const std::vector<int>& bound, DType dtype,
                           int p, bool padded, const char* what) const {
  MOP_CHECK(p >= 0 && p < num_params(), "parameter index ", p);
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

int ParamStore::bind(std::vector<int>& bound, std::vector<int>& owner, int g) {
  MOP_CHECK(g >= 0 && g < num_gather_groups(), "gather group ", g);
  if (bound[size_t(g)] >= 0) return bound[size_t(g)];
  const bool own = g == num_segments(layout_.dims);  // the tied embedding's slot
  int slot = own ? 2 : (owner[0] < 0 ? 0 : owner[1] < 0 ? 1 : -1);
  MOP_CHECK(slot >= 0, "no free gather slot for group ", g, " (slots hold ", owner[0], " and ", owner[1], ")");
  owner[size_t(slot)] = g;
  return bound[size_t(g)] = slot;
}

void ParamStore::bind_weights(int g) { bind(weight_slot_, weight_owner_, g); }

void ParamStore::release_weights(int g) {
  const int slot = weight_slot_[size_t(g)];
  if (slot >= 0) weight_owner_[size_t(slot)] = -1, weight_slot_[size_t(g)] = -1;
}

void ParamStore::bind_grads(int g) {
  MOP_CHECK(slices_.pool_grads, "bind_grads: the gradients are not pooled");
  bind(grad_slot_, grad_owner_, g);
}

void ParamStore::release_grads(int g) {
  if (!slices_.pool_grads) return;
  const int slot = grad_slot_[size_t(g)];
  if (slot >= 0) grad_owner_[size_t(slot)] = -1, grad_slot_[size_t(g)] = -1;
}

size_t ParamStore::weight_bytes() const {
  return sliced() ? weight_bytes_ : size_t(total_) * dtype_size(weight_dtype_);
}

size_t ParamStore::grad_bytes() const {
  return sliced() ? grad_bytes_ : size_t(total_) * dtype_size(grad_dtype_);
}

Tensor ParamStore::weights_flat() const {
  return Tensor(weights_.data(), weight_dtype_, {total_}, weights_.device());
}

Tensor ParamStore::grads_flat() const {
  return Tensor(grads_.data(), grad_dtype_, {total_}, grads_.device());
}

Tensor ParamStore::shaped(const Buffer& flat, DType dtype, int p) const {
  MOP_CHECK(flat.bytes() >= size_t(total_) * dtype_size(dtype), "flat buffer too small");
  return shaped_view(flat.data(), dtype, flat.device(), p);
}

Tensor ParamStore::shaped_view(void* flat_base, DType dtype, Device device, int p) const {
  MOP_CHECK(p >= 0 && p < num_params(), "parameter index ", p);
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
