// The time model: one optimizer step of a plan on its machine. Each segment's forward and backward
// for one micro-batch are priced op by op as the Transformer issues them — GEMM and attention FLOPs
// over the machine's measured rates (by GEMM size, rows per expert, sequence length), memory-bound
// ops' bytes over their measured bandwidths, the collectives inside a segment over the links' bus
// bandwidths with their overlap inside the segment:
//   - the compute stream runs every op in turn; its time is split into the log's categories
//     (TimedOps: attention, dense GEMMs, experts, router/permute, LM head+loss, optimizer,
//     communication, other);
//   - collectives on the compute stream (Ulysses' all-to-alls, cp router counts) are exposed;
//   - the expert exchange in c chunks hides behind the experts but for the first dispatch and the
//     last combine, and slows the experts it overlaps by link.overlap_slowdown; a bounded exchange
//     that takes r > 1 rounds recomputes the experts' gate/up and SwiGLU round by round;
//   - ring attention's K/V passes hide behind each ring step's blocks, but for the final hop;
//   - saved tensors go to the host and back beside the layers around them (a copy longer than its
//     window holds up the segment that ends it).
// The step itself is the plan's step program (plan/program.h) for the rank, walked action by
// action against its streams' clocks (plan/step_walk.h): the segments, the weight gathers, the
// gradient sums and reduce-scatters, the slots and copies of in-flight gradients, the optimizer,
// the device and host updates — each where the program runs it, so the schedule is said once.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "ops/timed_ops.h"

namespace mop {

struct Plan;

// The step's components, in StepTime::components' order.
enum class StepComponent : uint8_t {
  Embedding, Attention, Router, Experts, DenseFfn, LmHead, Optimizer, GradSums, Gathers
};
constexpr int kNumStepComponents = 9;

// A component's share of the step (compute-stream seconds by phase, and what overlaps it).
struct ComponentTime {
  std::string name;
  double forward = 0, backward = 0, recompute = 0;  // seconds per step (all micro-batches)
  double comm_total = 0, comm_exposed = 0;          // its collectives: all of them, and exposed
  double flops = 0;                                  // per step
};

struct StepTime {
  std::array<double, kNumOpCategories> seconds{};  // compute stream by category (as the log)
  std::vector<ComponentTime> components;  // indexed by StepComponent
  double host_update = 0;   // host AdamW until the new weights exist (s)
  double host_state = 0;    // two passes: the state pass after it
  double host_exposed = 0;  // what the step waits for the host update
  bool host_two_pass = false;
  double grad_to_host = 0, weights_to_device = 0;  // pinned copies per step (s, hidden or not)
  double comm_total = 0;    // every collective's time, hidden or not
  double offload_copies = 0, offload_exposed = 0;  // saved tensors to the host and back (s)
  double grad_drain_exposed = 0;  // in-flight gradient buffers: backward waiting for one (s)
  // Pipeline stages (the step priced is stage `stage`'s, the slowest): its compute stream waiting
  // for the neighbouring stages' messages and for the others at the losses (the bubble, in the
  // communication category), and its messages' time (hidden or not).
  int stage = 0;
  double pipeline_bubble = 0, pipeline_messages = 0;
  double step = 0;          // predicted step time (s)

  const ComponentTime& of(StepComponent c) const { return components[size_t(c)]; }
  double compute() const;   // the categories other than communication
  double tokens_per_second(const Plan& plan) const;
  double mfu(const Plan& plan) const;
};

// Pipeline stages: the slowest stage's step (rank < 0: priced at the memory rank's position in each
// stage), or the step of rank `rank`'s stage priced at that rank's position (its own split, its
// wait for the others in communication).
StepTime predict_step_time(const Plan& plan, int rank = -1);
// Seconds of one micro-batch's forward and backward through each segment (model/params.h) on a
// rank of the plan: what the pipeline's stages are balanced by.
std::vector<double> segment_seconds(const Plan& plan);

struct DeviceSpec;
// Compute-stream seconds of causal attention over `batch` sequences of `seq` tokens whose causal
// FLOPs are `flops` (forward 2·B·S²·Nq·D, backward 2.5× that), in query tiles of `tile` tokens
// (model/tiled_attention.h; 0 or ≥ seq: one call at the causal rate of the whole sequence): the
// diagonal blocks at the causal rate of a tile, the others at the non-causal block rate, one
// launch per call, and the merges (forward) or gradient sums (backward) of the blocks' outputs in
// the acc dtype (q_width: this call's Nq·D, kv_width: Nkv·D; c_bytes: the compute dtype's size).
double attention_seconds(const DeviceSpec& d, double flops, double batch, double seq, int64_t tile,
                         double q_width, double kv_width, double c_bytes, bool backward);

}  // namespace mop
