// Pipeline parallelism on the model's side: passes in flight (the activations that live from a
// pass's forward to its backward in a bank per pass) and stages (a range of segments whose input
// and output gradient come from the neighbouring stages). Interleaved passes equal sequential
// ones, and a model cut into stages that trade their boundaries by copy under a 1F1B schedule
// equals the whole model, bit for bit: every parameter gradient and the CE loss; the router
// losses to rounding, since each stage sums its own layers' terms.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "catch.h"
#include "config/config.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "parallel/inprocess_comm.h"
#include "runtime/memory.h"
#include "test_util.h"

using namespace mop;

namespace {

// 4 layers (the first dense), a shared expert, q/k norm, GQA, 6 experts top-2 (3 per rank at ep
// 2): segments 0 embedding, 1..4 layers, 5 head.
const char* kModel = R"(
model: {vocab_size: 11, hidden_size: 8, num_layers: 4, num_heads: 4, num_kv_heads: 2, head_dim: 4,
        rope_theta: 100, qk_norm: true, init_std: 0.5}
moe: {num_experts: 6, top_k: 2, expert_ffn: 6, shared_expert_ffn: 4, first_dense_layers: 1,
      dense_ffn: 6, aux_loss_coef: 0.1, z_loss_coef: 0.05}
data: {eos_id: 10, seq_len: 5}
train: {micro_batch_size: 2, global_batch_size: 6}
)";
constexpr int kBatch = 2, kSeq = 6, kTokens = kBatch * kSeq, kMicroBatches = 3, kSegments = 6;
constexpr float kAuxScale = 1.0f / kMicroBatches;
constexpr float kCeScale = 1.0f / 33;  // 1 / unmasked targets of the three micro-batches (Data)
// The router losses of a pipeline are the stages' partial sums added by the caller; the whole
// model adds every layer's terms into one acc-dtype sum, so the two differ by its rounding.
constexpr double kLossRtolF32 = 1e-6, kLossRtolF64 = 1e-14;

// Micro-batch m of rank r: ids, targets (one masked) and positions. With cp 2 the rank's 6
// tokens of each sequence are a stand-in for its share of 12: the runs compared see the same.
struct Data {
  std::vector<int32_t> ids, targets, pos;
  Data(int m, int r) {
    for (int i = 0; i < kTokens; ++i) {
      ids.push_back((i * 5 + m * 3 + r * 7) % 10);
      targets.push_back(i % 10 == 4 - m ? -1 : (i * 7 + m + 2 * r) % 11);
      pos.push_back(i % kSeq);
    }
  }
  Batch batch() {
    return {kBatch, kSeq, Tensor(ids.data(), DType::I32, {kTokens}),
            Tensor(targets.data(), DType::I32, {kTokens}),
            Tensor(pos.data(), DType::I32, {kTokens})};
  }
};

// The sharded cases' comms (in-process ranks): ep > 1 holds rank `rank`'s experts, cp > 1 shards
// the sequences (Ulysses).
struct Shards {
  Comm* ep = nullptr;
  Comm* cp = nullptr;
  int rank = 0;
};

// One model (or stage) over a store of its own, initialised like every other (seed 7): the same
// weights everywhere.
struct Model {
  Config cfg = load_config_text(kModel);
  ModelLayout layout;
  std::unique_ptr<Ops> ops = make_cpu_ops();
  std::unique_ptr<ParamStore> params;
  std::unique_ptr<Optimizer> optim;
  std::unique_ptr<Transformer> model;

