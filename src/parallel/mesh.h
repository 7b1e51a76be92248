// Mesh: the job's ranks laid out along named parallel dimensions, and the groups of ranks that
// communicate along each. The same world ranks are folded twice:
//   attention: rank = dp · cp_size + cp   (cp ranks hold shards of the same sequences)
//   MoE:       rank = edp · ep_size + ep  (ep ranks hold shards of the experts)
// Pure arithmetic, no MPI: a mesh of any size is built and checked inside one process.
#pragma once

#include <string>
#include <vector>

namespace mop {

struct Config;

struct MeshDims {
  int dp = 1, cp = 1;   // attention folding: data-parallel × context-parallel
  int edp = 1, ep = 1;  // MoE folding: expert-data-parallel × expert-parallel
  int pp = 1;           // pipeline stages: reserved, must be 1
};

// The groups a rank belongs to. World: every rank. Cp: the ranks of one dp slice (sharing
// sequences). Dp: the ranks of one cp slice. Ep: the ranks of one edp slice (sharing tokens among
// their experts). Edp: the ranks holding the same experts (their gradients are summed there).
enum class GroupKind { World, Cp, Dp, Ep, Edp };
const char* group_kind_name(GroupKind kind);

// One group as one of its members sees it: the comms made for it rank their members by `ranks`.
struct MeshGroup {
  GroupKind kind = GroupKind::World;
  std::vector<int> ranks;  // world ranks, in group-rank order
  int index = 0;           // this member's position in `ranks`: its rank in the group's comms
  int size() const { return int(ranks.size()); }
  int world_rank() const { return ranks[size_t(index)]; }
};

// Every rank of a world of `world_size`, as rank `rank` sees it.
MeshGroup world_group(int world_size, int rank);

struct AttentionCoord {
  int dp = 0, cp = 0;
};
struct MoeCoord {
  int edp = 0, ep = 0;
};

class Mesh {
 public:
  // Checks that each folding covers the world exactly (dp·cp = edp·ep = world_size) and pp = 1.
  Mesh(int world_size, const MeshDims& dims);
  // The config's foldings over `world_size` ranks, checked first as the config's own errors
  // (validate_parallel: products, expert and batch divisibility, with the keys to fix).
  static Mesh of(const Config& cfg, int world_size);

  int world_size() const { return world_size_; }
  const MeshDims& dims() const { return dims_; }

  AttentionCoord attention(int rank) const;
  int attention_rank(AttentionCoord c) const;
  MoeCoord moe(int rank) const;
  int moe_rank(MoeCoord c) const;

  // The group of `kind` that holds world rank `rank`.
  MeshGroup group(GroupKind kind, int rank) const;
  std::string str() const;  // "world 8: attention dp 4 × cp 2, MoE edp 2 × ep 4"

 private:
  void check_rank(int rank) const;
  int world_size_ = 1;
  MeshDims dims_;
};

}  // namespace mop
