// The plan's model of issue 27's techniques: sliced parameters (ZeRO-3) and streamed gradients
// priced by hand from the layout on tiny's dimensions, the bounded exchange's rows and rounds,
// invalid combinations refused, and the search opening the new keys — its best plan for the
// trillion-parameter model on 96 H200s fits.
#include <algorithm>
#include <string>

#include "catch.h"
#include "test_util.h"
#include "config/config.h"
#include "core/error.h"
#include "model/params.h"
#include "plan/machine.h"
#include "plan/plan.h"
#include "plan/search.h"

using namespace mop;

namespace {

// tiny's model on GPUs (bf16 weights, fp32 gradients), one micro-batch per rank.
Config tiny(const std::string& extra) {
  return load_config_text(test::merge_yaml(R"(
model: {vocab_size: 257, hidden_size: 128, num_layers: 4, num_heads: 4, num_kv_heads: 2, qk_norm: true}
moe: {num_experts: 8, top_k: 2, expert_ffn: 256}
data: {seq_len: 256}
train: {global_batch_size: 16, micro_batch_size: 4, device: cuda}
)", extra));
}

// The elements parameter q's whole copy takes in a slot: its `replicas` slices (one: aligned).
int64_t slot_numel(const ModelLayout& layout, int q, int replicas) {
  const int64_t n = layout.params[q].numel();
  return replicas == 1 ? aligned_numel(n) : replicas * slice_numel(n, replicas);
}

// Per segment, the slot elements of a rank's parameters, and the two largest of them.
int64_t two_largest_segments(const ModelLayout& layout, int segments, int dense_replicas,
                             int expert_replicas) {
  std::vector<int64_t> seg(size_t(segments), 0);
  for (int q = 0; q < int(layout.params.size()); ++q)
    seg[size_t(param_segment(layout, q))] += slot_numel(
        layout, q, layout.params[q].kind == ParamKind::Experts ? expert_replicas : dense_replicas);
  std::sort(seg.rbegin(), seg.rend());
  return seg[0] + seg[1];
}

bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

}  // namespace

TEST_CASE("plan: a sliced plan's memory is the replicated one's less what slicing saves", "[cpu][plan]") {
  // 4 ranks: dense parameters sliced over cp × dp = 4, experts (ep 2) over their dp 2.
  const std::string fold =
      "\nparallel: {attention: {cp: 1, dp: 4}, moe: {ep: 2, dp: 2}, zero: false}\noptim: {state_placement: gpu}";
  const Machine m = builtin_machine("h200");
  const Plan whole = make_plan(tiny(fold + "\nparallel: {shard: owner}"), m, 4);
  const Plan sliced = make_plan(tiny(fold + "\nparallel: {shard: slice}"), m, 4);
  REQUIRE(sliced.micro_batches == 1);
  REQUIRE(sliced.parallel.sliced());
  const ModelLayout layout = ModelLayout::build(ModelDims::from(sliced.cfg, 0, 2));
  // Slices start at multiples of kParamAlign (model/params.h): ceil(n / replicas) rounded up.
  int64_t all = 0, slices = 0, slots = 0;
  for (int q = 0; q < int(layout.params.size()); ++q) {
    const int64_t n = layout.params[q].numel();
    const int replicas = layout.params[q].kind == ParamKind::Experts ? 2 : 4;
    all += aligned_numel(n);
    slices += aligned_numel((n + replicas - 1) / replicas);
    slots += slot_numel(layout, q, replicas);
  }
  const int64_t in_flight = two_largest_segments(layout, num_segments(sliced.dims), 4, 2);
  REQUIRE(slices < all / 2);
  // Weights: bf16 slices and two gathered segments; gradients: two segments whole in flight and
  // the fp32 slice the reduce-scatter leaves; state: fp32 master, m, v of the slice.
  CHECK(whole.memory.weights == size_t(all) * 2);
  CHECK(whole.memory.grads == size_t(all) * 4);
  CHECK(sliced.memory.weights == whole.memory.weights - size_t(all - slices) * 2 + size_t(in_flight) * 2);
  CHECK(sliced.memory.grads == whole.memory.grads - size_t(all - slices) * 4 + size_t(in_flight) * 4);
  CHECK(sliced.memory.optimizer_state == whole.memory.optimizer_state - size_t(all - slices) * 12);
  CHECK(sliced.memory.activations == whole.memory.activations);
  CHECK(sliced.memory.workspaces == whole.memory.workspaces);
  // The report's "without" is the replicated plan.
  CHECK(sliced.memory_without(Plan::Technique::Slice).device_total() == whole.memory.device_total());
  // Several micro-batches: the fp32 gradients stay whole (summed unsharded, reduce-scattered once).
  const Plan two = make_plan(tiny(fold + "\nparallel: {shard: slice}\ntrain: {micro_batch_size: 2}"), m, 4);
  REQUIRE(two.micro_batches == 2);
  CHECK(two.memory.grads == size_t(slots + slices) * 4);
  // The step gathers weights and reduce-scatters gradients: both priced.
  CHECK(sliced.time.of(StepComponent::Gathers).comm_total > 0);
  CHECK(whole.time.of(StepComponent::Gathers).comm_total == 0);
}

TEST_CASE("plan: streamed gradients keep two segments' on the GPU", "[cpu][plan]") {
  const Machine m = builtin_machine("h200");
  const std::string host = "\noptim: {state_placement: host, gradients: ";
  const Plan kept = make_plan(tiny(host + "gpu}"), m, 1);
  const Plan streamed = make_plan(tiny(host + "host}"), m, 1);
  REQUIRE(!kept.stream_grads);
  REQUIRE(streamed.stream_grads);
  const ModelLayout layout = ModelLayout::build(ModelDims::from(streamed.cfg));
  int64_t all = 0;
  for (const ParamDef& q : layout.params) all += aligned_numel(q.numel());
  CHECK(kept.memory.grads == size_t(all) * 4);
  CHECK(kept.memory.host_grad_staging == size_t(all) * 2);  // bf16 copies on the device
  // Two slots of the largest segment (tiny's two largest are equal: its layers), fp32; the bf16
  // conversions for the host likewise.
  const int64_t in_flight = two_largest_segments(layout, num_segments(streamed.dims), 1, 1);
  CHECK(streamed.memory.grads == size_t(in_flight) * 4);
  CHECK(streamed.memory.host_grad_staging == size_t(in_flight) * 2);
  // The host receives bf16 gradients and sends bf16 weights back (as kept); with several
  // micro-batches every fp32 running sum waits there between them.
  REQUIRE(streamed.micro_batches == 4);
  CHECK(kept.memory.host_staging == size_t(all) * 4);
  CHECK(streamed.memory.host_staging == size_t(all) * 4 + size_t(all) * 4);
  CHECK(streamed.memory.host_optimizer_state == kept.memory.host_optimizer_state);
  CHECK(streamed.memory_without(Plan::Technique::StreamGrads).device_total() == kept.memory.device_total());
  // The running sums go to the host and come back in every micro-batch but the last: more PCIe
  // traffic, priced.
  CHECK(streamed.time.grad_to_host > kept.time.grad_to_host);
  // One micro-batch: nothing waits on the host between micro-batches.
  const Plan one = make_plan(tiny(host + "host}\ntrain: {global_batch_size: 2, micro_batch_size: 2}"), m, 1);
  REQUIRE(one.micro_batches == 1);
  CHECK(one.memory.host_staging == size_t(all) * 4);
  // auto takes streaming where it is not slower or only it fits.
  const Plan chosen = make_plan(tiny(host + "auto}"), m, 1);
  CHECK(chosen.stream_grads == (streamed.time.step <= kept.time.step));
}

TEST_CASE("plan: invalid technique settings are refused with what to change", "[cpu][plan]") {
  const Machine m = builtin_machine("h200");
  try {
    make_plan(tiny("\noptim: {state_placement: gpu, gradients: host}"), m, 1);
    FAIL("gradients: host with every state on the GPU was accepted");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()).find("optim.gradients: auto or gpu") != std::string::npos);
  }
  // The CPU backend streams only when asked (its gradients are in host memory already; the tests
  // run the schedule so).
  CHECK(make_plan(tiny("\ntrain: {device: cpu}\noptim: {state_placement: host, gradients: host}"), builtin_machine("cpu"), 1)
            .stream_grads);
  CHECK(!make_plan(tiny("\ntrain: {device: cpu}\noptim: {state_placement: host, gradients: auto}"), builtin_machine("cpu"), 1)
             .stream_grads);
  // One replica: every parameter is a single slice used in place (nothing gathered): the memory
  // of the replicated plan.
  const Plan one = make_plan(tiny("\nparallel: {shard: slice}"), m, 1);
  const Plan rep = make_plan(tiny(""), m, 1);
  CHECK(one.parallel.sliced());
  CHECK(one.memory.weights == rep.memory.weights);
  CHECK(one.memory.grads == rep.memory.grads);
}

