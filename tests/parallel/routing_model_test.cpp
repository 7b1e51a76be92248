// RoutingModel: counts are exact (Σ = tokens × top_k, none over tokens) for every model over a
// grid of (tokens, experts, top_k); zipf follows its ratios and zipf:0 is balanced; a router
// histogram reads back the counts it was written with; the expert-parallel load picks the busiest
// rank; bad specs and hostile histogram files are UserErrors naming the file, the key and value.
#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "catch.h"
#include "core/rng.h"
#include "core/small_file.h"
#include "parallel/routing_model.h"
#include "test_util.h"

using namespace mop;
namespace fs = std::filesystem;

namespace {

// A histogram of `tokens` tokens per layer, each picking top_k distinct experts, skewed towards
// low experts (e = ⌊E·u²⌋) and differently per layer; deterministic.
RouterHistogram synthetic_histogram(int64_t E, int64_t k, int64_t layers, int64_t tokens,
                                    uint64_t seed) {
  RouterHistogram h;
  h.experts = E, h.top_k = k, h.tokens = tokens;
  h.counts.assign(size_t(layers * E), 0);
  std::vector<char> picked(static_cast<size_t>(E));
  uint64_t draw = 0;
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t t = 0; t < tokens; ++t) {
      std::fill(picked.begin(), picked.end(), 0);
      for (int64_t j = 0; j < k;) {
        const double u = double(philox_u64(seed, uint64_t(l), draw++) >> 11) / 9007199254740992.0;
        const int64_t e = (int64_t(double(E) * u * u) + l) % E;
        if (picked[size_t(e)]) continue;
        picked[size_t(e)] = 1, ++j;
        ++h.counts[size_t(l * E + e)];
      }
    }
  return h;
}

std::vector<int32_t> counts_of(const RoutingModel& m, int layer, int64_t tokens) {
  std::vector<int32_t> out(size_t(m.experts()), -1);  // poisoned: every entry must be written
  m.counts(layer, tokens, out.data());
  return out;
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

// A valid 2-expert, top-1 histogram's text with one member replaced ("" keeps it valid).
std::string histogram_text(const std::string& key = "", const std::string& value = "") {
  std::vector<std::pair<std::string, std::string>> members = {
      {"format", "\"mop-router-histogram\""},
      {"version", "1"},
      {"experts", "8"},
      {"top_k", "2"},
      {"tokens", "4"},
      {"layers", "[[1, 1, 1, 1, 1, 1, 1, 1], [4, 4, 0, 0, 0, 0, 0, 0]]"}};
  std::string out = "{";
  for (const auto& [k, v] : members) {
    if (k == key && value.empty()) continue;  // removed
    if (out.size() > 1) out += ", ";
    out += "\"" + k + "\": " + (k == key ? value : v);
  }
  return out + "}";
}

// n layers of 8 experts, each a valid [1, …, 1] (tokens 4, top_k 2).
std::string many_layers(int n) {
  std::string out = "[";
  for (int l = 0; l < n; ++l) out += l ? ", [1, 1, 1, 1, 1, 1, 1, 1]" : "[1, 1, 1, 1, 1, 1, 1, 1]";
  return out + "]";
}

}  // namespace

TEST_CASE("routing model: counts add up to tokens × top_k, none over tokens", "[cpu][routing]") {
  test::TempDir dir;
  for (int64_t E : {1, 2, 7, 8, 64, 257})
    for (int64_t k : {int64_t(1), int64_t(2), int64_t(6), E}) {
      if (k > E) continue;
      const std::string hist = dir / ("h" + std::to_string(E) + "_" + std::to_string(k) + ".json");
      write_router_histogram(hist, synthetic_histogram(E, k, 3, 50, uint64_t(E * 31 + k)));
      for (const std::string spec :
           {"balanced", "zipf:0.5", "zipf:1.2", "zipf:3", "zipf:60", "zipf:1e300", hist.c_str()}) {
        const RoutingModel m = RoutingModel::parse(spec, E, k);
        for (int layer : {0, 2})
          for (int64_t tokens :
               {int64_t(0), int64_t(1), int64_t(3), E - 1, E + 1, int64_t(1000), int64_t(65537)}) {
            INFO(spec << " E=" << E << " k=" << k << " layer " << layer << " tokens " << tokens);
            const std::vector<int32_t> c = counts_of(m, layer, tokens);
            int64_t sum = 0;
            bool in_range = true;
            for (int32_t x : c) sum += x, in_range = in_range && x >= 0 && x <= tokens;
            CHECK(sum == tokens * k);  // exact
            CHECK(in_range);
            CHECK(counts_of(m, layer, tokens) == c);  // deterministic
          }
      }
    }
}

