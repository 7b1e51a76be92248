// Saved-tensor placement (plan/placement.h) on the measured one-H200 machine: the choice the
// search makes fits the final plan (its fit check prices the optimizer state it moves as the plan
// then counts it), and with attention in query tiles the layers that recompute their attention
// keep its last tiles where that saves recompute; the report prices what streaming costs.
#include <string>
#include <vector>

#include "catch.h"
#include "config/config.h"
#include "plan/machine.h"
#include "plan/plan.h"
#include "plan/report.h"
#include "runtime/memory.h"

using namespace mop;

namespace {

Config q3moe(int64_t seq, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = {"data.seq_len=" + std::to_string(seq), "train.global_batch_size=1",
                                   "train.recompute=true", "train.lm_head_chunk=1024", "train.device=cuda"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return load_config(std::string(MOP_SOURCE_DIR) + "/configs/q3moe-8l.yaml", sets);
}

Machine h200() { return load_machine(std::string(MOP_SOURCE_DIR) + "/configs/machines/h200-1gpu.yaml"); }

}  // namespace

TEST_CASE("placement: the saved tensors the search places fit the final plan", "[cpu][plan]") {
  // Streamed gradients at 1M tokens once overflowed the host by 5 GiB: the search counted a
  // moved segment's host saving with 2 bytes per element the host never held.
  for (int64_t seq : {262144, 524288, 1048576})
    for (const char* grads : {"auto", "host"})
      for (const char* tail : {"-1", "0"}) {
        INFO(seq << " tokens, optim.gradients " << grads << ", keep_attention_tail " << tail);
        const Plan p = make_plan(q3moe(seq, {std::string("optim.gradients=") + grads,
                                             std::string("train.keep_attention_tail=") + tail}),
                                 h200(), 1, /*check_fit=*/false);
        CHECK(plan_overflow(p).empty());
      }
}

TEST_CASE("placement: layers that recompute their attention keep its last tiles where that pays",
          "[cpu][plan]") {
  const Plan tails = make_plan(q3moe(1048576), h200(), 1);
  const Plan none = make_plan(q3moe(1048576, {"train.keep_attention_tail=0"}), h200(), 1);
  const ActivationOptions& a = tails.activation_options;
  REQUIRE(a.attention_tile > 0);
  const int n = int(1048576 / a.attention_tile);
  CHECK(a.keep_attention < 8);
  CHECK(a.keep_attention_tail > 0);
  CHECK(a.keep_attention_tail < n);
  CHECK(tails.activations.tail_rows == a.keep_attention_tail * a.attention_tile);
  CHECK(none.activation_options.keep_attention_tail == 0);
  // Less attention recomputed, so a shorter step.
  const auto recompute = [](const Plan& p) {
    return p.time.components[size_t(StepComponent::Attention)].recompute;
  };
  CHECK(recompute(tails) < recompute(none));
  CHECK(tails.time.step < none.time.step);
  // A pinned tail is taken as given; one that leaves nothing to recompute, or needs tiles the
  // plan does not run, is refused by name.
  CHECK(make_plan(q3moe(1048576, {"train.keep_attention_tail=3"}), h200(), 1).activation_options
            .keep_attention_tail == 3);
  CHECK_THROWS_WITH(make_plan(q3moe(1048576, {"train.keep_attention_tail=" + std::to_string(n)}), h200(), 1),
                    Catch::Contains("train.keep_attention_tail"));
  CHECK_THROWS_WITH(make_plan(q3moe(1048576, {"train.keep_attention_tail=2", "train.attention_tile=0"}),
                              h200(), 1),
                    Catch::Contains("train.keep_attention_tail"));
}

TEST_CASE("placement: the report says what streaming the gradients costs where it saves nothing",
          "[cpu][plan]") {
  // At 256K only two segments' optimizer state is on the host, as many as streaming keeps in
  // flight, so streaming adds its staging: the report once printed "saves -1871721984 B".
  const Plan p = make_plan(q3moe(262144), h200(), 1);
  REQUIRE(p.stream_grads);
  const double without = double(p.memory_without(Plan::Technique::StreamGrads).device_total());
  REQUIRE(without < double(p.memory.device_total()));
  const std::string text = plan_text(p);
  CHECK(text.find("streaming the gradients costs " +
                  format_bytes(double(p.memory.device_total()) - without)) != std::string::npos);
  CHECK(text.find("saves -") == std::string::npos);
  CHECK(format_bytes(-1536.0) == "-1.50 KiB");
  CHECK(format_bytes(-3.0) == "-3 B");
}