TEST_CASE("plan: the bounded exchange's rows and rounds", "[cpu][plan]") {
  // B = max(1, ceil(budget · T · k)), at most ep · T · k; 0 is the worst case.
  CHECK(bounded_receive_rows(0, 1000, 8, 4) == 32000);
  CHECK(bounded_receive_rows(2, 1000, 8, 4) == 16000);
  CHECK(bounded_receive_rows(1e-9, 1000, 8, 4) == 1);
  CHECK(bounded_receive_rows(10, 1000, 8, 4) == 32000);
  // The busiest rank is allowed 25% over T · k: a budget of 1.25 or more takes one round.
  CHECK(exchange_rounds(bounded_receive_rows(1.25, 1000, 8, 4), 1000, 8, 4) == 1);
  CHECK(exchange_rounds(bounded_receive_rows(1, 1000, 8, 4), 1000, 8, 4) == 2);
  CHECK(exchange_rounds(bounded_receive_rows(0.5, 1000, 8, 4), 1000, 8, 4) == 3);
  const Machine m = builtin_machine("h200");
  const std::string fold = "\nparallel: {attention: {cp: 1, dp: 4}, moe: {ep: 4, dp: 1}}";
  const Plan worst = make_plan(tiny(fold), m, 4);
  const Plan bounded = make_plan(tiny(fold + "\nparallel: {moe: {exchange_budget: 1}}"), m, 4);
  CHECK(bounded.exchange_rounds == 2);
  CHECK(bounded.memory.activations < worst.memory.activations);
  // Two rounds: the backward recomputes the experts' gate/up once more.
  CHECK(bounded.time.of(StepComponent::Experts).backward > worst.time.of(StepComponent::Experts).backward);
}

TEST_CASE("plan search: opens the techniques' keys; moe-1t fits on 96 H200s", "[cpu][plan]") {
  const std::string src = MOP_SOURCE_DIR;
  const Config cfg = load_config(src + "/configs/moe-1t.yaml");
  const Machine m = load_machine(src + "/configs/machines/h200-12-nodes.yaml");
  const SearchResult r = search_plans(cfg, m, 96);
  CHECK(has(r.open_keys, "parallel.shard"));
  CHECK(has(r.open_keys, "optim.gradients"));
  CHECK(has(r.open_keys, "parallel.moe.exchange_budget"));
  REQUIRE(!r.feasible.empty());
  const Plan& best = r.feasible.front().plan;
  CHECK(plan_overflow(best).empty());
  CHECK(double(best.memory.device_total()) <= m.device.memory_bytes - m.device.reserve_bytes);
  CHECK(double(best.memory.host_total()) * m.gpus_per_node <= m.host.memory_bytes * m.host.pinned_fraction);
  // Nothing fits without slicing or streaming: the techniques are what makes it fit.
  for (const Candidate& c : r.feasible) CHECK((c.plan.parallel.sliced() || c.plan.stream_grads));
}
