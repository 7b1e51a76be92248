// Mesh coordinates and groups for several layouts, against the MPI_Comm_split colours and keys the
// groups were made with before the mesh had named axes (cp: colour dp, key cp; ep: colour edp, key
// ep; edp: colour ep, key edp), simulated here for every rank; and with pipeline stages, groups
// along several axes, positions in a group and members on a node.
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
    int world, cp, ep, pp = 1;
  };
  for (const Layout l :
       {Layout{1, 1, 1}, Layout{2, 2, 1}, Layout{2, 1, 2}, Layout{4, 2, 2}, Layout{8, 2, 4},
        Layout{8, 4, 2}, Layout{8, 8, 1}, Layout{8, 1, 8}, Layout{6, 3, 2}, Layout{12, 4, 6},
        Layout{8, 2, 2, 2}, Layout{24, 2, 3, 4}, Layout{16, 1, 8, 2}}) {
    INFO("world " << l.world << " cp " << l.cp << " ep " << l.ep << " pp " << l.pp);
    const int stage = l.world / l.pp;
    MeshDims d;
    d.pp = l.pp, d.cp = l.cp, d.dp = stage / l.cp, d.ep = l.ep, d.edp = stage / l.ep;
    const Mesh mesh(l.world, d);
    CHECK(mesh.world_size() == l.world);
    // rank = pp·stage + dp·cp_size + cp = pp·stage + edp·ep_size + ep.
    for (int r = 0; r < l.world; ++r) {
      const MeshCoord c = mesh.coord(r);
      const int within = r % stage;
      CHECK(c[Axis::Pp] == r / stage);
      CHECK((c[Axis::Dp] == within / l.cp && c[Axis::Cp] == within % l.cp));
      CHECK((c[Axis::Edp] == within / l.ep && c[Axis::Ep] == within % l.ep));
      CHECK(mesh.rank_of(c, Axis::Cp) == r);
      CHECK(mesh.rank_of(c, Axis::Ep) == r);
    }
    auto pp_of = [&](int r) { return mesh.coord(r)[Axis::Pp]; };
    auto cp_of = [&](int r) { return mesh.coord(r)[Axis::Cp]; };
    auto dp_of = [&](int r) { return mesh.coord(r)[Axis::Dp]; };
    auto ep_of = [&](int r) { return mesh.coord(r)[Axis::Ep]; };
    auto edp_of = [&](int r) { return mesh.coord(r)[Axis::Edp]; };
    auto all = [](int) { return 0; };
    auto rank_of = [](int r) { return r; };
    struct Expect {
      Axes axes;
      int size;
    };
    for (const Expect e :
         {Expect{kWorldAxes, l.world}, Expect{Axes{Axis::Cp}, l.cp},
          Expect{Axes{Axis::Dp}, stage / l.cp}, Expect{Axes{Axis::Ep}, l.ep},
          Expect{kExpertReplicas, stage / l.ep}, Expect{kDenseReplicas, stage},
          Expect{Axes{Axis::Pp}, l.pp}, Expect{Axes{Axis::Pp, Axis::Ep}, l.pp * l.ep}}) {
      INFO(e.axes.str() << " groups");
      std::map<std::vector<int>, int> members_seen;  // each group's members → ranks that saw it
      std::vector<int> groups_of_rank(size_t(l.world), 0);
      for (int r = 0; r < l.world; ++r) {
        const MeshGroup g = mesh.group(e.axes, r);
        CHECK(g.axes == e.axes);
        CHECK(g.size() == e.size);
        CHECK(mesh.size(e.axes) == e.size);
        CHECK(g.world_rank() == r);
        CHECK(mesh.index_in(e.axes, r) == g.index);
        MeshGroup want;
        if (e.axes == kWorldAxes)
          want = split(l.world, r, all, rank_of);
        else if (e.axes == Axes{Axis::Cp})
          want = split(
              l.world, r, [&](int q) { return pp_of(q) * 1000 + dp_of(q); }, cp_of);
        else if (e.axes == Axes{Axis::Dp})
          want = split(
              l.world, r, [&](int q) { return pp_of(q) * 1000 + cp_of(q); }, dp_of);
        else if (e.axes == Axes{Axis::Ep})
          want = split(
              l.world, r, [&](int q) { return pp_of(q) * 1000 + edp_of(q); }, ep_of);
        else if (e.axes == kExpertReplicas)
          want = split(
              l.world, r, [&](int q) { return pp_of(q) * 1000 + ep_of(q); }, edp_of);
        else if (e.axes == kDenseReplicas)
          want = split(l.world, r, pp_of, rank_of);
        else if (e.axes == Axes{Axis::Pp})
          want = split(
              l.world, r, [&](int q) { return q % stage; }, pp_of);
        else
          want = split(l.world, r, edp_of, rank_of);  // pp × ep: one edp coordinate, every stage
        CHECK(g.ranks == want.ranks);
        CHECK(g.index == want.index);
        ++members_seen[g.ranks];
      }
      // Every rank in exactly one group along the axes, and every member sees the same group.
      for (const auto& [ranks, seen] : members_seen) {
        CHECK(seen == int(ranks.size()));
        for (int r : ranks) ++groups_of_rank[size_t(r)];
      }
      CHECK(std::count(groups_of_rank.begin(), groups_of_rank.end(), 1) == l.world);
      CHECK(int(members_seen.size()) * e.size == l.world);
    }
  }
}

