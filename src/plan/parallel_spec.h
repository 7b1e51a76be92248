// The parallel spec: the mesh's dimensions (parallel/mesh.h: pp, attention dp × cp, experts
// edp × ep) and, for every parameter of a rank's layout, the axes of the ranks that hold copies of
// it and how they share it: replicated (each keeps the whole optimizer state and updates it), owner
// (ZeRO-1: one replica keeps the state, updates, and broadcasts the new weights) or slice (ZeRO-3:
// each replica keeps one slice of the parameter — weights, gradients and state — and the whole
// weights exist only while a segment is gathered). The plan makes it; the schedule, the optimizer
// and the time model read it.
#pragma once

#include <string>
#include <vector>

#include "model/model_spec.h"
#include "model/params.h"
#include "parallel/mesh.h"

namespace mop {

enum class Sharding {
  Replicated,  // every replica keeps the state and updates it
  Owner,       // ZeRO-1: the owner keeps the state and broadcasts the weights
  Slice,       // ZeRO-3: replica i of n keeps elements [i·k, (i+1)·k) of the flat parameter,
               // k = slice_numel (model/params.h; the last slices padded with zeros)
};

struct ParamSharding {
  Axes replicas = kDenseReplicas;  // the ranks that hold copies of it (experts: kExpertReplicas)
  Sharding kind = Sharding::Replicated;
  int owner = 0;  // Owner: the owner's index in its replicas' group
};

struct ParallelSpec {
  MeshDims dims;
  std::vector<ParamSharding> params;  // per parameter of the layout (ModelLayout order)

  int world() const { return dims.world(); }
  Mesh mesh() const { return Mesh(world(), dims); }
  bool zero1() const;   // some parameter has an owner
  bool sliced() const;  // some parameter is sliced
  Axes replicas(int p) const { return params[size_t(p)].replicas; }
  bool expert(int p) const { return replicas(p) == kExpertReplicas; }
  // The number of replicas of parameter p (dp × cp for dense parameters, edp for experts).
  int group_size(int p) const { return dims.size(replicas(p)); }
  // Slice: elements of each replica's slice of parameter p of `numel` elements.
  int64_t slice_numel(int p, int64_t numel) const { return mop::slice_numel(numel, group_size(p)); }
  // `rank`'s index in parameter p's replica group.
  int replica_index(int rank, int p) const { return mesh_index(dims, replicas(p), rank); }
  // The axes along which the ranks' pieces of parameter p's gradient differ, over which its sum of
  // squares is summed for the global norm: the stages (each holds its own segments), the expert
  // ranks (each its own experts) and, sliced over several replicas, those (each a slice). Along the
  // others every rank holds the same values, counted once.
  Axes norm_axes(int p) const {
    Axes a{Axis::Pp};
    if (expert(p)) a = a | Axes{Axis::Ep};
    if (params[size_t(p)].kind == Sharding::Slice && group_size(p) > 1) a = a | replicas(p);
    return a;
  }
  // Whether `rank` keeps parameter p's optimizer state and updates it.
  bool owns(int rank, int p) const {
    const ParamSharding& s = params[size_t(p)];
    return s.kind != Sharding::Owner || s.owner == replica_index(rank, p);
  }
};

// The ranks that hold copies of a parameter: kExpertReplicas for experts, else kDenseReplicas.
Axes replica_axes(const ParamDef& def);

// The spec of `layout` (a rank's: its experts) on a mesh of `dims`; slice: every parameter sliced
// over its replicas (one replica: a single slice, the whole parameter); else zero: ZeRO-1 owners
// over each parameter's replicas (largest parameter first onto the least-loaded replica, the same
// on every rank), else every parameter replicated. Without slice, one rank is always replicated.
ParallelSpec make_parallel_spec(const ModelLayout& layout, const MeshDims& dims, bool zero,
                                bool slice = false);

// The parameter store's slices of `rank` under a sliced spec (model/params.h): per parameter its
// replica count and this rank's replica index; whole gradients pooled with one micro-batch.
ParamSlices param_slices(const ParallelSpec& spec, int rank, int micro_batches, bool allocate = true);

}  // namespace mop
