// A rank's comms by axes and kind (see groups.h).
#include "parallel/groups.h"

#include "ops/ops.h"

namespace mop {

namespace {
const char* kind_label(CommKind kind) {
  switch (kind) {
    case CommKind::Host:
      return "host";
    case CommKind::Data:
      return "";
    case CommKind::GradSums:
      return "gradient sums";
    case CommKind::Gathers:
      return "weight gathers";
    case CommKind::Ring:
      return "ring attention";
    case CommKind::Dispatch:
      return "expert dispatch";
    case CommKind::Combine:
      return "expert combine";
  }
  return "?";
}
}  // namespace

ParallelGroups::ParallelGroups(const Mesh& mesh, int rank)
    : mesh_(mesh), rank_(rank), coord_(mesh.coord(rank)) {}

std::unique_ptr<ParallelGroups> ParallelGroups::single() {
  std::unique_ptr<ParallelGroups> g(new ParallelGroups(Mesh(1, MeshDims{}), 0));
  g->add(CommKind::Host, kWorldAxes, make_self_comm(), "world");
  g->add(CommKind::Data, kWorldAxes, make_self_comm(), "world");
  g->world_host_ = &g->host(kWorldAxes);
  return g;
}

std::unique_ptr<ParallelGroups> ParallelGroups::build(const Config& cfg, World& world, Ops& ops,
                                                      const CommStreams& streams) {
  const Mesh mesh = Mesh::of(cfg, world.size);
  if (world.size == 1) {
    auto g = single();
    g->world_host_ = world.comm.get();
    return g;
  }
  MOP_CHECK(world.mpi || world.inprocess || world.standin, "several ranks without MPI");
  std::unique_ptr<CommFactory> comms = make_comm_factory(world);
  MOP_CHECK(comms->rank() == world.rank, "world rank ", world.rank, ", MPI rank ", comms->rank());
  return build(mesh, *comms, cfg.parallel.collective_timeout, ops, streams);
}

// The comms a rank makes, in order — the order is part of the protocol: every rank makes them
// alike. plan.cpp's device_comms counts the device ones.
std::unique_ptr<ParallelGroups> ParallelGroups::build(const Mesh& mesh, CommFactory& comms,
                                                      double collective_timeout, Ops& ops,
                                                      const CommStreams& streams) {
  std::unique_ptr<ParallelGroups> g(new ParallelGroups(mesh, comms.rank()));
  g->watchdog = std::make_unique<CollectiveWatchdog>(collective_timeout);
  if (collective_timeout > 0) comms.share_watchdog(*g->watchdog);
  auto watched = [&](std::unique_ptr<Comm> c) { return watch(std::move(c), *g->watchdog); };
  auto group = [&](Axes axes) { return mesh.group(axes, g->rank_); };
  struct Named {
    Axes axes;
    const char* label;
  };
  const Named world{kWorldAxes, "world"}, cp{Axes{Axis::Cp}, "cp"}, ep{Axes{Axis::Ep}, "ep"},
      edp{kExpertReplicas, "edp"};
  // Pipeline stages: a stage's ranks (the dense replicas), the pipeline (its messages, the norms'
  // sums over the stages) and the pipeline × expert ranks (the experts' norms), after the others.
  const Named stage{kDenseReplicas, "stage"}, pipe{Axes{Axis::Pp}, "pp"}, pipe_ep{Axes{Axis::Pp, Axis::Ep}, "pp×ep"};
  std::vector<Named> named = {world, cp, ep, edp};
  if (mesh.dims().pp > 1) named.insert(named.end(), {stage, pipe, pipe_ep});
  for (const Named& n : named)
    g->add(CommKind::Host, n.axes, watched(comms.host(group(n.axes))), n.label);
  g->world_host_ = &g->host(kWorldAxes);
  for (const Named& n : named)
    if (n.axes != pipe_ep.axes)
      g->add(CommKind::Data, n.axes, watched(comms.data(group(n.axes), ops.device(), ops.stream())),
             n.label);
  if (ops.device() == Device::CPU) return g;
  // An asynchronous comm on its own stream that follows the compute stream.
  auto side = [&](CommKind kind, const Named& n, Stream stream) {
    g->add(kind, n.axes, watched(comms.side(group(n.axes), stream, ops.stream())),
           std::string(kind_label(kind)) + " (" + n.label + ")");
  };
  if (!streams.grad_sums.is_null())
    side(CommKind::GradSums, world, streams.grad_sums),
        side(CommKind::GradSums, edp, streams.grad_sums);
  if (!streams.gathers.is_null())
    side(CommKind::Gathers, world, streams.gathers), side(CommKind::Gathers, edp, streams.gathers);
  if (mesh.dims().cp > 1 && !streams.ring.is_null()) side(CommKind::Ring, cp, streams.ring);
  if (mesh.dims().ep > 1 && !streams.dispatch.is_null() && !streams.combine.is_null()) {
    side(CommKind::Dispatch, ep, streams.dispatch);
    side(CommKind::Combine, ep, streams.combine);
  }
  return g;
}

Axes ParallelGroups::reduced(Axes axes) const {
  // A whole folding is a stage's ranks whichever it is.
  if ((axes & kMoeAxes) == kMoeAxes) axes = (axes & Axes{Axis::Pp}) | kAttentionAxes;
  for (int i = 0; i < kNumAxes; ++i)
    if (mesh_.dims().size(Axis(i)) == 1) axes = axes.without(Axis(i));
  return axes;
}

void ParallelGroups::add(CommKind kind, Axes axes, std::unique_ptr<Comm> comm, std::string label) {
  comms_.push_back({kind, axes, std::move(label), std::move(comm)});
  index();
}

void ParallelGroups::index() {
  exact_.clear(), reduced_.clear();
  for (const Entry& e : comms_) {  // the first made stays
    exact_.emplace(std::pair{e.kind, e.axes}, e.comm.get());
    reduced_.emplace(std::pair{e.kind, reduced(e.axes)}, e.comm.get());
  }
}

Comm* ParallelGroups::find(CommKind kind, Axes axes) const {
  if (auto it = exact_.find({kind, axes}); it != exact_.end()) return it->second;
  auto it = reduced_.find({kind, reduced(axes)});
  return it == reduced_.end() ? nullptr : it->second;
}

Comm* ParallelGroups::side(CommKind kind, Axes axes) const {
  MOP_CHECK(kind != CommKind::Host && kind != CommKind::Data, "side(): a side comm's kind");
  return find(kind, axes);
}

Comm& ParallelGroups::get(CommKind kind, Axes axes) const {
  Comm* c = find(kind, axes);
  MOP_CHECK(c, "rank ", rank_, " has no ", kind == CommKind::Host ? "host" : "data", " comm along ",
            axes.str(), " (", mesh_.str(), ")");
  return *c;
}

void ParallelGroups::join(CommKind kind) const {
  for (const Entry& e : comms_)
    if (e.kind == kind) e.comm->join();
}

void ParallelGroups::wrap_tensor_comms(
    const std::function<std::unique_ptr<Comm>(std::unique_ptr<Comm>, const std::string&)>& wrap) {
  for (Entry& e : comms_)
    if (e.kind != CommKind::Host) e.comm = wrap(std::move(e.comm), e.label);
  index();
}

}  // namespace mop
