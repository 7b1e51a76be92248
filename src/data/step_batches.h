// StepBatches: the samples a data-parallel rank reads for one optimizer step, staged in host
// memory. The step that starts at global sample c (the samples consumed so far) reads samples
// [c, c + micro_batches·dp·b); rank r's micro-batch m is samples c + (m·dp + r)·b … +b, so the
// ranks read the step's samples once each. Evaluation batch i reads validation samples
// (i·dp + r)·b … +b. What needs the layers above data — the count of unmasked targets summed over
// the ranks, the copy to the device, the context-parallel slice — is the caller's (the trainer's).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "data/loader.h"

namespace mop {

// One rank's share of a step.
struct BatchGeometry {
  int micro_batch_size = 1;  // b: sequences per micro-batch
  int local_seq = 0;         // tokens this rank keeps of each sequence (data.seq_len / cp)
  int micro_batches = 1;     // per rank and step
  int dp_size = 1;
  int dp_rank = 0;

  int64_t micro_batch_tokens() const { return int64_t(micro_batch_size) * local_seq; }
  // The first training sample of micro-batch m of the step that starts at `consumed`.
  int64_t first_sample(int64_t consumed, int m) const {
    return consumed + (int64_t(m) * dp_size + dp_rank) * micro_batch_size;
  }
  // The first validation sample of evaluation batch `batch_idx`.
  int64_t first_valid_sample(int64_t batch_idx) const {
    return (batch_idx * dp_size + dp_rank) * micro_batch_size;
  }
};

class StepBatches {
 public:
  // Writes b whole sequences of the loader ([b, seq_len] each; targets −1 where masked) and
  // returns their unmasked targets.
  using Read = std::function<int64_t(int32_t* ids, int32_t* targets, int32_t* positions)>;
  // Keeps this rank's local_seq tokens of every sequence `read` writes ([b, local_seq] each) and
  // returns the unmasked targets among them: a context-parallel rank's slice (the trainer passes
  // parallel/sequence_parallel.h's SequenceSlicer). Empty: the whole sequences are kept, and
  // local_seq must be the loader's seq_len.
  using Slice =
      std::function<int64_t(const Read& read, int32_t* ids, int32_t* targets, int32_t* positions)>;

  StepBatches(const TokenLoader& loader, const BatchGeometry& geometry, Slice slice = {});

  // Reads every micro-batch of the step that starts at sample `consumed`; returns this rank's
  // unmasked targets among them.
  int64_t fill_step(int64_t consumed);
  // Reads evaluation batch `batch_idx` into micro-batch 0's buffers; returns its unmasked targets.
  int64_t fill_eval(int64_t batch_idx);

  // Micro-batch m as last filled: ids, targets, positions, [b · local_seq] each.
  struct HostMicroBatch {
    int32_t* ids;
    int32_t* targets;
    int32_t* positions;
  };
  HostMicroBatch micro_batch(int m);
  const BatchGeometry& geometry() const { return geometry_; }

 private:
  // Samples [first, first + b) of the training or validation split into micro-batch m's buffers.
  int64_t fill_micro_batch(int m, int64_t first, bool valid_split);

  const TokenLoader& loader_;
  BatchGeometry geometry_;
  Slice slice_;
  std::vector<int32_t> ids_, targets_, positions_;  // [micro_batches, b · local_seq] each
};

}  // namespace mop