  Model(DType dt, ActivationOptions plan, const Shards& sh = {}) {
    const int ep = sh.ep ? sh.ep->size() : 1;
    layout = ModelLayout::build(ModelDims::from(cfg, sh.ep ? sh.rank : 0, ep));
    params = std::make_unique<ParamStore>(layout, dt, dt, MemKind::Host);
    optim = std::make_unique<Optimizer>(cfg.optim, *params, *ops);
    optim->init_weights(7);
    // The experts' gradients start as NaN: the first micro-batch must write them (write_experts).
    ops->fill(params->grads_flat(), 0);
    for (int p = 0; p < params->num_params(); ++p)
      if (layout.params[size_t(p)].kind == ParamKind::Experts)
        ops->fill(params->grad(p), std::numeric_limits<double>::quiet_NaN());
    TransformerOptions o;
    o.plan = plan;
    o.plan.max_batch = kBatch, o.plan.max_seq = kSeq, o.plan.lm_head_chunk = 3, o.plan.ep = ep;
    o.plan.cp = sh.cp ? sh.cp->size() : 1;
    o.comms.ep = o.comms.ep_host = sh.ep;
    o.comms.cp = sh.cp;
    model = std::make_unique<Transformer>(layout, *params, *ops, o);
    model->allocate();
  }
  // The segment that holds parameter p (untied embeddings).
  int segment_of(int p) const {
    const int layer = layout.params[size_t(p)].layer;
    if (layer >= 0) return layer + 1;
    return p == layout.embedding ? 0 : kSegments - 1;
  }
};

// Checks made on in-process ranks' threads, reported on the test's thread (Catch2's assertions
// are not thread-safe): the failures with their context, and how many checks ran.
struct Checks {
  std::vector<std::string> failed;
  int64_t count = 0;
  std::string context;
  void expect(bool ok, const std::string& what) {
    ++count;
    if (!ok) failed.push_back(context + ": " + what);
  }
  void report() const {
    for (const std::string& f : failed) FAIL_CHECK(f);
    CHECK(count > 0);
  }
};
#define EXPECT(checks, cond) (checks).expect((cond), #cond)
void require(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(what);
}

struct Losses {
  double ce = 0, aux = 0, z = 0;
  void add(const LossTerms& t) { ce += t.ce_sum, aux += t.aux, z += t.z; }
};

// The reference: the whole model, one pass at a time.
Losses sequential(Model& m, int rank = 0) {
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    Data d(mb, rank);
    m.model->forward_backward(d.batch(), kCeScale, kAuxScale, /*write_experts=*/mb == 0);
  }
  Losses l;
  l.add(m.model->take_losses());
  return l;
}

// The passes of a whole model in the order `order` (micro-batch m forward as +m+1, backward as
// -(m+1)), micro-batch m in bank m % banks, each pass a segment at a time.
Losses interleaved(Model& m, const std::vector<int>& order, int banks, int rank = 0) {
  std::vector<Data> data;
  for (int mb = 0; mb < kMicroBatches; ++mb) data.emplace_back(mb, rank);
  std::vector<Transformer::Pass> passes(kMicroBatches);
  for (int step : order) {
    const int mb = std::abs(step) - 1;
    if (step > 0) {
      passes[size_t(mb)] = m.model->begin(data[size_t(mb)].batch(), kAuxScale, true, kCeScale,
                                          /*write_experts=*/mb == 0, mb % banks);
      for (int s = 0; s < kSegments; ++s) m.model->forward(passes[size_t(mb)], s, s + 1);
    } else {
      for (int s = kSegments - 1; s >= 0; --s) m.model->backward(passes[size_t(mb)], s, s + 1);
    }
  }
  Losses l;
  l.add(m.model->take_losses());
  return l;
}

int64_t differ(const Tensor& a, const Tensor& b) {
  require(a.bytes() == b.bytes(), "compared tensors of different sizes");
  const size_t w = dtype_size(a.dtype), n = a.bytes() / w;
  int64_t count = 0;
  for (size_t i = 0; i < n; ++i)
    count += std::memcmp(static_cast<const char*>(a.data) + i * w,
                         static_cast<const char*>(b.data) + i * w, w) != 0;
  return count;
}

bool all_finite(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(t.dtype == DType::F64 ? t.ptr<double>()[i] : double(t.ptr<float>()[i])))
      return false;
  return true;
}

bool close(double a, double b, double rtol) {
  return std::fabs(a - b) <= rtol * std::fabs(b);
}

// The activation plans the tests run: whole blocks, MoE chunks, recompute with saved tensors on
// the host and kept attention (the saved activations' banks and copies).
struct Variant {
  const char* name;
  bool recompute;
  int64_t moe_chunk;
  int host_layers, keep_attention;
};
const Variant kVariants[] = {{"plain", false, 0, 0, 0},
                             {"MoE chunks of 4", false, 4, 0, 0},
                             {"recompute", true, 0, 0, 0},
                             {"recompute, MoE chunks of 3", true, 3, 0, 0},
                             {"recompute, host layers 2", true, 0, 2, 0},
                             {"recompute, host layers 3, kept attention 2", true, 0, 3, 2}};

