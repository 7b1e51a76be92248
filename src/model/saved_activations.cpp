// Saved tensors between forward and backward, and their copies to and from host memory (see
// saved_activations.h). Events per layer order the copy stream against the compute stream:
//   input_out  — x_l is on the host: its stage may be rewritten (x_{l+2} in forward);
//   input_in   — x_l is back in its stage: layer l's recompute may read it;
//   attn_out   — layer l's attention is on the host: the set's attn/lse may be rewritten;
//   attn_in    — layer l's attention is back in the set: its recompute may read it.
#include "model/saved_activations.h"

#include "core/error.h"

namespace mop {

SavedActivations::SavedActivations(Ops& ops, const ActivationLayout& plan, const Arena& device,
                                   const Arena& host)
    : ops_(ops), plan_(plan), device_(device), host_(host), compute_(ops.stream()),
      copy_(ops.device()), layers_(size_t(plan.passes) * plan.xs_host.size()),
      compute_point_(ops.device()),
      copy_done_(ops.device()) {
  for (PerLayer& p : layers_)
    for (Event* e : {&p.input_out, &p.input_in, &p.attn_out, &p.attn_in}) *e = Event(ops.device());
}

SavedActivations::~SavedActivations() { copy_.get().synchronize(); }

void SavedActivations::use_bank(int bank) {
  MOP_CHECK(bank >= 0 && bank < plan_.passes, "saved activations: bank ", bank, " of ",
            plan_.passes);
  bank_ = bank;
}

bool SavedActivations::any_on_host() const {
  for (size_t l = 0; l < plan_.xs_host.size(); ++l)
    if (input_on_host(int(l)) || attention_on_host(int(l)) || tail_on_host(int(l))) return true;
  return false;
}

void SavedActivations::after_compute(Event& e) {
  e.record(compute_);
  copy_.get().wait(e);
}

namespace {
// `bytes` from the start of src to the start of dst (a tensor and the slot that holds it).
void copy(const Tensor& dst, const Tensor& src, size_t bytes, Stream stream) {
  MOP_CHECK(bytes <= dst.bytes() && bytes <= src.bytes(), "saved activations: ", bytes,
            " bytes between ", src.shape_str(), " and ", dst.shape_str());
  copy_async(dst.data, src.data, bytes, stream);
}
}  // namespace

void SavedActivations::before_input_written(int l) {
  // x_l's stage last held x_{l-2} (x_L's too where every layer's input goes to the host).
  if (l < 2 || l >= int(plan_.xs.size()) || !input_on_host(l - 2) || plan_.xs[size_t(l)] != plan_.xs[size_t(l - 2)])
    return;
  compute_.wait(layer(l - 2).input_out);
}

void SavedActivations::input_written(int l, int64_t rows) {
  if (l >= int(plan_.xs_host.size()) || !input_on_host(l)) return;
  PerLayer& p = layer(l);
  after_compute(compute_point_);
  const Tensor x = dev(plan_.xs[size_t(l)]).rows(0, rows);
  copy(host(plan_.xs_host[size_t(l)]), x, x.bytes(), copy_.get());
  p.input_out.record(copy_.get());
  p.input_fetched = false;
}

void SavedActivations::before_set_attention_written() {
  if (last_attn_out_) compute_.wait(last_attn_out_->attn_out);
}

SavedActivations::Kept SavedActivations::kept(int l, const Tensor& attn, const Tensor& lse) const {
  if (attention_on_host(l))
    return {host(plan_.attn_host[size_t(l)]), host(plan_.lse_host[size_t(l)]), attn, lse};
  // A tail: the last tail_rows rows of attn, the last tail_rows·Nq elements of lse (tile-major).
  const int64_t r = plan_.tail_rows, T = attn.shape[0], nq = lse.numel() / T;
  MOP_CHECK(r > 0 && r < T && lse.numel() == T * nq, "saved activations: a tail of ", r, " rows of ",
            attn.shape_str());
  const Tensor flat = lse.view({lse.numel()});
  const bool on_host = tail_on_host(l);
  return {on_host ? host(plan_.tail_host[size_t(l)]) : dev(plan_.tail_saved[size_t(l)]),
          on_host ? host(plan_.tail_lse_host[size_t(l)]) : dev(plan_.tail_lse_saved[size_t(l)]),
          attn.rows(T - r, T), flat.rows((T - r) * nq, T * nq)};
}

void SavedActivations::attention_written(int l, const Tensor& attn, const Tensor& lse) {
  if (tail_on_device(l)) {  // on the compute stream, before the set's attn is rewritten
    const Kept k = kept(l, attn, lse);
    copy(k.attn, k.set_attn, k.set_attn.bytes(), compute_);
    copy(k.lse, k.set_lse, k.set_lse.bytes(), compute_);
    return;
  }
  if (!attention_on_host(l) && !tail_on_host(l)) return;
  PerLayer& p = layer(l);
  const Kept k = kept(l, attn, lse);
  after_compute(compute_point_);
  copy(k.attn, k.set_attn, k.set_attn.bytes(), copy_.get());
  copy(k.lse, k.set_lse, k.set_lse.bytes(), copy_.get());
  p.attn_out.record(copy_.get());
  last_attn_out_ = &p;
}

void SavedActivations::fetch_input(int l, int64_t rows) {
  if (l < 0 || !input_on_host(l) || layer(l).input_fetched) return;
  PerLayer& p = layer(l);
  // The stage's previous reader (x_{l+2}'s layer, or the forward) has been issued before now.
  after_compute(compute_point_);
  const Tensor x = dev(plan_.xs[size_t(l)]).rows(0, rows);
  copy(x, host(plan_.xs_host[size_t(l)]), x.bytes(), copy_.get());
  p.input_in.record(copy_.get());
  p.input_fetched = true;
}

void SavedActivations::wait_input(int l) {
  if (!input_on_host(l)) return;
  MOP_CHECK(layer(l).input_fetched, "saved activations: layer ", l, "'s input was not fetched");
  compute_.wait(layer(l).input_in);
}

void SavedActivations::fetch_attention(int l, Tensor attn, Tensor lse) {
  if (l < 0 || (!attention_on_host(l) && !tail_on_host(l))) return;
  PerLayer& p = layer(l);
  const Kept k = kept(l, attn, lse);
  after_compute(compute_point_);
  copy(k.set_attn, k.attn, k.set_attn.bytes(), copy_.get());
  copy(k.set_lse, k.lse, k.set_lse.bytes(), copy_.get());
  p.attn_in.record(copy_.get());
}

void SavedActivations::restore_attention(int l, Tensor attn, Tensor lse) {
  if (attention_on_host(l) || tail_on_host(l)) {
    compute_.wait(layer(l).attn_in);
  } else if (tail_on_device(l)) {
    const Kept k = kept(l, attn, lse);
    copy(k.set_attn, k.attn, k.set_attn.bytes(), compute_);
    copy(k.set_lse, k.lse, k.set_lse.bytes(), compute_);
  }
}

void SavedActivations::finish() {
  // The compute stream waits for the last copies (all of them are on the one copy stream).
  if (!any_on_host()) return;
  copy_done_.record(copy_.get());
  compute_.wait(copy_done_);
  last_attn_out_ = nullptr;
  for (size_t l = 0; l < plan_.xs_host.size(); ++l) layer(int(l)).input_fetched = false;
}

}  // namespace mop
