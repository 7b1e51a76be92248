// Mesh coordinates and groups: each group is one line of the grid, its members ordered by their
// coordinate along it (see mesh.h).
#include "parallel/mesh.h"

#include "config/config.h"
#include "core/error.h"

namespace mop {

const char* group_kind_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::World:
      return "world";
    case GroupKind::Cp:
      return "cp";
    case GroupKind::Dp:
      return "dp";
    case GroupKind::Ep:
      return "ep";
    case GroupKind::Edp:
      return "edp";
  }
  return "?";
}

MeshGroup world_group(int world_size, int rank) {
  MOP_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " of a world of ", world_size);
  MeshGroup g;
  for (int r = 0; r < world_size; ++r) g.ranks.push_back(r);
  g.index = rank;
  return g;
}

Mesh::Mesh(int world_size, const MeshDims& d) : world_size_(world_size), dims_(d) {
  MOP_CHECK(world_size >= 1 && d.dp >= 1 && d.cp >= 1 && d.edp >= 1 && d.ep >= 1,
            "mesh dimensions must be positive: ", str());
  MOP_CHECK(d.dp * d.cp == world_size && d.edp * d.ep == world_size,
            "mesh foldings must cover the world exactly: ", str());
  MOP_CHECK(d.pp == 1, "pipeline stages (pp ", d.pp, ") are not supported yet");
}

Mesh Mesh::of(const Config& cfg, int world_size) {
  validate_parallel(cfg, world_size);
  MeshDims d;
  d.dp = int(cfg.parallel.attention.dp), d.cp = int(cfg.parallel.attention.cp);
  d.edp = int(cfg.parallel.moe.dp), d.ep = int(cfg.parallel.moe.ep);
  return Mesh(world_size, d);
}

void Mesh::check_rank(int rank) const {
  MOP_CHECK(rank >= 0 && rank < world_size_, "rank ", rank, " outside ", str());
}

AttentionCoord Mesh::attention(int rank) const {
  check_rank(rank);
  return {rank / dims_.cp, rank % dims_.cp};
}

int Mesh::attention_rank(AttentionCoord c) const {
  MOP_CHECK(c.dp >= 0 && c.dp < dims_.dp && c.cp >= 0 && c.cp < dims_.cp,
            "attention coordinate (dp ", c.dp, ", cp ", c.cp, ") outside ", str());
  return c.dp * dims_.cp + c.cp;
}

MoeCoord Mesh::moe(int rank) const {
  check_rank(rank);
  return {rank / dims_.ep, rank % dims_.ep};
}

int Mesh::moe_rank(MoeCoord c) const {
  MOP_CHECK(c.edp >= 0 && c.edp < dims_.edp && c.ep >= 0 && c.ep < dims_.ep, "MoE coordinate (edp ",
            c.edp, ", ep ", c.ep, ") outside ", str());
  return c.edp * dims_.ep + c.ep;
}

MeshGroup Mesh::group(GroupKind kind, int rank) const {
  check_rank(rank);
  if (kind == GroupKind::World) return world_group(world_size_, rank);
  MeshGroup g;
  g.kind = kind;
  const AttentionCoord a = attention(rank);
  const MoeCoord m = moe(rank);
  switch (kind) {
    case GroupKind::Cp:
      for (int i = 0; i < dims_.cp; ++i) g.ranks.push_back(attention_rank({a.dp, i}));
      g.index = a.cp;
      break;
    case GroupKind::Dp:
      for (int i = 0; i < dims_.dp; ++i) g.ranks.push_back(attention_rank({i, a.cp}));
      g.index = a.dp;
      break;
    case GroupKind::Ep:
      for (int i = 0; i < dims_.ep; ++i) g.ranks.push_back(moe_rank({m.edp, i}));
      g.index = m.ep;
      break;
    case GroupKind::Edp:
      for (int i = 0; i < dims_.edp; ++i) g.ranks.push_back(moe_rank({i, m.ep}));
      g.index = m.edp;
      break;
    case GroupKind::World:
      break;
  }
  return g;
}

std::string Mesh::str() const {
  return "world " + std::to_string(world_size_) + ": attention dp " + std::to_string(dims_.dp) +
         " × cp " + std::to_string(dims_.cp) + ", MoE edp " + std::to_string(dims_.edp) + " × ep " +
         std::to_string(dims_.ep) + (dims_.pp != 1 ? ", pp " + std::to_string(dims_.pp) : "");
}

}  // namespace mop