ActivationOptions plan_of(const Variant& v) {
  ActivationOptions o;
  o.recompute = v.recompute, o.moe_chunk = v.moe_chunk;
  o.host_layers = v.host_layers, o.keep_attention = v.keep_attention;
  return o;
}

void check_interleaved(Checks& c, DType dt, const Shards& sh = {}) {
  const int rank = sh.rank;
  // F0 F1 B0 F2 B1 B2 over two banks (1F1B's first stage of two), F0 F1 F2 B0 B1 B2 over three.
  const std::vector<std::pair<std::vector<int>, int>> orders = {{{1, 2, -1, 3, -2, -3}, 2},
                                                                {{1, 2, 3, -1, -2, -3}, 3}};
  for (const Variant& v : kVariants)
    for (const auto& [order, banks] : orders) {
      if (sh.cp && v.keep_attention) continue;  // kept attention needs cp 1 or ring attention
      c.context = std::string(v.name) + ", " + std::to_string(banks) + " banks, " +
                  std::string(dtype_name(dt)) + ", rank " + std::to_string(rank);
      Model ref(dt, plan_of(v), sh);
      ActivationOptions o = plan_of(v);
      o.passes_in_flight = banks;
      Model run(dt, o, sh);
      const Losses a = sequential(ref, rank), b = interleaved(run, order, banks, rank);
      EXPECT(c, a.ce == b.ce);
      EXPECT(c, a.aux == b.aux);
      EXPECT(c, a.z == b.z);
      EXPECT(c, a.ce > 0 && a.aux > 0 && a.z > 0);
      EXPECT(c, differ(ref.params->grads_flat(), run.params->grads_flat()) == 0);
      EXPECT(c, all_finite(run.params->grads_flat()));  // the experts' NaN were written over
    }
}

// The stages' 1F1B programs: stage i of P runs min(P − i − 1, M) forwards, then one forward and
// one backward in turn, then the remaining backwards (forward m as +m+1, backward as -(m+1)).
std::vector<std::vector<int>> one_f_one_b(int P, int M) {
  std::vector<std::vector<int>> prog(static_cast<size_t>(P));
  for (int i = 0; i < P; ++i) {
    const int warm = std::min(P - i - 1, M);
    int f = 0, b = 0;
    for (; f < warm; ++f) prog[size_t(i)].push_back(f + 1);
    while (b < M) {
      if (f < M) prog[size_t(i)].push_back(++f);
      prog[size_t(i)].push_back(-(++b));
    }
  }
  return prog;
}

// The whole model cut at `cuts` (segment boundaries, 0 … kSegments) into stages, each over a store
// of its own whose other segments' weights are NaN, run under 1F1B in one thread: at each turn the
// first stage whose next action has its input runs it. Boundaries travel by copy through
// mailboxes, as sends and receives would. Returns the stages' losses, summed.
struct Pipeline {
  std::vector<std::unique_ptr<Model>> stages;
  Losses losses;
};

