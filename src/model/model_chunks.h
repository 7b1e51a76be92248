// A pipeline rank's model chunks: one Transformer per chunk it runs (interleaved stages run
// several, rank r's chunk c being virtual stage c · pp + r; otherwise one), each over its own
// segments with its own banks of activations, all on the same parameter store. What the step and
// the trainer read of the rank's model is the chunks' together.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "model/transformer.h"

namespace mop {

class ModelChunks {
 public:
  void add(std::unique_ptr<Transformer> chunk);
  int size() const { return int(chunks_.size()); }
  Transformer& at(int c) const;
  // The chunk whose segments hold segment s.
  int chunk_of(int segment) const;
  Transformer& of_segment(int segment) const { return at(chunk_of(segment)); }

  // Whether a pass that writes the experts' gradients writes parameter p's (the same for every
  // chunk: a routed expert tensor).
  bool writes_gradient(int p) const { return at(0).writes_gradient(p); }
  // The chunks' loss sums since the last call, added in chunk order.
  LossTerms take_losses();
  // Routed rows per [MoE layer][expert] and the tokens routed: each chunk counts its own layers.
  std::vector<int64_t> routed_counts() const;
  int64_t routed_tokens() const;
  // The activations the chunks planned, together.
  size_t planned_bytes() const;
  std::array<size_t, kNumComponents> device_by_component() const;
  size_t host_bytes() const;

 private:
  std::vector<std::unique_ptr<Transformer>> chunks_;
};

}  // namespace mop
