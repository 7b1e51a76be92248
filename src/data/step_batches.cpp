// StepBatches (see step_batches.h).
#include "data/step_batches.h"

#include <utility>

#include "core/error.h"

namespace mop {

StepBatches::StepBatches(const TokenLoader& loader, const BatchGeometry& geometry, Slice slice)
    : loader_(loader), geometry_(geometry), slice_(std::move(slice)) {
  const BatchGeometry& g = geometry_;
  MOP_CHECK(g.micro_batch_size > 0 && g.local_seq > 0 && g.micro_batches > 0, "batch geometry: b ",
            g.micro_batch_size, ", local sequence ", g.local_seq, ", micro-batches ",
            g.micro_batches);
  MOP_CHECK(g.dp_rank >= 0 && g.dp_rank < g.dp_size, "dp rank ", g.dp_rank, " of ", g.dp_size);
  MOP_CHECK(slice_ || g.local_seq == loader.seq_len(), "local sequence ", g.local_seq,
            " without a slice: needs the loader's ", loader.seq_len());
  const size_t tokens = size_t(g.micro_batches) * size_t(g.micro_batch_tokens());
  ids_.assign(tokens, 0), targets_.assign(tokens, 0), positions_.assign(tokens, 0);
}

StepBatches::HostMicroBatch StepBatches::micro_batch(int m) {
  MOP_CHECK(m >= 0 && m < geometry_.micro_batches, "micro-batch ", m, " of ",
            geometry_.micro_batches);
  const size_t off = size_t(m) * size_t(geometry_.micro_batch_tokens());
  return {ids_.data() + off, targets_.data() + off, positions_.data() + off};
}

int64_t StepBatches::fill_micro_batch(int m, int64_t first, bool valid_split) {
  const int b = geometry_.micro_batch_size;
  const Read read = [&](int32_t* i, int32_t* t, int32_t* p) {
    return valid_split ? loader_.fill_valid(first, b, i, t, p) : loader_.fill(first, b, i, t, p);
  };
  const HostMicroBatch out = micro_batch(m);
  return slice_ ? slice_(read, out.ids, out.targets, out.positions)
                : read(out.ids, out.targets, out.positions);
}

int64_t StepBatches::fill_step(int64_t consumed) {
  int64_t valid = 0;
  for (int m = 0; m < geometry_.micro_batches; ++m)
    valid += fill_micro_batch(m, geometry_.first_sample(consumed, m), /*valid_split=*/false);
  return valid;
}

int64_t StepBatches::fill_eval(int64_t batch_idx) {
  return fill_micro_batch(0, geometry_.first_valid_sample(batch_idx), /*valid_split=*/true);
}

}  // namespace mop