Pipeline pipeline(DType dt, const Variant& v, const std::vector<int>& cuts, const Shards& sh) {
  const int rank = sh.rank;
  const int P = int(cuts.size()) - 1;
  Pipeline pl;
  for (int i = 0; i < P; ++i) {
    ActivationOptions o = plan_of(v);
    o.first_segment = cuts[size_t(i)], o.end_segment = cuts[size_t(i) + 1];
    o.passes_in_flight = std::min(P - i, kMicroBatches);
    pl.stages.push_back(std::make_unique<Model>(dt, o, sh));
    Model& m = *pl.stages.back();
    require(m.model->first_segment() == cuts[size_t(i)], "the stage's first segment");
    for (int p = 0; p < m.params->num_params(); ++p) {
      const int s = m.segment_of(p);
      if (s < cuts[size_t(i)] || s >= cuts[size_t(i) + 1])
        m.ops->fill(m.params->weight(p), std::numeric_limits<double>::quiet_NaN());
    }
  }
  std::vector<Data> data;
  for (int mb = 0; mb < kMicroBatches; ++mb) data.emplace_back(mb, rank);
  const size_t row_bytes = size_t(8) * dtype_size(dt) * kTokens;  // [T, H]
  // fwd[i][m]: stage i's input for micro-batch m (sent by stage i−1); bwd[i][m]: its output
  // gradient (sent by stage i+1). Empty until sent.
  using Mailboxes = std::vector<std::vector<std::vector<char>>>;
  Mailboxes fwd(static_cast<size_t>(P), std::vector<std::vector<char>>(kMicroBatches)), bwd = fwd;
  std::vector<std::vector<Transformer::Pass>> passes(static_cast<size_t>(P),
                                                     std::vector<Transformer::Pass>(kMicroBatches));
  const std::vector<std::vector<int>> prog = one_f_one_b(P, kMicroBatches);
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int i = 0; i < P && !progress; ++i) {
      if (next[size_t(i)] == prog[size_t(i)].size()) continue;
      const int step = prog[size_t(i)][next[size_t(i)]], mb = std::abs(step) - 1;
      Transformer& t = *pl.stages[size_t(i)]->model;
      Transformer::Pass& pass = passes[size_t(i)][size_t(mb)];
      const int first = cuts[size_t(i)], end = cuts[size_t(i) + 1];
      if (step > 0) {
        std::vector<char>& in = fwd[size_t(i)][size_t(mb)];
        if (i > 0 && in.empty()) continue;
        pass = t.begin(data[size_t(mb)].batch(), kAuxScale, true, kCeScale,
                       /*write_experts=*/mb == 0, mb % std::min(P - i, kMicroBatches));
        if (i > 0) {
          Tensor x = t.stage_input(pass);
          require(x.bytes() == row_bytes, "stage input of [T, H]");
          std::memcpy(x.data, in.data(), row_bytes);
        }
        t.forward(pass, first, end);
        if (i + 1 < P) {
          const Tensor y = t.stage_output(pass);
          std::vector<char>& out = fwd[size_t(i) + 1][size_t(mb)];
          out.assign(static_cast<const char*>(y.data),
                     static_cast<const char*>(y.data) + y.bytes());
        }
      } else {
        std::vector<char>& dy = bwd[size_t(i)][size_t(mb)];
        if (i + 1 < P && dy.empty()) continue;
        if (i + 1 < P) {
          Tensor g = t.stage_output_grad(pass);
          require(g.bytes() == row_bytes, "stage output gradient of [T, H]");
          std::memcpy(g.data, dy.data(), row_bytes);
        }
        for (int s = end - 1; s >= first; --s)
          t.backward(pass, s, s + 1);  // as the program calls it
        if (i > 0) {
          const Tensor dx = t.stage_input_grad(pass);
          std::vector<char>& out = bwd[size_t(i) - 1][size_t(mb)];
          out.assign(static_cast<const char*>(dx.data),
                     static_cast<const char*>(dx.data) + dx.bytes());
        }
      }
      ++next[size_t(i)];
      progress = true;
    }
  }
  for (int i = 0; i < P; ++i) {
    require(next[size_t(i)] == prog[size_t(i)].size(), "a stage's program ran to its end");
    pl.losses.add(pl.stages[size_t(i)]->model->take_losses());
  }
  return pl;
}

