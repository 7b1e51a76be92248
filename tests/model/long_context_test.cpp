// Long-sequence placements are lossless on the CPU: the token-chunked MoE/FFN block, layer inputs
// and kept attention outputs in host memory (with their stages), and kept attention that skips the
// recomputation give the same loss, gradients and weights as the plain step, bit for bit, over a
// grid of chunk sizes (1, primes, T − 1), host layers and kept layers; two micro-batches and an
// optimizer step, then another step from the updated weights.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "catch.h"
#include "config/config.h"
#include "model/activations.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "test_util.h"

using namespace mop;

namespace {

// 4 layers (the first dense), shared expert, q/k norm, GQA; 6 experts top-2: a chunk of one
// token routes 2 rows, so at least 4 experts have none in it.
const char* kModel = R"(
model: {vocab_size: 13, hidden_size: 8, num_layers: 4, num_heads: 4, num_kv_heads: 2, head_dim: 4,
        rope_theta: 100, qk_norm: true, init_std: 0.5}
moe: {num_experts: 6, top_k: 2, expert_ffn: 6, shared_expert_ffn: 4, first_dense_layers: 1,
      dense_ffn: 6, aux_loss_coef: 0.1, z_loss_coef: 0.05}
optim: {lr: 0.01, warmup_steps: 0}
data: {eos_id: 12, seq_len: 7}
train: {micro_batch_size: 2, global_batch_size: 4}
)";
constexpr int kBatch = 2, kSeq = 7;

struct Run {
  Config cfg = load_config_text(kModel);
  ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  std::unique_ptr<Ops> ops = make_cpu_ops();
  std::unique_ptr<ParamStore> params;
  std::unique_ptr<Optimizer> optim;
  std::unique_ptr<Transformer> model;
  std::vector<float> losses;
  int batch;  // sequences per micro-batch

  explicit Run(const ActivationOptions& plan, int batch_ = kBatch) : batch(batch_) {
    params = std::make_unique<ParamStore>(layout, DType::F32, DType::F32, MemKind::Host);
    optim = std::make_unique<Optimizer>(cfg.optim, *params, *ops);
    optim->init_weights(11);
    TransformerOptions o;
    o.plan = plan;
    o.plan.max_batch = batch, o.plan.max_seq = kSeq, o.plan.lm_head_chunk = 5;
    model = std::make_unique<Transformer>(layout, *params, *ops, o);
    model->allocate();
  }
  // Two optimizer steps of two micro-batches each.
  void train() {
    for (int step = 0; step < 2; ++step) {
      ops->fill(params->grads_flat(), 0);
      for (int mb = 0; mb < 2; ++mb) {
        const int tokens = batch * kSeq;
        std::vector<int32_t> ids(static_cast<size_t>(tokens)), targets(ids), pos(ids);
        for (int i = 0; i < tokens; ++i) {
          ids[size_t(i)] = (i * 5 + mb * 3 + step * 7) % 12;
          targets[size_t(i)] = i % 6 == 5 ? -1 : (i * 7 + mb + step) % 13;
          pos[size_t(i)] = i % kSeq;
        }
        Batch b{batch, kSeq, Tensor(ids.data(), DType::I32, {tokens}),
                Tensor(targets.data(), DType::I32, {tokens}), Tensor(pos.data(), DType::I32, {tokens})};
        model->forward_backward(b, 1.0f / 24, 0.5f);
        LossTerms t = model->take_losses();
        losses.insert(losses.end(), {float(t.ce_sum), float(t.aux), float(t.z)});
      }
      if (step == 0) grads = copy(params->grads_flat());
      optim->step(1e-2f);
    }
    weights = copy(params->weights_flat());
  }
  std::vector<float> grads, weights;
  static std::vector<float> copy(const Tensor& t) {
    std::vector<float> v(size_t(t.numel()));
    std::memcpy(v.data(), t.data, t.bytes());
    return v;
  }
};

int64_t differ(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

void check_equal(Run& plain, const ActivationOptions& o) {
  Run r(o);
  r.train();
  INFO("moe_chunk " << o.moe_chunk << ", recompute " << o.recompute << ", host layers "
                    << o.host_layers << ", kept attention " << o.keep_attention);
  CHECK(differ(plain.losses, r.losses) == 0);
  CHECK(differ(plain.grads, r.grads) == 0);
  CHECK(differ(plain.weights, r.weights) == 0);
}

}  // namespace