TEST_CASE("mesh: members on a node", "[cpu]") {
  // 96 ranks, 8 per node: cp 32 × dp 3, ep 12 × edp 8 (the trillion-parameter model's layout).
  MeshDims d;
  d.cp = 32, d.dp = 3, d.ep = 12, d.edp = 8;
  const Mesh mesh(96, d);
  CHECK(mesh.on_node(Axes{Axis::Cp}, 0, 8) == 8);
  CHECK(mesh.on_node(Axes{Axis::Ep}, 0, 8) == 8);
  CHECK(mesh.on_node(Axes{Axis::Ep}, 8, 8) == 4);  // ranks 8..11 of the ep group 0..11
  CHECK(mesh.on_node(kExpertReplicas, 0, 8) == 1);
  CHECK(mesh.on_node(kWorldAxes, 0, 8) == 8);
  CHECK(mesh.on_node(Axes{Axis::Dp}, 0, 96) == 3);
  // ep 6 × edp 2 on 12 ranks of 8 per node: the edp pair 0 and 6 shares rank 0's node.
  MeshDims e;
  e.cp = 1, e.dp = 12, e.ep = 6, e.edp = 2;
  CHECK(Mesh(12, e).on_node(kExpertReplicas, 0, 8) == 2);
  CHECK(Mesh(12, e).on_node(kExpertReplicas, 2, 8) == 1);  // 2 and 8: two nodes
}

TEST_CASE("mesh: dimensions are checked against the world", "[cpu]") {
  MeshDims d;
  d.dp = 2, d.cp = 2, d.edp = 1, d.ep = 4;
  CHECK_NOTHROW(Mesh(4, d));
  CHECK_THROWS_AS(Mesh(8, d), Error);
  MeshDims pp = d;
  pp.pp = 2;
  CHECK_THROWS_AS(Mesh(4, pp), Error);
  CHECK_NOTHROW(Mesh(8, pp));
  CHECK(Mesh(8, pp).str() == "world 8: pp 2 × attention dp 2 × cp 2, MoE edp 1 × ep 4");
  MeshDims zero = d;
  zero.cp = 0;
  CHECK_THROWS_AS(Mesh(4, zero), Error);
  const Mesh mesh(4, d);
  CHECK_THROWS_AS(mesh.group(Axes{Axis::Cp}, 4), Error);
  CHECK_THROWS_AS(mesh.group(Axes{Axis::Cp, Axis::Ep}, 0), Error);  // two foldings
  MeshCoord outside;
  outside[Axis::Dp] = 2;
  CHECK_THROWS_AS(mesh.rank_of(outside, Axis::Dp), Error);
  CHECK(mesh.str() == "world 4: attention dp 2 × cp 2, MoE edp 1 × ep 4");
  CHECK(Axes{Axis::Dp, Axis::Cp}.str() == "dp×cp");
  CHECK(mesh.group(kWorldAxes, 1).name() == "world");
  CHECK(mesh.group(kExpertReplicas, 1).name() == "edp");

  // From a config: its axes, and the config's own errors (validate_parallel) first.
  Config c = load_config_text(
      "parallel: {attention: {cp: 2, dp: 2}, moe: {ep: 4}}\ntrain: {global_batch_size: 16}");
  const Mesh of = Mesh::of(c, 4);
  CHECK((of.dims().cp == 2 && of.dims().dp == 2 && of.dims().ep == 4 && of.dims().edp == 1 &&
         of.dims().pp == 1));
  CHECK_THROWS_WITH(Mesh::of(c, 8),
                    "parallel.attention: cp (2) × dp (2) = 4 must equal the number of ranks (8)"
                    "; give foldings that multiply to 8, or set train.plan: auto to have the plan choose those the config does not give");
}
