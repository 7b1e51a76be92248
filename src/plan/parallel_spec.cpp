// The parallel spec (see parallel_spec.h).
#include "plan/parallel_spec.h"

#include <algorithm>
#include <map>
#include <numeric>

namespace mop {

bool ParallelSpec::zero1() const {
  return std::any_of(params.begin(), params.end(), [](const ParamSharding& s) { return s.kind == Sharding::Owner; });
}

bool ParallelSpec::sliced() const {
  return std::any_of(params.begin(), params.end(), [](const ParamSharding& s) { return s.kind == Sharding::Slice; });
}

Axes replica_axes(const ParamDef& def) {
  return def.kind == ParamKind::Experts ? kExpertReplicas : kDenseReplicas;
}

ParallelSpec make_parallel_spec(const ModelLayout& layout, const MeshDims& dims, bool zero,
                                bool slice) {
  ParallelSpec spec;
  spec.dims = dims;
  const int n = int(layout.params.size());
  spec.params.resize(size_t(n));
  for (int p = 0; p < n; ++p) spec.params[size_t(p)].replicas = replica_axes(layout.params[p]);
  if (slice) {  // also where one replica holds the whole slice: the same step, gathers are copies
    for (int p = 0; p < n; ++p) spec.params[size_t(p)].kind = Sharding::Slice;
    return spec;
  }
  if (!zero || spec.world() == 1) return spec;
  // ZeRO-1 owners: largest parameter first onto the least-loaded replica of its group.
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return layout.params[a].numel() > layout.params[b].numel(); });
  std::map<Axes, std::vector<int64_t>> loads;  // per replica group: each replica's elements
  for (int p : order) {
    ParamSharding& s = spec.params[size_t(p)];
    std::vector<int64_t>& load = loads[s.replicas];
    load.resize(size_t(dims.size(s.replicas)), 0);
    const int best = int(std::min_element(load.begin(), load.end()) - load.begin());
    load[size_t(best)] += layout.params[p].numel();
    s.kind = Sharding::Owner, s.owner = best;
  }
  return spec;
}

ParamSlices param_slices(const ParallelSpec& spec, int rank, int micro_batches, bool allocate) {
  ParamSlices slices;
  for (int p = 0; p < int(spec.params.size()); ++p)
    slices.n.push_back(spec.group_size(p)), slices.index.push_back(spec.replica_index(rank, p));
  slices.pool_grads = micro_batches == 1;
  slices.allocate = allocate;
  return slices;
}

}  // namespace mop
