// The saved tensors of a recomputing model between its forward and its backward: each layer's
// input and, where the activation plan keeps it, its attention output and lse, or the last tiles
// of them (model/activations.h).
// Layers whose saved tensors live in pinned host memory pass them through device buffers: the
// input through one of two stages, the attention through the activation set's own attn/lse. A
// side copy stream takes them to the host as forward writes them and brings them back one layer
// ahead in backward; the compute stream waits only where a buffer is reused or read.
//
// Passes in flight: every saved tensor has a bank per pass (activations.h), and so do the events
// and flags of its copies; the copy stream and the set's attn/lse are shared, so a pass's copies
// queue behind the others' in issue order. use_bank() names the pass the calls that follow serve.
//
// On the CPU every copy is done when issued (runtime.h), so the same calls run in the CPU tests,
// where a wrong stage or a missing copy changes the results.
#pragma once

#include <vector>

#include "model/activations.h"
#include "ops/ops.h"
#include "runtime/memory.h"
#include "runtime/runtime.h"

namespace mop {

class SavedActivations {
 public:
  // `device` and `host` are the model's arenas laid out from `plan` (allocated before use).
  SavedActivations(Ops& ops, const ActivationLayout& plan, const Arena& device, const Arena& host);
  ~SavedActivations();

  bool input_on_host(int l) const { return plan_.xs_host[size_t(l)] >= 0; }
  // Whole attention outputs kept, on the device or the host; kept tails, on either.
  bool attention_kept(int l) const { return attention_on_device(l) || attention_on_host(l); }
  bool attention_on_device(int l) const { return plan_.attn_saved[size_t(l)] >= 0; }
  bool attention_on_host(int l) const { return plan_.attn_host[size_t(l)] >= 0; }
  bool tail_kept(int l) const { return tail_on_device(l) || tail_on_host(l); }
  bool tail_on_device(int l) const { return plan_.tail_saved[size_t(l)] >= 0; }
  bool tail_on_host(int l) const { return plan_.tail_host[size_t(l)] >= 0; }
  int64_t tail_rows() const { return plan_.tail_rows; }
  bool any_on_host() const;
  void use_bank(int bank);

  // Forward. Before x_l is written (into its stage: its previous occupant must be on the host),
  // and once it is (start its copy out).
  void before_input_written(int l);
  void input_written(int l, int64_t rows);
  // Before any attention output is written into the activation set's attn/lse, and once a
  // layer's is: a host-kept layer's (or tail's) copy out starts, a device-kept tail is copied
  // into its slot on the compute stream.
  void before_set_attention_written();
  void attention_written(int l, const Tensor& attn, const Tensor& lse);

  // Backward. Queue x_l's copy back into its stage (no-op on the device or when queued), and make
  // the compute stream wait for it.
  void fetch_input(int l, int64_t rows);
  void wait_input(int l);
  // Queue a host-kept layer's attention (or tail) back into the set's attn/lse (once the later
  // layer's backward has read them). Before the recompute reads them: wait for it, or copy a
  // device-kept tail into the set.
  void fetch_attention(int l, Tensor attn, Tensor lse);
  void restore_attention(int l, Tensor attn, Tensor lse);
  // After the (stage's) backward: nothing is in flight; the bank's fetches are forgotten.
  void finish();

 private:
  void after_compute(Event& e);  // records on the compute stream, the copy stream waits for it
  // Layer l's kept attention (whole on the host, or a tail on either side) and the part of the
  // set's attn/lse it is kept for.
  struct Kept {
    Tensor attn, lse, set_attn, set_lse;
  };
  Kept kept(int l, const Tensor& attn, const Tensor& lse) const;
  Tensor dev(int slot) const { return device_.tensor(plan_.device_slot(slot, bank_)); }
  Tensor host(int slot) const { return host_.tensor(plan_.host_slot(slot, bank_)); }
  // Layer l's events and flags in the bank in use.
  struct PerLayer;
  PerLayer& layer(int l) { return layers_[size_t(bank_) * plan_.xs_host.size() + size_t(l)]; }

  Ops& ops_;
  const ActivationLayout& plan_;
  const Arena& device_;
  const Arena& host_;
  Stream compute_;
  OwnedStream copy_;
  struct PerLayer {
    Event input_out, input_in, attn_out, attn_in;
    bool input_fetched = false;
  };
  std::vector<PerLayer> layers_;  // [bank][layer]
  Event compute_point_, copy_done_;
  int bank_ = 0;
  PerLayer* last_attn_out_ = nullptr;  // the host-kept layer whose attention copy out went last
};

}  // namespace mop