TEST_CASE("routing model: zipf:0 is balanced; zipf follows 1/(e+1)^S", "[cpu][routing]") {
  for (int64_t E : {1, 5, 8, 64})
    for (int64_t k : {int64_t(1), int64_t(2), E}) {
      if (k > E) continue;
      const RoutingModel b = RoutingModel::parse("balanced", E, k),
                         z = RoutingModel::parse("zipf:0", E, k);
      for (int64_t tokens : {0, 1, 3, 7, 100, 12345}) {
        INFO("E=" << E << " k=" << k << " tokens " << tokens);
        CHECK(counts_of(z, 0, tokens) == counts_of(b, 0, tokens));
        // Largest remainder over equal shares: the first (tokens·k mod E) experts get one more.
        const std::vector<int32_t> c = counts_of(b, 0, tokens);
        for (int64_t e = 0; e < E; ++e)
          CHECK(c[size_t(e)] == tokens * k / E + (e < tokens * k % E ? 1 : 0));
      }
    }
  for (double S : {0.5, 1.0, 1.2, 2.0}) {
    INFO("zipf:" << S);
    const int64_t E = 16, tokens = 1000000;
    const RoutingModel m = RoutingModel::parse("zipf:" + std::to_string(S), E, 1);
    CHECK(m.share(0, 0) / m.share(0, 1) == Approx(std::pow(2.0, S)).epsilon(1e-12));
    CHECK(m.share(0, 0) / m.share(0, 3) == Approx(std::pow(4.0, S)).epsilon(1e-12));
    // Uncapped (top_k 1): each count within one row of tokens · share.
    const std::vector<int32_t> c = counts_of(m, 0, tokens);
    for (int64_t e = 0; e < E; ++e)
      CHECK(std::abs(c[size_t(e)] - double(tokens) * m.share(0, e)) < 1);
    for (int64_t e = 1; e < E; ++e) CHECK(c[size_t(e)] <= c[size_t(e - 1)]);  // expert 0 heaviest
  }
  // Capped: zipf:3 over 4 experts gives expert 0 85% of the rows, but with top_k 2 a token sends
  // it at most one: it takes `tokens`, and the other three share the rest as 1/8 : 1/27 : 1/64.
  const int64_t tokens = 27000;
  const RoutingModel m = RoutingModel::parse("zipf:3", 4, 2);
  CHECK(m.share(0, 0) > 0.5);
  const std::vector<int32_t> c = counts_of(m, 0, tokens);
  CHECK(c[0] == tokens);
  const double w = 1.0 / 8 + 1.0 / 27 + 1.0 / 64;
  for (int e = 1; e < 4; ++e)
    CHECK(std::abs(c[size_t(e)] - tokens * std::pow(double(e + 1), -3.0) / w) < 1);
  // A share that underflowed (zipf:1e300: expert 0 has everything): the rest take an even split.
  const RoutingModel steep = RoutingModel::parse("zipf:1e300", 5, 3);
  CHECK(counts_of(steep, 0, 10) == std::vector<int32_t>{10, 5, 5, 5, 5});
}

TEST_CASE("routing model: a router histogram reads back the counts it was written with",
          "[cpu][routing]") {
  test::TempDir dir;
  const int64_t E = 12, k = 3, L = 4, tokens = 777;
  const RouterHistogram h = synthetic_histogram(E, k, L, tokens, 9);
  const std::string path = dir / "router.json";
  write_router_histogram(path, h);
  CHECK_FALSE(fs::exists(path + ".tmp"));
  const RouterHistogram back = read_router_histogram(path, E, k);
  CHECK(back.counts == h.counts);
  CHECK(back.tokens == tokens);
  CHECK(back.layers() == L);

  const RoutingModel m = RoutingModel::parse(path, E, k);
  REQUIRE(m.layers() == L);
  for (int l = 0; l < L; ++l) {
    INFO("layer " << l);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t c = h.counts[size_t(l * E + e)];
      CHECK(m.share(l, e) == double(c) / double(tokens * k));
      sum += m.share(l, e);
    }
    CHECK(sum == Approx(1.0).epsilon(1e-12));
    // At the histogram's own token count the shares give back its counts exactly.
    const std::vector<int32_t> c = counts_of(m, l, tokens);
    CHECK(std::vector<int64_t>(c.begin(), c.end()) ==
          std::vector<int64_t>(h.counts.begin() + l * E, h.counts.begin() + (l + 1) * E));
  }
  // The layers differ (so each layer's own shares are used).
  CHECK(counts_of(m, 0, tokens) != counts_of(m, 1, tokens));
  // A layer the histogram does not have: a UserError naming the file and both counts.
  CHECK_USER_ERROR(counts_of(m, L, 10),
                   "router histogram " + path + ": has 4 MoE layers, MoE layer 4 asked");
  CHECK_USER_ERROR(m.share(L + 3, 0), "has 4 MoE layers, MoE layer 7 asked");
  CHECK(m.describe().find("router histogram " + path + ": 4 MoE layers, 777 tokens") == 0);
  CHECK(RoutingModel::parse("balanced", 8, 2).describe() ==
        "balanced over 8 experts: each takes 12.5% of the rows");
  CHECK(RoutingModel::parse("zipf:1", 4, 1).describe() ==
        "zipf:1 over 4 experts: expert 0's share 48.0% of the rows, expert 3's 12.0%");
  CHECK(RoutingModel::parse("zipf:1", 4, 3).describe() ==
        "zipf:1 over 4 experts: expert 0's share 48.0% of the rows, expert 3's 12.0% (capped at "
        "1/top_k = 33.3%: a token picks an expert once)");
}

