// A rank's communicators, each for the group along a set of mesh axes (mesh.h) and of a kind:
// host comms carry small host-side exchanges (counts, norms, flags), data comms tensors on the
// backend's device (MPI on CPU ranks, NCCL on GPUs), and on GPU ranks side comms run one purpose's
// collectives on a stream of their own (gradient sums, weight gathers, ring attention's passes, the
// expert exchange's two directions). Dense gradients are summed over kDenseReplicas, expert
// gradients over kExpertReplicas; sequences are shared over cp, experts over ep. Components ask for
// a comm by its axes and kind; which comms exist is said once, in build() (the plan counts the
// same ones). The comms come from a CommFactory.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "parallel/comm_factory.h"
#include "parallel/mesh.h"
#include "parallel/watchdog.h"
#include "parallel/world.h"
#include "runtime/comm.h"
#include "runtime/runtime.h"

namespace mop {

class Ops;

// The streams of the asynchronous comms (the step's schedule owns them, schedule/streams.h). A
// null stream: that comm is not made, and the group's blocking data comm serves instead.
struct CommStreams {
  Stream grad_sums;  // the data-parallel gradient sums (dense and expert replicas)
  Stream ring;       // ring attention's K/V passes
  Stream dispatch, combine;  // the expert exchange, one per direction
  Stream gathers;            // sliced parameters' weight gathers (dense and expert replicas)
};

enum class CommKind { Host, Data, GradSums, Gathers, Ring, Dispatch, Combine };

class ParallelGroups {
 public:
  // Splits the world by the config's axes (validated against the world size). One rank (or a
  // world without MPI) gets self comms. GPU ranks get the asynchronous comms whose streams are
  // given, each following the compute stream (ops.stream()).
  static std::unique_ptr<ParallelGroups> build(const Config& cfg, World& world, Ops& ops,
                                               const CommStreams& streams = {});
  // The groups of `mesh` for the factory's rank, every comm from `comms`, watched with
  // `collective_timeout` (seconds; ≤ 0: no watchdog thread). Also for a world of one.
  static std::unique_ptr<ParallelGroups> build(const Mesh& mesh, CommFactory& comms,
                                               double collective_timeout, Ops& ops,
                                               const CommStreams& streams = {});
  // A single-rank layout with self comms (tests, generation).
  static std::unique_ptr<ParallelGroups> single();
  ParallelGroups(const ParallelGroups&) = delete;
  ParallelGroups& operator=(const ParallelGroups&) = delete;

  int rank() const { return rank_; }
  int size() const { return mesh_.world_size(); }
  const Mesh& mesh() const { return mesh_; }
  int coord(Axis a) const { return coord_[a]; }
  int size(Axis a) const { return mesh_.dims().size(a); }

  // The comm of `kind` over this rank's group along `axes`: the one made for exactly these axes,
  // else — axes of size 1 do not change a group (kWorldAxes with one stage is kDenseReplicas'
  // group), and either folding whole is the stage — the first made for the axes so reduced. Host
  // and data comms exist for every group the step uses; side comms only on GPU ranks with their
  // stream (side() is null otherwise: the data comm serves, blocking).
  Comm& host(Axes axes) const { return get(CommKind::Host, axes); }
  Comm& data(Axes axes) const { return get(CommKind::Data, axes); }
  Comm* side(CommKind kind, Axes axes) const;
  Comm& world_host() const { return *world_host_; }
  // The compute stream waits for every comm of `kind` (a side kind's collectives issued so far).
  void join(CommKind kind) const;
  // Replaces every tensor comm (data and side) by wrap(comm, its label), e.g. to time them.
  void wrap_tensor_comms(
      const std::function<std::unique_ptr<Comm>(std::unique_ptr<Comm>, const std::string&)>& wrap);

  // Several ranks: every collective is watched (parallel.collective_timeout).
  std::unique_ptr<CollectiveWatchdog> watchdog;

 private:
  explicit ParallelGroups(const Mesh& mesh, int rank);
  Comm* find(CommKind kind, Axes axes) const;
  Comm& get(CommKind kind, Axes axes) const;
  Axes reduced(Axes axes) const;  // without the axes of size 1, a whole folding as dp × cp
  void add(CommKind kind, Axes axes, std::unique_ptr<Comm> comm, std::string label);
  void index();  // the lookups below, from comms_

  Mesh mesh_;
  int rank_ = 0;
  MeshCoord coord_;
  Comm* world_host_ = nullptr;  // a watched view of World's comm, or World's own (one rank)
  struct Entry {
    CommKind kind;
    Axes axes;
    std::string label;
    std::unique_ptr<Comm> comm;
  };
  std::vector<Entry> comms_;                                    // in the order they were made
  std::map<std::pair<CommKind, Axes>, Comm*> exact_, reduced_;  // (kind, axes) → the first made
};

}  // namespace mop
