// Mesh coordinates and groups (see mesh.h): every formula between ranks and coordinates.
#include "parallel/mesh.h"

#include "config/config.h"
#include "core/error.h"

namespace mop {

const char* axis_name(Axis a) {
  switch (a) {
    case Axis::Pp:
      return "pp";
    case Axis::Dp:
      return "dp";
    case Axis::Cp:
      return "cp";
    case Axis::Edp:
      return "edp";
    case Axis::Ep:
      return "ep";
  }
  return "?";
}

std::string Axes::str() const {
  std::string s;
  for (int i = 0; i < kNumAxes; ++i)
    if (has(Axis(i))) s += (s.empty() ? "" : "×") + std::string(axis_name(Axis(i)));
  return s.empty() ? "{}" : s;
}

std::string MeshGroup::name() const {
  return axes == kWorldAxes ? "world" : axes.str();
}

MeshGroup world_group(int world_size, int rank) {
  MOP_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " of a world of ", world_size);
  MeshGroup g;
  g.axes = kWorldAxes;
  for (int r = 0; r < world_size; ++r) g.ranks.push_back(r);
  g.index = rank;
  return g;
}

int MeshDims::size(Axis a) const {
  switch (a) {
    case Axis::Pp:
      return pp;
    case Axis::Dp:
      return dp;
    case Axis::Cp:
      return cp;
    case Axis::Edp:
      return edp;
    case Axis::Ep:
      return ep;
  }
  return 1;
}

int MeshDims::size(Axes axes) const {
  int n = 1;
  for (int i = 0; i < kNumAxes; ++i)
    if (axes.has(Axis(i))) n *= size(Axis(i));
  return n;
}

Mesh::Mesh(int world_size, const MeshDims& d) : world_size_(world_size), dims_(d) {
  MOP_CHECK(world_size >= 1 && d.pp >= 1 && d.dp >= 1 && d.cp >= 1 && d.edp >= 1 && d.ep >= 1,
            "mesh dimensions must be positive: ", str());
  MOP_CHECK(d.dp * d.cp == d.edp * d.ep && d.pp * d.dp * d.cp == world_size,
            "mesh foldings must cover the world exactly: ", str());
}

Mesh Mesh::of(const Config& cfg, int world_size) {
  validate_parallel(cfg, world_size);
  MeshDims d;
  d.pp = int(cfg.parallel.pp), d.dp = int(cfg.parallel.attention.dp), d.cp = int(cfg.parallel.attention.cp);
  d.edp = int(cfg.parallel.moe.dp), d.ep = int(cfg.parallel.moe.ep);
  return Mesh(world_size, d);
}

void Mesh::check_rank(int rank) const {
  MOP_CHECK(rank >= 0 && rank < world_size_, "rank ", rank, " outside ", str());
}

MeshCoord Mesh::coord(int rank) const {
  check_rank(rank);
  const int within = rank % dims_.stage();
  MeshCoord c;
  c[Axis::Pp] = rank / dims_.stage();
  c[Axis::Dp] = within / dims_.cp, c[Axis::Cp] = within % dims_.cp;
  c[Axis::Edp] = within / dims_.ep, c[Axis::Ep] = within % dims_.ep;
  return c;
}

std::array<Axis, 3> Mesh::folding(Axes axes) const {
  const bool attention = !(axes & kAttentionAxes).empty(), moe = !(axes & kMoeAxes).empty();
  MOP_CHECK(!(attention && moe), "a group along ", axes.str(), " mixes the attention and MoE axes");
  return moe ? std::array<Axis, 3>{Axis::Pp, Axis::Edp, Axis::Ep}
             : std::array<Axis, 3>{Axis::Pp, Axis::Dp, Axis::Cp};
}

int Mesh::rank_of(const MeshCoord& c, Axis folding_axis) const {
  const std::array<Axis, 3> f = folding(Axes{folding_axis});
  int rank = 0;
  for (Axis a : f) {
    MOP_CHECK(c[a] >= 0 && c[a] < dims_.size(a), axis_name(a), " coordinate ", c[a], " outside ",
              str());
    rank = rank * dims_.size(a) + c[a];
  }
  return rank;
}

MeshGroup Mesh::group(Axes axes, int rank) const {
  const std::array<Axis, 3> f = folding(axes);
  const MeshCoord me = coord(rank);
  MeshGroup g;
  g.axes = axes;
  // The members' coordinates along `axes`, outermost first: ascending world rank.
  const int n = dims_.size(axes);
  for (int i = 0; i < n; ++i) {
    // Member i's coordinates: i in the mixed radix of the axes' sizes, the others rank's.
    int member = 0, rest = i, stride = 1;
    for (int k = 2; k >= 0; --k) {
      const Axis a = f[size_t(k)];
      const int size = dims_.size(a), at = axes.has(a) ? rest % size : me[a];
      if (axes.has(a)) rest /= size;
      member += at * stride, stride *= size;
    }
    g.ranks.push_back(member);
  }
  g.index = index_in(axes, rank);
  return g;
}

int Mesh::index_in(Axes axes, int rank) const {
  folding(axes);
  check_rank(rank);
  return mesh_index(dims_, axes, rank);
}

int Mesh::on_node(Axes axes, int rank, int per_node) const {
  MOP_CHECK(per_node >= 1, "ranks per node: ", per_node);
  int n = 0;
  for (int r : group(axes, rank).ranks) n += r / per_node == rank / per_node;
  return n;
}

std::string Mesh::str() const {
  return "world " + std::to_string(world_size_) + ": " +
         (dims_.pp != 1 ? "pp " + std::to_string(dims_.pp) + " × " : std::string()) +
         "attention dp " + std::to_string(dims_.dp) + " × cp " + std::to_string(dims_.cp) +
         ", MoE edp " + std::to_string(dims_.edp) + " × ep " + std::to_string(dims_.ep);
}

}  // namespace mop
