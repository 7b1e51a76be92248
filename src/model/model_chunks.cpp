// ModelChunks (see model_chunks.h).
#include "model/model_chunks.h"

namespace mop {

void ModelChunks::add(std::unique_ptr<Transformer> chunk) {
  MOP_CHECK(chunk, "a model chunk");
  MOP_CHECK(chunks_.empty() || chunks_.back()->end_segment() <= chunk->first_segment(),
            "model chunks in the order of their segments");
  chunks_.push_back(std::move(chunk));
}

Transformer& ModelChunks::at(int c) const {
  MOP_CHECK(c >= 0 && c < size(), "model chunk ", c, " of ", size());
  return *chunks_[size_t(c)];
}

int ModelChunks::chunk_of(int segment) const {
  for (int c = 0; c < size(); ++c)
    if (segment >= chunks_[size_t(c)]->first_segment() && segment < chunks_[size_t(c)]->end_segment()) return c;
  MOP_CHECK(false, "segment ", segment, " is in none of this rank's ", size(), " model chunks");
  return -1;
}

LossTerms ModelChunks::take_losses() {
  LossTerms sum;
  for (const auto& c : chunks_) {
    const LossTerms t = c->take_losses();
    sum.ce_sum += t.ce_sum, sum.aux += t.aux, sum.z += t.z;
  }
  return sum;
}

std::vector<int64_t> ModelChunks::routed_counts() const {
  std::vector<int64_t> sum = at(0).routed_counts();
  for (int c = 1; c < size(); ++c) {
    const std::vector<int64_t>& more = at(c).routed_counts();
    MOP_CHECK(more.size() == sum.size(), "model chunks count other experts");
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += more[i];
  }
  return sum;
}

int64_t ModelChunks::routed_tokens() const {
  int64_t n = 0;
  for (const auto& c : chunks_) n += c->routed_tokens();
  return n;
}

size_t ModelChunks::planned_bytes() const {
  size_t n = 0;
  for (const auto& c : chunks_) n += c->planned_bytes();
  return n;
}

std::array<size_t, kNumComponents> ModelChunks::device_by_component() const {
  std::array<size_t, kNumComponents> sum{};
  for (const auto& c : chunks_) {
    const auto parts = c->activations().device_by_component();
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += parts[i];
  }
  return sum;
}

size_t ModelChunks::host_bytes() const {
  size_t n = 0;
  for (const auto& c : chunks_) n += c->activations().host_bytes();
  return n;
}

}  // namespace mop