TEST_CASE("long context: chunked MoE/FFN equals the plain step bit for bit", "[cpu][model]") {
  REQUIRE(2 * 1 < 6);  // chunk 1 leaves experts without tokens
  Run plain(ActivationOptions{});
  plain.train();
  for (int64_t chunk : {1, 2, 3, 5, 13, 14, 100})
    for (bool recompute : {false, true}) {
      ActivationOptions o;
      o.moe_chunk = chunk, o.recompute = recompute;
      check_equal(plain, o);
    }
}

// With recompute, x_mid and ln2 live in dattn's bytes where those hold them: at 8 sequences of 7
// tokens both do (56·8 floats each, 256-byte aligned, in dattn's 56·16), so the recomputing steps
// below run with both views and must equal the plain step bit for bit.
TEST_CASE("long context: x_mid and ln2 in dattn's bytes equal the plain step bit for bit",
          "[cpu][model]") {
  Run plain(ActivationOptions{}, 8);
  plain.train();
  for (int host : {0, 2})
    for (int64_t chunk : {0, 5}) {
      ActivationOptions o;
      o.recompute = true, o.host_layers = host, o.keep_attention = host ? 1 : 0, o.moe_chunk = chunk;
      Run r(o, 8);
      const ActivationLayout& L = r.model->activations();
      REQUIRE(L.device[size_t(L.sets[0].x_mid)].within == L.shared.dattn);
      REQUIRE(L.device[size_t(L.sets[0].ln2)].within == L.shared.dattn);
      r.train();
      INFO("host layers " << host << ", moe_chunk " << chunk);
      CHECK(differ(plain.losses, r.losses) == 0);
      CHECK(differ(plain.grads, r.grads) == 0);
      CHECK(differ(plain.weights, r.weights) == 0);
    }
}

TEST_CASE("long context: saved tensors in host memory and kept attention are lossless",
          "[cpu][model]") {
  Run plain(ActivationOptions{});
  plain.train();
  for (int host : {0, 1, 2, 3, 4})
    for (int keep : {0, 1, 3, 4})
      for (int64_t chunk : {0, 3}) {
        ActivationOptions o;
        o.recompute = true, o.host_layers = host, o.keep_attention = keep, o.moe_chunk = chunk;
        check_equal(plain, o);
      }
}

// Query tiles change the order of attention's sums (merges of blocks by their log-sum-exp), so
// the step equals the plain one to fp32 rounding rather than bit for bit; with kept attention in
// host memory the tile-major lse travels to the host and back.
TEST_CASE("long context: attention in query tiles gives the plain step's losses and gradients",
          "[cpu][model]") {
  Run plain(ActivationOptions{});
  plain.train();
  const auto close = [](const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    double diff = 0, scale = 0;
    for (size_t i = 0; i < a.size(); ++i)
      diff = std::max(diff, double(std::abs(a[i] - b[i]))), scale = std::max(scale, double(std::abs(b[i])));
    return diff <= 2e-5 * scale;
  };
  for (int keep : {0, 4}) {
    ActivationOptions o;
    o.attention_tile = 1;  // kSeq = 7: seven one-token tiles, 28 blocks per sequence
    o.recompute = keep > 0, o.keep_attention = keep, o.host_layers = keep > 0 ? 2 : 0;
    Run r(o);
    r.train();
    INFO("kept attention " << keep);
    CHECK(close(r.losses, plain.losses));
    CHECK(close(r.grads, plain.grads));
    CHECK(differ(r.grads, plain.grads) > 0);  // the tiles did run: the sums' order changed
  }
}

// Kept tails: with query tiles (one token each here), layers that recompute their attention keep
// its last tiles, on the device or in host memory, and recompute the tiles before them only. The
// recomputed tiles are the forward's own calls, so the step equals the tiled step that recomputes
// everything, bit for bit (micro-batches of one sequence, which tails need).
TEST_CASE("long context: kept attention tails give the tiled step's bits", "[cpu][model]") {
  ActivationOptions tiled;
  tiled.attention_tile = 1, tiled.recompute = true;
  Run plain(tiled, 1);
  plain.train();
  for (int tail : {1, 3, 6})
    for (int keep : {0, 2})
      for (int host : {0, 1, 4}) {
        ActivationOptions o = tiled;
        o.keep_attention_tail = tail, o.keep_attention = keep, o.host_layers = host;
        Run r(o, 1);
        r.train();
        INFO("tail " << tail << ", kept layers " << keep << ", host layers " << host);
        CHECK(differ(plain.losses, r.losses) == 0);
        CHECK(differ(plain.grads, r.grads) == 0);
        CHECK(differ(plain.weights, r.weights) == 0);
      }
  // Tails are refused where they cannot be cut from one tiled sequence.
  ActivationOptions bad = tiled;
  bad.keep_attention_tail = 2;
  CHECK_THROWS_WITH(Run(bad, 2), Catch::Contains("one sequence per micro-batch"));
  bad.keep_attention_tail = kSeq;
  CHECK_THROWS_WITH(Run(bad, 1), Catch::Contains("fewer tiles"));
}