void check_stages(Checks& c, DType dt, const Shards& sh = {}) {
  const int rank = sh.rank;
  // Two and three stages; the embedding or the head alone; an uneven cut.
  const std::vector<std::vector<int>> splits = {
      {0, 3, 6}, {0, 2, 4, 6}, {0, 1, 5, 6}, {0, 4, 5, 6}};
  for (const Variant& v : kVariants)
    for (const std::vector<int>& cuts : splits) {
      if (sh.cp && v.keep_attention) continue;
      c.context = std::string(v.name) + ", " + std::to_string(cuts.size() - 1) + " stages cut at " +
                  std::to_string(cuts[1]) + ", " + std::to_string(cuts[2]) + ", " +
                  std::string(dtype_name(dt)) + ", rank " + std::to_string(rank);
      Model whole(dt, plan_of(v), sh);
      const Losses a = sequential(whole, rank);
      Pipeline pl = pipeline(dt, v, cuts, sh);
      EXPECT(c, a.ce == pl.losses.ce);
      const double rtol = dt == DType::F64 ? kLossRtolF64 : kLossRtolF32;
      EXPECT(c, close(pl.losses.aux, a.aux, rtol));
      EXPECT(c, close(pl.losses.z, a.z, rtol));
      int64_t compared = 0;
      for (size_t i = 0; i + 1 < cuts.size(); ++i) {
        Model& st = *pl.stages[i];
        for (int p = 0; p < st.params->num_params(); ++p) {
          const int s = st.segment_of(p);
          if (s < cuts[i] || s >= cuts[i + 1]) continue;
          const std::string name =
              "stage " + std::to_string(i) + ": " + st.layout.params[size_t(p)].name;
          c.expect(differ(whole.params->grad(p), st.params->grad(p)) == 0, name + " bitwise");
          c.expect(all_finite(st.params->grad(p)), name + " finite");
          ++compared;
        }
      }
      EXPECT(c, compared == whole.params->num_params());
    }
}

}  // namespace

TEST_CASE("stages: interleaved passes equal sequential ones bit for bit",
          "[cpu][model][transformer]") {
  Checks c;
  check_interleaved(c, DType::F32);
  check_interleaved(c, DType::F64);
  c.report();
}

TEST_CASE("stages: a model cut into stages under 1F1B equals the whole model",
          "[cpu][model][transformer]") {
  Checks c;
  check_stages(c, DType::F32);
  check_stages(c, DType::F64);
  c.report();
}

TEST_CASE("stages: passes in flight and stages over two expert-parallel ranks",
          "[cpu][model][transformer]") {
  // In-process ranks, each with its own micro-batches and half the experts: the dispatchers of
  // the passes in flight (one per layer and bank without recompute) keep their routing plans.
  std::vector<std::unique_ptr<Comm>> comms = make_inprocess_comms(2);
  std::vector<Checks> checks(2);
  run_inprocess(2, [&](int rank) {
    const Shards sh{comms[size_t(rank)].get(), nullptr, rank};
    check_interleaved(checks[size_t(rank)], DType::F32, sh);
    check_stages(checks[size_t(rank)], DType::F32, sh);
  });
  for (const Checks& c : checks) c.report();
}

TEST_CASE("stages: passes in flight and stages over cp 2 (Ulysses) and ep 2",
          "[cpu][model][transformer]") {
  // The two ranks shard the sequences for attention (head-sharded whole sequences in the sets)
  // and the experts for the MoE blocks, the router's counts summed over the cp group.
  std::vector<std::unique_ptr<Comm>> comms = make_inprocess_comms(2);
  std::vector<Checks> checks(2);
  run_inprocess(2, [&](int rank) {
    const Shards sh{comms[size_t(rank)].get(), comms[size_t(rank)].get(), rank};
    check_interleaved(checks[size_t(rank)], DType::F32, sh);
    check_stages(checks[size_t(rank)], DType::F32, sh);
  });
  for (const Checks& c : checks) c.report();
}

