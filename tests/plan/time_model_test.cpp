// The time model's arithmetic on a synthetic machine whose rates are flat (one FLOP rate, one
// bandwidth, no launch or sync cost): each category equals the FLOPs or bytes of the step, counted
// here from the model's shapes independently of the model code, over those rates; and the overlap
// rules (expert exchange in chunks, gradient sums behind backward, host update behind the next
// forward) hide what they should.
#include <cmath>

#include "catch.h"
#include "test_util.h"
#include "config/config.h"
#include "plan/plan.h"

using namespace mop;

namespace {

constexpr double kFlops = 1e12;  // every GEMM and attention call
constexpr double kBw = 1e11;     // every memory-bound op
constexpr double kRel = 1e-9;    // the model sums in another order

RateTable flat(double v) { return RateTable{{{1, v}}}; }

Machine synthetic() {
  Machine m = builtin_machine("h200");
  m.name = "synthetic";
  DeviceSpec& d = m.device;
  d.memory_bytes = 1e12;
  for (RateTable* t : {&d.gemm_fwd, &d.gemm_dgrad, &d.gemm_wgrad, &d.grouped_fwd, &d.grouped_dgrad,
                       &d.grouped_wgrad, &d.attention_fwd, &d.attention_bwd, &d.attention_block_fwd,
                       &d.attention_block_bwd})
    *t = flat(kFlops);
  d.lm_head_fwd = d.lm_head_bwd = flat(kFlops);
  d.grouped_experts = RateTable{};  // the grouped rates whatever the local experts
  d.copy_bw = d.norm_bw = d.rope_bw = d.swiglu_bw = d.permute_bw = d.router_bw = d.embedding_bw = kBw;
  d.adamw_bw = d.reduce_bw = kBw;
  d.launch_seconds = d.sync_seconds = 0;
  d.workspace_bytes = d.workspace_bytes_per_token = d.comm_buffer_bytes = 0;
  m.link.node_latency = m.link.net_latency = 0;
  m.link.overlap_slowdown = 1;
  m.host.memory_bytes = 1e13;
  return m;
}

Config config(const std::string& extra = "") {
  return load_config_text(test::merge_yaml(R"(
model: {vocab_size: 1000, hidden_size: 64, num_layers: 3, num_heads: 4, num_kv_heads: 2, head_dim: 16, qk_norm: true}
moe: {num_experts: 8, top_k: 2, expert_ffn: 32, first_dense_layers: 1, dense_ffn: 48}
data: {seq_len: 128}
train: {global_batch_size: 4, micro_batch_size: 2, device: cuda}
)", extra));
}

double seconds(const Plan& p, OpCategory c) { return p.time.seconds[size_t(c)]; }

}  // namespace

TEST_CASE("time model: compute categories are FLOPs and bytes over the machine's rates", "[cpu][plan]") {
  // Plain; recompute with every attention output kept (the plan's choice here); recompute with none.
  for (int variant : {0, 1, 2}) {
    const bool recompute = variant > 0, attn_again = variant == 2;
    INFO("recompute " << recompute << ", attention recomputed " << attn_again);
    const Config cfg = config(std::string("\ntrain: {global_batch_size: 4, micro_batch_size: 2, device: cuda, recompute: ") +
                              (recompute ? "true" : "false") + (attn_again ? ", keep_attention: 0" : "") + "}");
    const Plan p = make_plan(cfg, synthetic(), 1);
    REQUIRE(p.activation_options.keep_attention == (variant == 1 ? 3 : 0));
    const double m = p.micro_batches, T = 2 * 128, H = 64, Q = 64, KV = 32, E = 8, K = 2, F = 32, Fd = 48;
    const double V = 1000, L = 3, moe = 2, dense = 1, S = 128, B = 2, c = 2;
    REQUIRE(m == 2);
    // Dense GEMMs: q, k, v, o per layer, the router per MoE layer, the dense FFN: forward once,
    // backward twice (data and weight gradient), and once more forward when recomputing — then
    // the q/k projections once more for their norms' backward.
    const double fwd_dense = 2 * T * H * (Q + 2 * KV + Q) * L + 2 * T * E * H * moe + 2 * T * H * 3 * Fd * dense;
    const double qk_again = recompute ? 2 * T * H * (Q + KV) * L : 0;
    CHECK(seconds(p, OpCategory::DenseGemm) ==
          Approx(m * (fwd_dense * (3 + recompute) + qk_again) / kFlops).epsilon(kRel));
    // Experts: T·K rows through gate/up and down (3 GEMMs each way), SwiGLU 3F + 5F elements per
    // row; the dense FFN's SwiGLU counts here too (as TimedOps files it).
    const double rows = T * K;
    const double expert_flops = 2 * rows * H * 3 * F * moe * (3 + recompute);
    const double swiglu = (rows * F * moe + T * Fd * dense) * c * (3 * (1 + recompute) + 5);
    CHECK(seconds(p, OpCategory::Experts) == Approx(m * (expert_flops / kFlops + swiglu / kBw)).epsilon(kRel));
    // Attention: causal FLOPs 2·B·S²·heads·D forward, 2.5× backward, once more forward where a
    // recomputing layer does not keep its output; RoPE reads and writes q and k.
    const double attn = 2 * B * S * S * Q * L;
    const double rope = 2 * T * (Q + KV) * c * L * (2 + recompute);
    CHECK(seconds(p, OpCategory::Attention) ==
          Approx(m * ((attn * (1 + attn_again + 2.5)) / kFlops + rope / kBw)).epsilon(kRel));
    // LM head + loss: three passes over the vocabulary, all in the forward (logits, dx, dW).
    CHECK(seconds(p, OpCategory::Loss) == Approx(m * 6 * T * V * H / kFlops).epsilon(kRel));
    // Nothing to communicate on one rank; the step is the sum of the categories.
    CHECK(seconds(p, OpCategory::Communication) == 0);
    double sum = 0;
    for (double s : p.time.seconds) sum += s;
    CHECK(p.time.step == Approx(sum).epsilon(kRel));
    // Throughput and MFU follow from the step time.
    CHECK(p.time.tokens_per_second(p) == Approx(4 * 128 / p.time.step));
    CHECK(p.time.mfu(p) == Approx(model_flops_per_token(cfg) * 4 * 128 / p.time.step / 989e12));
  }
}

TEST_CASE("time model: micro-batches repeat the step's compute, the optimizer runs once", "[cpu][plan]") {
  const Plan one = make_plan(config("\ntrain: {global_batch_size: 2, micro_batch_size: 2, device: cuda}"), synthetic(), 1);
  const Plan three = make_plan(config("\ntrain: {global_batch_size: 6, micro_batch_size: 2, device: cuda}"), synthetic(), 1);
  for (OpCategory c : {OpCategory::DenseGemm, OpCategory::Experts, OpCategory::Attention, OpCategory::Loss,
                       OpCategory::RouterPermute})
    CHECK(seconds(three, c) == Approx(3 * seconds(one, c)).epsilon(kRel));
  CHECK(seconds(three, OpCategory::Optimizer) == Approx(seconds(one, OpCategory::Optimizer)).epsilon(kRel));
  // AdamW reads and writes master, m, v, reads the fp32 gradient and writes bf16 weights
  // (30 bytes per parameter), the norm reads every gradient once more (4).
  const ModelLayout layout = ModelLayout::build(ModelDims::from(one.cfg));
  const double params = double(layout.num_params());
  CHECK(seconds(one, OpCategory::Optimizer) == Approx(params * 34 / kBw).epsilon(1e-6));
}

TEST_CASE("time model: the expert exchange hides behind the experts in chunks", "[cpu][plan]") {
  Machine m = synthetic();
  m.link.node_all_to_all = 1e9;  // slow enough that the exchange outlasts the experts
  auto plan = [&](int chunks, double slowdown) {
    Machine mm = m;
    mm.link.overlap_slowdown = slowdown;
    return make_plan(config("\nparallel: {attention: {cp: 1, dp: 2}, moe: {ep: 2, dp: 1, chunks: " +
                            std::to_string(chunks) + "}}\ntrain: {global_batch_size: 4, micro_batch_size: 2, device: cuda}"),
                     mm, 2);
  };
  const Plan one = plan(1, 1), two = plan(2, 1), slow = plan(2, 1.5);
  // Per MoE layer and micro-batch: dispatch and combine of T·K rows of H bf16 each way, forward
  // and backward; half of each exchange's bytes stay on the rank (ep 2).
  const double T = 2 * 128, K = 2, H = 64, moe = 2, m_b = one.micro_batches;
  const double exchange = 2 * (T * K * H * 2) * 0.5 / 1e9;  // one direction pair, seconds
  const ComponentTime& experts1 = one.time.of(StepComponent::Experts);
  CHECK(experts1.comm_total == Approx(m_b * moe * 2 * exchange).epsilon(kRel));
  CHECK(experts1.comm_exposed == Approx(experts1.comm_total).epsilon(kRel));  // one chunk: nothing hides
  const ComponentTime& experts2 = two.time.of(StepComponent::Experts);
  CHECK(experts2.comm_total == Approx(experts1.comm_total).epsilon(kRel));
  CHECK(experts2.comm_exposed < experts1.comm_exposed);
  CHECK(experts2.comm_exposed >= experts2.comm_total / 2);  // the first dispatch, the last combine
  // Overlapped collectives slow the experts they share the device with.
  CHECK(seconds(slow, OpCategory::Experts) > seconds(two, OpCategory::Experts));
}

TEST_CASE("time model: the experts' rates scale by the local experts a call holds", "[cpu][plan]") {
  // 8 experts at ep 2: 4 per rank. A by-experts factor of 2 at 4 (interpolated in log size
  // between [2, 4] and [8, 1]) halves the grouped GEMMs' time; SwiGLU (memory-bound) keeps its.
  const Config cfg = config(
      "\nparallel: {attention: {cp: 1, dp: 2}, moe: {ep: 2, dp: 1}}\ntrain: {global_batch_size: 4, "
      "micro_batch_size: 2, device: cuda}");
  Machine m = synthetic();
  const Plan plain = make_plan(cfg, m, 2);
  m.device.grouped_experts = RateTable{{{2, 4}, {4, 2}, {8, 1}}};
  const Plan faster = make_plan(cfg, m, 2);
  const double T = 2 * 128, K = 2, H = 64, F = 32, Fd = 48, moe = 2, c = 2,
               mb = plain.micro_batches;
  const double gemm = mb * 2 * T * K * H * 3 * F * moe * 3 / kFlops;
  const double swiglu = mb * (T * K * F * moe + T * Fd) * c * 8 / kBw;
  CHECK(seconds(plain, OpCategory::Experts) == Approx(gemm + swiglu).epsilon(kRel));
  CHECK(seconds(faster, OpCategory::Experts) == Approx(gemm / 2 + swiglu).epsilon(kRel));
  // Written to a machine file and read back, the table is the same; a machine without it keeps 1.
  const Machine back = parse_machine(machine_yaml(m), "m.yaml");
  CHECK(back.device.grouped_experts.points == m.device.grouped_experts.points);
  CHECK(machine_yaml(synthetic()).find("grouped_by_experts") == std::string::npos);
}

TEST_CASE("time model: gradient sums hide behind the backward of the earlier segments", "[cpu][plan]") {
  Machine m = synthetic();
  m.link.node_all_reduce = 1e10;
  const std::string dp = "\nparallel: {attention: {cp: 1, dp: 2}, moe: {ep: 1, dp: 2}, zero: false, overlap_grad_reduce: ";
  const Plan overlapped = make_plan(config(dp + "true}"), m, 2);
  const Plan in_turn = make_plan(config(dp + "false}"), m, 2);
  const ComponentTime& a = overlapped.time.of(StepComponent::GradSums);
  const ComponentTime& b = in_turn.time.of(StepComponent::GradSums);
  // Every gradient (fp32) is all-reduced once: 2·(n−1)/n of its bytes over the bus.
  const double bytes = 4.0 * double(ModelLayout::build(ModelDims::from(overlapped.cfg)).num_params());
  CHECK(a.comm_total == Approx(bytes / 1e10).epsilon(1e-6));
  CHECK(b.comm_exposed == Approx(b.comm_total).epsilon(kRel));
  CHECK(a.comm_exposed < a.comm_total);
  CHECK(a.comm_exposed > 0);  // the embedding's sum comes last, after the whole backward
}

TEST_CASE("time model: the host update waits for the next forward only where it is late", "[cpu][plan]") {
  Machine m = synthetic();
  // The host engine 10⁵ times slower than this machine's compute.
  m.host.adamw_one_pass = 1e7, m.host.adamw_weights_pass = 2e7, m.host.adamw_state_pass = 1e7;
  m.host.adamw_under_copies = 1;
  m.link.d2h = m.link.h2d = 1e20;  // copies take no time
  const Config base = config("\noptim: {state_placement: host, overlap: true}");
  const Plan p = make_plan(base, m, 1);
  const double params = double(ModelLayout::build(ModelDims::from(base)).num_params());
  REQUIRE(p.host_params == int64_t(params));
  // Compute is fast next to the host here: the whole update is waited for, in whichever mode costs
  // less — two passes would also wait for the state pass at the next gradient copy.
  CHECK(p.time.host_update == Approx(params / 1e7).epsilon(kRel));
  CHECK_FALSE(p.time.host_two_pass);
  CHECK(p.time.host_exposed <= params / 1e7);
  CHECK(p.time.host_exposed > 0.9 * params / 1e7);
  CHECK(p.time.step == Approx(p.time.host_exposed + p.time.compute()).epsilon(kRel));
  // Not overlapped: the update is waited for in full.
  const Plan plain = make_plan(config("\noptim: {state_placement: host, overlap: false}"), m, 1);
  CHECK(plain.time.host_exposed == Approx(params / 1e7).epsilon(kRel));
  // A slow machine (compute 10⁶ times slower) hides the weights pass in the next forward but for
  // the embedding's and the first layer's (whose forward is the next to run), and the state pass
  // before the next gradient copy: two passes, most of the update hidden.
  Machine slow = m;
  for (RateTable* t : {&slow.device.gemm_fwd, &slow.device.gemm_dgrad, &slow.device.gemm_wgrad,
                       &slow.device.grouped_fwd, &slow.device.grouped_dgrad, &slow.device.grouped_wgrad,
                       &slow.device.attention_fwd, &slow.device.attention_bwd})
    *t = flat(kFlops / 1e6);
  const Plan hidden = make_plan(config("\ntrain: {global_batch_size: 8, micro_batch_size: 2, device: cuda}\n"
                                       "optim: {state_placement: host}"), slow, 1);
  CHECK(hidden.time.host_two_pass);
  CHECK(hidden.time.host_exposed < 0.5 * hidden.time.host_update);
  CHECK(hidden.time.host_exposed > 0);
}

TEST_CASE("time model: a kept attention tail leaves the recompute of the tiles before it", "[cpu][plan]") {
  // One sequence of 128 tokens in 4 query tiles of 32, every layer recomputing its attention but
  // for a tail of t tiles: the recompute is causal attention over the first 128 − 32·t tokens (in
  // tiles: its FLOPs over the flat rate plus the merges' bytes), the rest of the step unchanged.
  const double c = 32, Q = 64, L = 3, cb = 2;
  auto attention = [&](int tail) {
    const Config cfg = config("\ntrain: {global_batch_size: 1, micro_batch_size: 1, device: cuda, recompute: true, "
                              "keep_attention: 0, attention_tile: 32, keep_attention_tail: " +
                              std::to_string(tail) + "}");
    const Plan p = make_plan(cfg, synthetic(), 1);
    REQUIRE(p.activation_options.keep_attention_tail == tail);
    return seconds(p, OpCategory::Attention);
  };
  // Forward attention over h tiles of one sequence: 2·(h·c)²·Q FLOPs; merges (acc and lse read
  // and written, the block's output read) for every block but each tile's first, and each
  // tile's copy out of its fp32 accumulator, but the first tile's (one causal call).
  auto forward = [&](double h) {
    const double blocks = h * (h + 1) / 2;
    const double bytes = (blocks - 1) * c * Q * (2 * 4 + cb) + (h - 1) * c * Q * (4 + cb);
    return 2 * (h * c) * (h * c) * Q / kFlops + bytes / kBw;
  };
  const double none = attention(0);
  for (int tail : {1, 2, 3}) {
    INFO("tail " << tail);
    CHECK(none - attention(tail) == Approx(L * (forward(4) - forward(4 - tail))).epsilon(1e-6));
  }
}
