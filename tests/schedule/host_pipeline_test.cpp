// The host pipeline (schedule/host_pipeline.h) on recording hooks: the weights pass first, the
// next step's gradient copy gated on the state pass, one pass when not overlapped, and the choice
// between one and two passes.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "catch.h"
#include "schedule/host_pipeline.h"

using namespace mop;

namespace {

// A HostPipeline whose hooks only record: the state pass blocks until release().
class GatedPipeline final : public HostPipeline {
 public:
  explicit GatedPipeline(std::vector<HostParam> params) : HostPipeline(std::move(params), 1) { start(); }
  ~GatedPipeline() override {
    release();
    stop();
  }
  void release() {
    std::lock_guard<std::mutex> lock(gate_mu_);
    open_ = true;
    gate_.notify_all();
  }
  std::atomic<int> copies{0};
  std::vector<std::string> passes() {
    std::lock_guard<std::mutex> lock(gate_mu_);
    return passes_;
  }

 private:
  double copy_grad(size_t, const Tensor&) override {
    ++copies;
    return 0;
  }
  void update_param(size_t i, const AdamWArgs&, Pass pass) override {
    std::unique_lock<std::mutex> lock(gate_mu_);
    const char* names[] = {"both", "weights", "state"};
    passes_.push_back(std::string(names[int(pass)]) + " " + std::to_string(i));
    if (pass == Pass::State) gate_.wait(lock, [&] { return open_; });
  }
  std::mutex gate_mu_;
  std::condition_variable gate_;
  bool open_ = false;
  std::vector<std::string> passes_;
};

}  // namespace

TEST_CASE("host pipeline: weights pass first; the next gradient copy waits for the state pass",
          "[cpu][schedule]") {
  // Kept gradients (a tensor each; the recording hooks never read them).
  float grads[2][4] = {};
  std::vector<HostParam> hp(2);
  hp[0].segment = 0, hp[1].segment = 1;
  for (int i = 0; i < 2; ++i)
    hp[size_t(i)].param = i, hp[size_t(i)].grad = Tensor(grads[i], DType::F32, {4});
  GatedPipeline off(hp);
  const std::vector<AdamWArgs> args(2);
  off.grads_final(0);
  off.grads_final(1);
  CHECK(off.copies == 2);
  off.update(args, /*overlap=*/true);
  off.weights_ready(0);  // the weights passes finish while the state pass is held
  off.weights_ready(1);
  std::thread next_backward([&] { off.grads_final(1); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(off.copies == 2);  // param 1's gradient staging is still being read
  off.release();
  next_backward.join();
  CHECK(off.copies == 3);
  off.drain();
  CHECK(off.passes() ==
        std::vector<std::string>{"weights 0", "weights 1", "state 0", "state 1"});
  off.update(args, /*overlap=*/false);  // plain: one pass, done on return
  CHECK(off.passes().size() == 6);
  CHECK(off.passes()[4] == "both 0");
  CHECK(off.passes()[5] == "both 1");
  CHECK(off.copies == 4);  // update() copied param 0's gradient, not final before
}

TEST_CASE("host pipeline: one or two passes, whichever cost the step less, probing the other",
          "[cpu][schedule]") {
  const uint64_t probe = HostPipeline::kProbeEvery;
  CHECK(HostPipeline::choose_two_pass(1, -1, -1));        // first round: two passes
  CHECK_FALSE(HostPipeline::choose_two_pass(2, -1, 0.8));  // then measure one pass
  CHECK(HostPipeline::choose_two_pass(3, 1.2, 0.8));       // the cheaper
  CHECK_FALSE(HostPipeline::choose_two_pass(3, 0.7, 0.8));
  CHECK_FALSE(HostPipeline::choose_two_pass(probe, 1.2, 0.8));  // now and then the other one
  CHECK(HostPipeline::choose_two_pass(2 * probe, 0.7, 0.8));
  CHECK(HostPipeline::choose_two_pass(2 * probe + 1, 1.2, 0.8));
}
