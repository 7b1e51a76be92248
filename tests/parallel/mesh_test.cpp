// Mesh coordinates and groups for several layouts, against the MPI_Comm_split colours and keys the
// groups were made with before the mesh (cp: colour dp, key cp; ep: colour edp, key ep; edp:
// colour ep, key edp), simulated here for every rank.
#include <algorithm>
#include <map>
#include <vector>

#include "catch.h"
#include "config/config.h"
#include "core/error.h"
#include "parallel/mesh.h"

using namespace mop;

namespace {

// The group MPI_Comm_split gives rank `me` when every rank r passes colour(r) and key(r): the
// ranks of its colour, ordered by key, then world rank.
template <class Colour, class Key>
MeshGroup split(int world, int me, Colour colour, Key key) {
  std::vector<std::pair<int, int>> members;  // (key, rank)
  for (int r = 0; r < world; ++r)
    if (colour(r) == colour(me)) members.emplace_back(key(r), r);
  std::sort(members.begin(), members.end());
  MeshGroup g;
  for (auto [k, r] : members) {
    if (r == me) g.index = g.size();
    g.ranks.push_back(r);
  }
  return g;
}

}  // namespace

TEST_CASE("mesh: coordinates, and groups as MPI_Comm_split made them", "[cpu]") {
  struct Layout {
    int world, cp, ep;
  };
  for (const Layout l :
       {Layout{1, 1, 1}, Layout{2, 2, 1}, Layout{2, 1, 2}, Layout{4, 2, 2}, Layout{8, 2, 4},
        Layout{8, 4, 2}, Layout{8, 8, 1}, Layout{8, 1, 8}, Layout{6, 3, 2}, Layout{12, 4, 6}}) {
    INFO("world " << l.world << " cp " << l.cp << " ep " << l.ep);
    MeshDims d;
    d.cp = l.cp, d.dp = l.world / l.cp, d.ep = l.ep, d.edp = l.world / l.ep;
    const Mesh mesh(l.world, d);
    CHECK(mesh.world_size() == l.world);
    // The foldings of groups.h: rank = dp·cp_size + cp = edp·ep_size + ep.
    for (int r = 0; r < l.world; ++r) {
      const AttentionCoord a = mesh.attention(r);
      const MoeCoord m = mesh.moe(r);
      CHECK((a.dp == r / l.cp && a.cp == r % l.cp));
      CHECK((m.edp == r / l.ep && m.ep == r % l.ep));
      CHECK(mesh.attention_rank(a) == r);
      CHECK(mesh.moe_rank(m) == r);
    }
    auto cp_of = [&](int r) { return mesh.attention(r).cp; };
    auto dp_of = [&](int r) { return mesh.attention(r).dp; };
    auto ep_of = [&](int r) { return mesh.moe(r).ep; };
    auto edp_of = [&](int r) { return mesh.moe(r).edp; };
    auto all = [](int) { return 0; };
    auto rank_of = [](int r) { return r; };
    struct Expect {
      GroupKind kind;
      int size;
    };
    for (const Expect e : {Expect{GroupKind::World, l.world}, Expect{GroupKind::Cp, l.cp},
                           Expect{GroupKind::Dp, l.world / l.cp}, Expect{GroupKind::Ep, l.ep},
                           Expect{GroupKind::Edp, l.world / l.ep}}) {
      INFO(group_kind_name(e.kind) << " groups");
      std::map<std::vector<int>, int> members_seen;  // each group's members → ranks that saw it
      std::vector<int> groups_of_rank(size_t(l.world), 0);
      for (int r = 0; r < l.world; ++r) {
        const MeshGroup g = mesh.group(e.kind, r);
        CHECK(g.kind == e.kind);
        CHECK(g.size() == e.size);
        CHECK(g.world_rank() == r);
        MeshGroup want;
        switch (e.kind) {
          case GroupKind::World:
            want = split(l.world, r, all, rank_of);
            break;
          case GroupKind::Cp:
            want = split(l.world, r, dp_of, cp_of);
            break;
          case GroupKind::Dp:
            want = split(l.world, r, cp_of, dp_of);
            break;
          case GroupKind::Ep:
            want = split(l.world, r, edp_of, ep_of);
            break;
          case GroupKind::Edp:
            want = split(l.world, r, ep_of, edp_of);
            break;
        }
        CHECK(g.ranks == want.ranks);
        CHECK(g.index == want.index);
        ++members_seen[g.ranks];
      }
      // Every rank in exactly one group of the kind, and every member sees the same group.
      for (const auto& [ranks, seen] : members_seen) {
        CHECK(seen == int(ranks.size()));
        for (int r : ranks) ++groups_of_rank[size_t(r)];
      }
      CHECK(std::count(groups_of_rank.begin(), groups_of_rank.end(), 1) == l.world);
      CHECK(int(members_seen.size()) * e.size == l.world);
    }
  }
}

TEST_CASE("mesh: dimensions are checked against the world", "[cpu]") {
  MeshDims d;
  d.dp = 2, d.cp = 2, d.edp = 1, d.ep = 4;
  CHECK_NOTHROW(Mesh(4, d));
  CHECK_THROWS_AS(Mesh(8, d), Error);
  MeshDims pp = d;
  pp.pp = 2;
  CHECK_THROWS_AS(Mesh(4, pp), Error);
  MeshDims zero = d;
  zero.cp = 0;
  CHECK_THROWS_AS(Mesh(4, zero), Error);
  const Mesh mesh(4, d);
  CHECK_THROWS_AS(mesh.group(GroupKind::Cp, 4), Error);
  CHECK_THROWS_AS(mesh.attention_rank({2, 0}), Error);
  CHECK(mesh.str() == "world 4: attention dp 2 × cp 2, MoE edp 1 × ep 4");

  // From a config: its foldings, and the config's own errors (validate_parallel) first.
  Config c = load_config_text(
      "parallel: {attention: {cp: 2, dp: 2}, moe: {ep: 4}}\ntrain: {global_batch_size: 16}");
  const Mesh of = Mesh::of(c, 4);
  CHECK((of.dims().cp == 2 && of.dims().dp == 2 && of.dims().ep == 4 && of.dims().edp == 1));
  CHECK_THROWS_WITH(Mesh::of(c, 8),
                    "parallel.attention: cp (2) × dp (2) = 4 must equal the number of ranks (8)");
}