TEST_CASE("long context: the activation plan holds O(chunk) routed rows and saves where told",
          "[cpu][model][plan]") {
  const ModelDims d = ModelDims::from(load_config_text(R"(
model: {vocab_size: 151936, hidden_size: 2048, num_layers: 8, num_heads: 32, num_kv_heads: 4, head_dim: 128}
moe: {num_experts: 128, top_k: 8, expert_ffn: 768}
)"));
  ActivationOptions o;
  o.max_batch = 1, o.max_seq = 1 << 20, o.recompute = true, o.compute = DType::BF16;
  o.lm_head_chunk = 4096;
  const ActivationLayout whole = plan_activations(d, o);
  o.moe_chunk = 32768;
  const ActivationLayout chunked = plan_activations(d, o);
  const auto experts = [](const ActivationLayout& L) {
    return L.device_by_component()[size_t(Component::Experts)];
  };
  // Whole: xp, yp, gu, h and their gradients over S·k rows, about 80 GiB at 1M; chunked: 1/32.
  CHECK(experts(whole) > size_t(75) << 30);
  CHECK(experts(chunked) * 32 == experts(whole));
  // Nothing left scales with S·k·H: every buffer holds at most S·Q elements (q, attention output)
  // or S·E (router logits) — or one chunk.
  for (const BufferSpec& b : chunked.device)
    CHECK(b.shape.numel() <= std::max<int64_t>(int64_t(1 << 20) * 4096, 32768 * 8 * 2048));
  // Saved tensors: 9 layer inputs on the device; with 3 host layers, 3 go to host memory through
  // two stages (one input fewer on the device), and kept attention adds an output per layer.
  o.host_layers = 3, o.keep_attention = 5;
  const ActivationLayout saved = plan_activations(d, o);
  const size_t input = size_t(1 << 20) * 2048 * 2, attn = size_t(1 << 20) * 4096 * 2 + size_t(1 << 20) * 32 * 4;
  const size_t checkpoints = saved.device_by_component()[size_t(Component::Checkpoints)];
  CHECK(checkpoints == (9 - 3 + 2) * input + 2 * attn);
  CHECK(saved.host_arena_bytes() >= 3 * input + 3 * attn);
  CHECK(saved.host_arena_bytes() < 3 * input + 3 * attn + (size_t(1) << 20));
  // Every input on the host: x_8 (never copied out) shares x_6's stage, so the device holds the
  // two stages only.
  o.host_layers = 8, o.keep_attention = 0;
  const ActivationLayout all_host = plan_activations(d, o);
  CHECK(all_host.device_by_component()[size_t(Component::Checkpoints)] == 2 * input);
  CHECK(all_host.xs[8] == all_host.xs[6]);
  CHECK(all_host.xs[7] != all_host.xs[6]);
  // With recompute, x_mid and ln2 live in dattn's bytes (Q = 2H here): the arena is 2·S·H·2
  // bytes smaller than their own buffers would make it; without recompute they keep their own.
  const ActSlots& set = all_host.sets[0];
  const BufferSpec &x_mid = all_host.device[size_t(set.x_mid)], &ln2 = all_host.device[size_t(set.ln2)];
  CHECK(x_mid.within == all_host.shared.dattn);
  CHECK(x_mid.offset == 0);
  CHECK(ln2.within == all_host.shared.dattn);
  CHECK(ln2.offset == input);
  size_t own = 0;
  for (const BufferSpec& b : all_host.device) own += b.within < 0 ? 0 : b.shape.bytes();
  CHECK(own == 2 * input);
  o.recompute = false, o.host_layers = 0;
  const ActivationLayout plain = plan_activations(d, o);
  for (const BufferSpec& b : plain.device) CHECK(b.within == -1);
  // Q = H (16 heads of 128): x_mid alone fits in dattn.
  ModelDims narrow = d;
  narrow.heads = 16;
  o.recompute = true;
  const ActivationLayout one = plan_activations(narrow, o);
  CHECK(one.device[size_t(one.sets[0].x_mid)].within == one.shared.dattn);
  CHECK(one.device[size_t(one.sets[0].ln2)].within == -1);
}