TEST_CASE("routing model: the most loaded expert-parallel rank and its load", "[cpu][routing]") {
  const RoutingModel z = RoutingModel::parse("zipf:1.2", 16, 2);
  for (int ep : {2, 4, 8, 16}) {
    INFO("ep " << ep);
    CHECK(RoutingModel::most_loaded(z, ep, 4096) == 0);
    CHECK(RoutingModel::load(z, 0, ep, 4096) > 1.0);
    double sum = 0;
    for (int r = 0; r < ep; ++r) sum += RoutingModel::load(z, r, ep, 4096);
    CHECK(sum == Approx(double(ep)).epsilon(1e-12));  // the rows all arrive somewhere
  }
  // Two ranks of 8 experts: rank 0 gets Σ_{e<8} share; the load is that over one half.
  double first_half = 0;
  for (int e = 0; e < 8; ++e) first_half += z.share(0, e);
  CHECK(RoutingModel::load(z, 0, 2, 1 << 20) == Approx(2 * first_half).epsilon(1e-5));

  const RoutingModel b = RoutingModel::parse("balanced", 16, 2);
  CHECK(RoutingModel::most_loaded(b, 4, 4096) == 0);  // all tied: the lowest
  CHECK(RoutingModel::load(b, 3, 4, 4096) == 1.0);

  // A histogram whose layers favour rank 2's experts (8..11 of 16, ep 4) in total.
  test::TempDir dir;
  RouterHistogram h;
  h.experts = 16, h.top_k = 1, h.tokens = 160;
  h.counts.assign(32, 10);
  h.counts[9] = 40, h.counts[0] = h.counts[1] = h.counts[2] = 0;  // layer 0: ranks 10 40 70 40
  h.counts[16 + 3] = 25, h.counts[16 + 15] = 0, h.counts[16 + 14] = 5;  // layer 1: 55 40 40 25
  write_router_histogram(dir / "h.json", h);
  const RoutingModel m = RoutingModel::parse(dir / "h.json", 16, 1);
  CHECK(RoutingModel::most_loaded(m, 4, 160) == 2);
  CHECK(RoutingModel::load(m, 2, 4, 160) == (70.0 + 40.0) / (2 * 160 / 4.0));
}

TEST_CASE("routing model: a bad spec is a UserError naming it", "[cpu][routing]") {
  CHECK_USER_ERROR(RoutingModel::parse("", 8, 2), "routing model '': expected balanced, zipf:S");
  CHECK_USER_ERROR(RoutingModel::parse("zipf:", 8, 2),
                   "routing model zipf:: S: '' is not a finite number ≥ 0");
  CHECK_USER_ERROR(RoutingModel::parse("zipf:-1", 8, 2), "routing model zipf:-1: S: '-1'");
  CHECK_USER_ERROR(RoutingModel::parse("zipf:1.2x", 8, 2), "S: '1.2x'");
  CHECK_USER_ERROR(RoutingModel::parse("zipf:inf", 8, 2), "S: 'inf'");
  CHECK_USER_ERROR(RoutingModel::parse("zipf:nan", 8, 2), "S: 'nan'");
  CHECK_USER_ERROR(RoutingModel::parse("zipf", 8, 2),
                   "routing model 'zipf': expected balanced, zipf:S or the path");
  CHECK_USER_ERROR(RoutingModel::parse("Balanced", 8, 2), "(no such file)");
}

