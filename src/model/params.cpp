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
