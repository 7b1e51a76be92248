// Mesh: the job's ranks laid out along named axes, and the group of ranks along any set of them.
// Axes: pp (pipeline stages), dp × cp (attention: data- × context-parallel) and edp × ep (experts:
// expert-data- × expert-parallel); the two foldings cover the same ranks of a stage. A rank is
//   rank = pp · S + within,  S = dp·cp = edp·ep ranks per stage (a stage's ranks are consecutive)
//   within = dp · cp_size + cp   (cp ranks hold shards of the same sequences)
//          = edp · ep_size + ep  (ep ranks hold shards of the experts)
// so the innermost axes (cp, ep) are neighbouring ranks, inside a node where they fit. A group is a
// set of axes of one folding (pp may join either): the ranks that share this rank's coordinates on
// every other axis of that folding, ordered by world rank. Every rank ↔ coordinate formula lives
// here. Pure arithmetic, no MPI: a mesh of any size is built and checked inside one process.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace mop {

struct Config;

enum class Axis : uint8_t { Pp, Dp, Cp, Edp, Ep };
constexpr int kNumAxes = 5;
const char* axis_name(Axis a);

// A set of axes (a bit per axis).
class Axes {
 public:
  constexpr Axes() = default;
  constexpr Axes(std::initializer_list<Axis> axes) {
    for (Axis a : axes) bits_ |= bit(a);
  }
  constexpr bool has(Axis a) const { return (bits_ & bit(a)) != 0; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr Axes operator|(Axes o) const { return from_bits(bits_ | o.bits_); }
  constexpr Axes operator&(Axes o) const { return from_bits(bits_ & o.bits_); }
  constexpr Axes without(Axis a) const { return from_bits(bits_ & ~bit(a)); }
  constexpr bool operator==(const Axes&) const = default;
  constexpr bool operator<(Axes o) const { return bits_ < o.bits_; }
  std::string str() const;  // "dp×cp", "{}" when empty

 private:
  static constexpr uint8_t bit(Axis a) { return uint8_t(1u << unsigned(a)); }
  static constexpr Axes from_bits(unsigned b) {
    Axes x;
    x.bits_ = uint8_t(b);
    return x;
  }
  uint8_t bits_ = 0;
};

// The axes' groups the step talks over.
constexpr Axes kAttentionAxes{Axis::Dp, Axis::Cp};        // a stage's ranks, attention folding
constexpr Axes kMoeAxes{Axis::Edp, Axis::Ep};             // a stage's ranks, MoE folding
constexpr Axes kWorldAxes{Axis::Pp, Axis::Dp, Axis::Cp};  // every rank
constexpr Axes kDenseReplicas = kAttentionAxes;           // the ranks holding a dense parameter
constexpr Axes kExpertReplicas{Axis::Edp};                // the ranks holding the same experts

struct MeshDims {
  int pp = 1;
  int dp = 1, cp = 1;   // attention folding: data-parallel × context-parallel
  int edp = 1, ep = 1;  // MoE folding: expert-data-parallel × expert-parallel
  int size(Axis a) const;
  int size(Axes axes) const;  // the product over the set
  int stage() const { return dp * cp; }
  int world() const { return pp * stage(); }
};

// `rank`'s position in its group along `axes` (axes of one folding, pp with either), unchecked:
// the mixed-radix number of its coordinates on those axes, outermost first (Mesh::index_in checks
// its arguments first; this is for hot loops such as the plan's per-rank ownership).
inline int mesh_index(const MeshDims& d, Axes axes, int rank) {
  const int stage = d.dp * d.cp, within = rank % stage;
  const bool moe = axes.has(Axis::Edp) || axes.has(Axis::Ep);
  const int inner_size = moe ? d.ep : d.cp, outer_size = moe ? d.edp : d.dp;
  int index = axes.has(Axis::Pp) ? rank / stage : 0;
  if (axes.has(moe ? Axis::Edp : Axis::Dp)) index = index * outer_size + within / inner_size;
  if (axes.has(moe ? Axis::Ep : Axis::Cp)) index = index * inner_size + within % inner_size;
  return index;
}

// A rank's coordinate on every axis.
struct MeshCoord {
  std::array<int, kNumAxes> v{};
  int operator[](Axis a) const { return v[size_t(a)]; }
  int& operator[](Axis a) { return v[size_t(a)]; }
};

// One group as one of its members sees it: the comms made for it rank their members by `ranks`.
struct MeshGroup {
  Axes axes;
  std::vector<int> ranks;  // world ranks, in group-rank order (ascending)
  int index = 0;           // this member's position in `ranks`: its rank in the group's comms
  int size() const { return int(ranks.size()); }
  int world_rank() const { return ranks[size_t(index)]; }
  std::string name() const;  // "world" for kWorldAxes, else its axes ("cp", "dp×cp")
};

// Every rank of a world of `world_size` (kWorldAxes), as rank `rank` sees it.
MeshGroup world_group(int world_size, int rank);

class Mesh {
 public:
  // Checks that each folding covers a stage exactly (dp·cp = edp·ep) and the stages the world.
  Mesh(int world_size, const MeshDims& dims);
  // The config's axes over `world_size` ranks, checked first as the config's own errors
  // (validate_parallel: products, expert and batch divisibility, with the keys to fix).
  static Mesh of(const Config& cfg, int world_size);

  int world_size() const { return world_size_; }
  const MeshDims& dims() const { return dims_; }
  int size(Axes axes) const { return dims_.size(axes); }

  MeshCoord coord(int rank) const;
  // The rank at `c` in the folding of `folding_axis` (Dp or Cp: attention; Edp or Ep: MoE); the
  // other folding's coordinates in `c` are ignored.
  int rank_of(const MeshCoord& c, Axis folding_axis) const;
  // The group along `axes` that holds world rank `rank` (axes of one folding, pp with either).
  MeshGroup group(Axes axes, int rank) const;
  // `rank`'s position in its group along `axes` (group(axes, rank).index, without the list).
  int index_in(Axes axes, int rank) const;
  // How many members of `rank`'s group along `axes` are on rank's node, the world laid out node by
  // node in blocks of `per_node` ranks.
  int on_node(Axes axes, int rank, int per_node) const;
  std::string str() const;  // "world 8: attention dp 4 × cp 2, MoE edp 2 × ep 4"

 private:
  void check_rank(int rank) const;
  // The folding's axes of a group, outermost first: pp, then dp, cp or edp, ep.
  std::array<Axis, 3> folding(Axes axes) const;
  int world_size_ = 1;
  MeshDims dims_;
};

}  // namespace mop