TEST_CASE("stages: the plan holds a bank per pass of what lives to the backward",
          "[cpu][model][transformer][plan]") {
  const ModelDims d = ModelDims::from(load_config_text(kModel));
  for (const Variant& v : kVariants) {
    INFO(v.name);
    ActivationOptions o = plan_of(v);
    o.max_batch = kBatch, o.max_seq = kSeq;
    const ActivationLayout one = plan_activations(d, o);
    size_t per_pass = 0, host_per_pass = 0;
    for (const BufferSpec& b : one.device)
      per_pass += b.per_pass && b.within < 0 ? align_up(b.shape.bytes()) : 0;
    for (const BufferSpec& b : one.host)
      host_per_pass += b.per_pass ? align_up(b.shape.bytes()) : 0;
    CHECK(per_pass > 0);
    o.passes_in_flight = 3;
    const ActivationLayout three = plan_activations(d, o);
    // Two more banks, and the head's input gradient out of dln into a bank of its own.
    const size_t dxf = align_up(size_t(kTokens) * 8 * 4);
    CHECK(three.arena_bytes() == one.arena_bytes() + 2 * per_pass + 3 * dxf);
    CHECK(three.host_arena_bytes() == one.host_arena_bytes() + 2 * host_per_pass);
    // Every bank's slot of a per-pass buffer is its own; shared ones are the same slot.
    for (size_t s = 0; s < three.device_bank[0].size(); ++s) {
      const bool banked = three.device[s].per_pass;
      CHECK((three.device_slot(int(s), 1) != int(s)) == banked);
      CHECK((three.device_slot(int(s), 2) != three.device_slot(int(s), 1)) == banked);
    }
    // One pass: the single-pass layout, slot for slot.
    CHECK(one.device_slot(one.xs[2], 0) == one.xs[2]);
    CHECK(one.shared.dxf == one.shared.dln);
  }
  // A stage: no activations for the layers outside it, nothing of the head or the embedding.
  ActivationOptions o;
  o.max_batch = kBatch, o.max_seq = kSeq;
  const ActivationLayout whole = plan_activations(d, o);
  o.first_segment = 2, o.end_segment = 4;  // layers 1 and 2
  const ActivationLayout mid = plan_activations(d, o);
  CHECK(mid.sets.size() == 2);
  CHECK(mid.xs[0] < 0);
  CHECK(mid.xs[1] >= 0);  // the input, received
  CHECK(mid.xs[3] >= 0);  // the output, sent
  CHECK(mid.xs[4] < 0);
  CHECK(mid.shared.lm_ws < 0);
  CHECK(mid.shared.dx >= 0);
  CHECK(mid.arena_bytes() < whole.arena_bytes());
}

TEST_CASE("stages: banks and boundaries used out of turn are internal errors",
          "[cpu][model][transformer]") {
  ActivationOptions o;
  o.passes_in_flight = 2, o.first_segment = 2, o.end_segment = 4;
  Model m(DType::F32, o);
  Transformer& t = *m.model;
  Data d0(0, 0), d1(1, 0);
  CHECK_THROWS_WITH(t.begin(d0.batch(), 1, true, kCeScale, false, 2),
                    Catch::Contains("bank 2 of 2"));
  const Transformer::Pass p0 = t.begin(d0.batch(), 1, true, kCeScale, false, 0);
  CHECK_THROWS_WITH(t.begin(d1.batch(), 1, true, kCeScale, false, 0),
                    Catch::Contains("still holds"));
  CHECK_THROWS_WITH(t.forward(p0, 1, 4), Catch::Contains("on a stage of [2,4)"));
  t.forward(p0, 2, 4);
  const Transformer::Pass p1 = t.begin(d1.batch(), 1, true, kCeScale, false, 1);
  t.forward(p1, 2, 4);
  t.backward(p0, 3, 4);  // under way: no other pass until it reaches segment 2
  CHECK_THROWS_WITH(t.forward(p1, 2, 3), Catch::Contains("under way"));
  CHECK_THROWS_WITH(t.backward(p1, 3, 4), Catch::Contains("under way"));
  t.backward(p0, 2, 3);
  t.backward(p1, 2, 4);
  CHECK_THROWS_WITH(t.backward(p1, 2, 4), Catch::Contains("holds no pass"));
  // Boundaries: this stage has both; the whole model has neither.
  CHECK(t.stage_input(p0).shape_str() == Tensor(nullptr, DType::F32, {kTokens, 8}).shape_str());
  CHECK(t.stage_output(p1).data != t.stage_output(p0).data);  // a bank each
  CHECK(t.stage_output_grad(p0).data ==
        t.stage_input_grad(p1).data);  // the shared residual gradient
  Model whole(DType::F32, ActivationOptions{});
  const Transformer::Pass w = whole.model->begin(d0.batch(), 1, false);
  CHECK_THROWS_WITH(whole.model->stage_input(w), Catch::Contains("starts with the embedding"));
  CHECK_THROWS_WITH(whole.model->stage_output_grad(w), Catch::Contains("ends with the head"));
  CHECK_THROWS_WITH(t.forward_backward(d0.batch(), kCeScale, 1), Catch::Contains("whole model"));
}