TEST_CASE("routing model: hostile histogram files are UserErrors naming file, key and value",
          "[cpu][routing]") {
  test::TempDir dir;
  const std::string path = dir / "h.json";
  const std::string name = "router histogram " + path;
  auto refused = [&](const std::string& text) {
    write_text(path, text);
    return test::user_error_of([&] { RoutingModel::parse(path, 8, 2); });
  };
  write_text(path, histogram_text());
  REQUIRE(RoutingModel::parse(path, 8, 2).layers() == 2);  // the base text is valid

  struct Case {
    std::string text, message;
  };
  const std::vector<Case> cases = {
      {"not json", name + ": invalid JSON"},
      {"[1, 2]", name + ": expected a JSON object, got an array"},
      {histogram_text("format", "\"mop-histogram\""),
       name + ": format: \"mop-histogram\", expected \"mop-router-histogram\""},
      {histogram_text("format", "7"), name + ": format: expected a string"},
      {histogram_text("format"), name + ": missing field 'format'"},
      {histogram_text("version", "2"), name + ": version: 2, expected 1"},
      {histogram_text("experts", "16"),
       name + ": experts: 16, but the model has 8 (moe.num_experts)"},
      // A claimed 10^12 experts is refused by the number, before anything is sized by it.
      {histogram_text("experts", "1000000000000"),
       name + ": experts: 1000000000000, but the model has 8"},
      {histogram_text("experts", "1e12"), name + ": experts: expected an integer"},
      {histogram_text("top_k", "1"), name + ": top_k: 1, but the model has 2 (moe.top_k)"},
      {histogram_text("tokens", "0"), name + ": tokens: 0, expected 1 to"},
      {histogram_text("tokens", "-4"), name + ": tokens: -4, expected 1 to"},
      {histogram_text("tokens", "9000000000000000000"),
       name + ": tokens: 9000000000000000000, expected 1 to"},
      {histogram_text("tokens", "18446744073709551615"),
       name + ": tokens: integer 18446744073709551615 out of range"},
      {histogram_text("layers", "[]"), name + ": layers: empty"},
      {histogram_text("layers", many_layers(4097)),
       name + ": layers: 4097 MoE layers, more than a model has"},
      {histogram_text("layers", "{}"), name + ": layers: expected an array"},
      {histogram_text("layers", "[[1, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3]]"),
       name + ": layers[1]: 3 counts, expected 8 (experts)"},
      {histogram_text("layers", "[[1, 1, 1, 1, 1, 1, 1, -1]]"),
       name + ": layers[0][7]: -1 is negative"},
      {histogram_text("layers", "[[5, 1, 1, 1, 0, 0, 0, 0]]"),
       name + ": layers[0][0]: 5 exceeds tokens (4)"},
      {histogram_text("layers", "[[1, 1, 1, 1, 1, 1, 1.5, 0.5]]"),
       name + ": layers[0][6]: expected an integer, got a number"},
      {histogram_text("layers", "[[1, 1, 1, 1, 1, 1, \"1\", 1]]"),
       name + ": layers[0][6]: expected an integer, got a string"},
      {histogram_text("layers", "[[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]]"),
       name + ": layers[1]: every count is 0"},
      {histogram_text("layers", "[[1, 1, 1, 1, 1, 1, 1, 0]]"),
       name + ": layers[0]: the counts add up to 7, expected tokens × top_k = 4 × 2 = 8"},
      {histogram_text("layers", "[[4, 4, 4, 0, 0, 0, 0, 0]]"),
       name + ": layers[0]: the counts add up to more than tokens × top_k = 4 × 2 = 8"},
  };
  for (const Case& c : cases) {
    INFO(c.text);
    const std::string msg = refused(c.text);
    INFO("UserError message: \"" << msg << "\"");
    CHECK(msg.find(c.message) != std::string::npos);
  }

  // Not a regular file: refused by stat, before any read (a FIFO would block an open).
  CHECK_USER_ERROR(
      RoutingModel::parse(dir.path.string(), 8, 2),
      "router histogram " + dir.path.string() + ": is not a regular file (a directory)");
  const fs::path fifo = dir.path / "fifo.json";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_USER_ERROR(RoutingModel::parse(fifo.string(), 8, 2),
                   "router histogram " + fifo.string() + ": is not a regular file (a FIFO)");
  // A file over the cap (sparse: nothing is written or read).
  const fs::path big = dir.path / "big.json";
  { std::ofstream(big, std::ios::binary); }
  fs::resize_file(big, 17 * kMiB);
  CHECK_USER_ERROR(RoutingModel::parse(big.string(), 8, 2),
                   "router histogram " + big.string() + ": 17 MiB");
}
