// The training loop (see trainer.h). Samples of optimizer step s: global samples
// [s·G, (s+1)·G) of the loader; data-parallel rank r takes micro-batch m's samples
// s·G + (m·dp + r)·b … +b. Each token's cross-entropy is weighted by 1 / (unmasked targets of the
// whole step over all ranks), so gradient accumulation and data parallelism give the same
// gradient as one big batch.
#include "train/trainer.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <optional>

#include "core/error.h"
#ifdef MOP_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#include "ops/timed_ops.h"
#include "optim/schedule.h"
#include "parallel/timed_comm.h"
#include "train/checkpointing.h"

namespace mop {

namespace {

// H200 (and H100 SXM) dense bf16 Tensor Core peak, the MFU denominator.
constexpr double kGpuPeakBf16Flops = 989e12;

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::string RunPlacement::describe() const {
  return std::string(device_name(device)) + ", " + std::string(dtype_name(compute)) +
         " compute, " + std::string(dtype_name(grad)) + " gradients";
}

bool cuda_device_available() {
#ifdef MOP_HAVE_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

RunPlacement resolve_placement(const Config& cfg) {
  RunPlacement p;
  const auto& t = cfg.train;
#ifndef MOP_HAVE_CUDA
  MOP_USER_CHECK(t.device != "cuda", "train.device: cuda, but this mop was built without CUDA (MOP_CUDA=OFF)");
#endif
  bool cuda = t.device == "cuda" || (t.device == "auto" && cuda_device_available());
  if (cuda) {
    // The CUDA kernels compute in bf16 with fp32 accumulation, statistics and gradients.
    MOP_USER_CHECK(t.precision == "auto" || t.precision == "bf16", "train.precision: ", t.precision,
                   " is not available on the GPU (bf16 only); use auto or bf16, or train.device: cpu");
    p.device = Device::CUDA;
    p.compute = DType::BF16;
    p.grad = DType::F32;
    return p;
  }
  MOP_USER_CHECK(t.precision != "bf16", "train.precision: bf16 needs train.device: cuda; the CPU "
                 "backend runs fp32 or fp64");
  p.device = Device::CPU;
  p.compute = t.precision == "fp64" ? DType::F64 : DType::F32;
  p.grad = p.compute;
  return p;
}

TokenLoaderOptions make_loader_options(const Config& cfg) {
  TokenLoaderOptions lo;
  lo.paths = cfg.data.paths;
  lo.format = cfg.data.format;
  lo.flat_dtype = cfg.data.flat_dtype;
  lo.eos_id = cfg.data.eos_id;
  lo.vocab_size = cfg.model.vocab_size;
  lo.seq_len = int(cfg.data.seq_len);
  lo.seed = uint64_t(cfg.train.seed);
  lo.eod_mask_loss = cfg.data.eod_mask_loss;
  lo.reset_position_ids = cfg.data.reset_position_ids;
  lo.valid_fraction = cfg.data.valid_fraction;
  return lo;
}

std::unique_ptr<Ops> make_ops(const RunPlacement& placement, int local_rank) {
  if (placement.device == Device::CPU) return make_cpu_ops();
#ifdef MOP_HAVE_CUDA
  return make_cuda_ops(local_rank);
#else
  MOP_UNREACHABLE("CUDA placement in a CPU-only build");
#endif
}

MemoryEstimate estimate_memory(const Config& cfg, const RunPlacement& placement) {
  ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  MemoryEstimate m;
  int64_t elems = 0;
  for (const auto& p : layout.params) elems += (p.numel() + kParamAlign - 1) / kParamAlign * kParamAlign;
  m.weights = size_t(elems) * dtype_size(placement.compute);
  m.grads = size_t(elems) * dtype_size(placement.grad);
  m.optimizer = size_t(elems) * 3 * sizeof(float);
  // The activation plan without allocating it: a store with no memory is enough to plan.
  TransformerOptions topt;
  topt.max_batch = int(cfg.train.micro_batch_size);
  topt.max_seq = int(cfg.data.seq_len);
  topt.recompute = cfg.train.recompute;
  topt.lm_head_chunk = cfg.train.lm_head_chunk;
  ParamStore shapes_only(layout, placement.compute, placement.grad, MemKind::Host, /*allocate=*/false);
  auto ops = make_cpu_ops();
  Transformer plan(layout, shapes_only, *ops, topt);
  m.activations = plan.planned_bytes();
  return m;
}

Trainer::Trainer(Config cfg, World& world) : cfg_(std::move(cfg)), world_(world) { build(); }

Trainer::~Trainer() = default;

void Trainer::build() {
  validate_parallel(cfg_, world_.size);
  MOP_USER_CHECK(!cfg_.data.paths.empty(), "data.paths: no training data given");
  MOP_USER_CHECK(world_.comm->all_equal(dump_config(cfg_)),
                 "the ranks were started with different configurations");

  // 1. Backend and parallel groups (attention: cp × dp, MoE: ep × dp over the same ranks).
  placement_ = resolve_placement(cfg_);
  auto timed = std::make_unique<TimedOps>(make_ops(placement_, world_.local_rank));
  timed_ = timed.get();
  ops_ = std::move(timed);
  device_used_at_start_ = device_memory_used();
  groups_ = ParallelGroups::build(cfg_, world_, *ops_);
  if (world_.size > 1)  // tensor collectives count as communication in the step's time split
    for (auto [c, label] : {std::pair{&groups_->world_data, "world"}, {&groups_->cp_data, "cp"},
                            {&groups_->ep_data, "ep"}, {&groups_->edp_data, "edp"},
                            {&groups_->world_grad, "gradient sums (world)"},
                            {&groups_->edp_grad, "gradient sums (edp)"},
                            {&groups_->ep_dispatch, "expert dispatch"},
                            {&groups_->ep_combine, "expert combine"},
                            {&groups_->cp_ring, "ring attention"}})
      if (*c) *c = time_comm(std::move(*c), *timed_, label);
  dp_size_ = groups_->dp_size;
  dp_rank_ = groups_->dp;
  micro_batches_ = int(cfg_.train.global_batch_size / (cfg_.train.micro_batch_size * dp_size_));
  const int cp = groups_->cp_size;
  if (cp > 1) {
    MOP_USER_CHECK(cfg_.data.seq_len % (2 * cp) == 0, "data.seq_len: ", cfg_.data.seq_len,
                   " must divide into 2 × parallel.attention.cp (", 2 * cp,
                   ") chunks (each cp rank holds an early and a late chunk)");
    local_positions_ = zigzag_positions(int(cfg_.data.seq_len), cp, groups_->cp);
  }
  local_seq_ = int(cfg_.data.seq_len) / cp;

  // 2. Layout (this rank's experts), parameters.
  layout_ = ModelLayout::build(ModelDims::from(cfg_, groups_->ep, groups_->ep_size));
  MemKind mem = placement_.device == Device::CUDA ? MemKind::Device : MemKind::Host;
  params_ = std::make_unique<ParamStore>(layout_, placement_.compute, placement_.grad, mem);

  // 3. Data.
  loader_ = std::make_unique<TokenLoader>(make_loader_options(cfg_));
  MOP_USER_CHECK(cfg_.train.eval_interval == 0 || loader_->num_valid_windows() > 0,
                 "train.eval_interval: ", cfg_.train.eval_interval,
                 " needs held-out data; set data.valid_fraction > 0");

  // 4. Activations, planned then allocated once.
  TransformerOptions topt;
  topt.max_batch = int(cfg_.train.micro_batch_size);
  topt.max_seq = local_seq_;
  topt.recompute = cfg_.train.recompute;
  topt.lm_head_chunk = cfg_.train.lm_head_chunk;
  topt.groups = groups_.get();
  topt.attention_impl = cfg_.parallel.attention.impl;
  topt.moe_chunks = int(cfg_.parallel.moe.chunks);
  model_ = std::make_unique<Transformer>(layout_, *params_, *ops_, topt);
  if (placement_.device == Device::CUDA) {
    // The activations must fit next to the weights and gradients (allocated above) and the least
    // optimizer footprint (all state on the host: bf16 gradient staging, 2 bytes per parameter).
    const double free = double(device_memory_free()), act = double(model_->planned_bytes()),
                 least = act + double(ops_->workspace_bytes()) + 2.0 * double(params_->total_elements());
    MOP_USER_CHECK(least <= free, "the activations of one micro-batch (", cfg_.train.micro_batch_size,
                   " × ", local_seq_, " tokens per rank) need ", format_bytes(act), ", and with the "
                   "backend workspaces and gradient staging ", format_bytes(least), ", but only ",
                   format_bytes(free), " of GPU memory are free after the weights and gradients. "
                   "Lower data.seq_len or train.micro_batch_size, raise parallel.attention.cp",
                   cfg_.train.recompute ? "" : ", or set train.recompute: true");
  }
  model_->allocate();
  const size_t tokens_local = size_t(cfg_.train.micro_batch_size) * size_t(local_seq_);
  const size_t tokens = size_t(micro_batches_) * tokens_local;
  ids_.assign(tokens, 0), targets_.assign(tokens, 0), positions_.assign(tokens, 0);
  if (cp > 1) {  // whole sequences as read, before this rank keeps its chunks
    size_t full = size_t(cfg_.train.micro_batch_size) * size_t(cfg_.data.seq_len);
    full_ids_.assign(full, 0), full_targets_.assign(full, 0), full_positions_.assign(full, 0);
  }
  if (placement_.device == Device::CUDA)  // one micro-batch's ids/targets/positions on the GPU
    batch_dev_ = Buffer(MemKind::Device, 3 * tokens_local * sizeof(int32_t));

  // 5. Optimizer state, placed per parameter group (GPU or host) in the memory left.
  std::vector<bool> on_host = choose_state_placement();
  std::vector<bool> owned = assign_owners();
  optim_ = std::make_unique<Optimizer>(cfg_.optim, *params_, *ops_, on_host, int(cfg_.optim.host_threads),
                                       owned);
  if (world_.size > 1) {
    std::vector<bool> sharded;
    for (const ParamDef& p : layout_.params) sharded.push_back(p.kind == ParamKind::Experts);
    optim_->set_distributed(std::move(sharded), groups_->ep_size > 1 ? groups_->ep_host.get() : nullptr,
                            groups_->world_host);
  }
  if (world_.size > 1) {
    reducer_ = std::make_unique<GradReducer>(*groups_);
    const int stages = int(layout_.dims.layers) + 2;
    stage_params_.assign(size_t(stages), {});
    stage_has_host_state_.assign(size_t(stages), false);
    stage_reduced_.assign(size_t(stages), false);
    for (int p = 0; p < int(layout_.params.size()); ++p) {
      int s = param_stage(layout_, p);
      stage_params_[size_t(s)].push_back(p);
      const bool host_update = !on_host.empty() && on_host[size_t(p)] && (owned.empty() || owned[size_t(p)]);
      if (host_update) stage_has_host_state_[size_t(s)] = true;
    }
  }
  model_->set_hooks({[this](int stage) { optim_->weights_ready(stage); },
                     [this](int stage) {
                       if (!last_micro_batch_) return;
                       if (reducer_) {
                         reduce_stage(stage);
                         // The host update copies this stage's gradients: they must be summed.
                         if (stage_has_host_state_[size_t(stage)]) join_reductions();
                       }
                       optim_->grads_final(stage);
                     },
                     [this](bool backward) {
                       timed_->set_phase(backward ? StepPhase::Backward : StepPhase::Forward);
                     }});

  // 6. Weights.
  resume_or_init();

  size_t weights = size_t(params_->total_elements()) * (dtype_size(placement_.compute) + dtype_size(placement_.grad));
  planned_device_bytes_ = weights + model_->planned_bytes() + ops_->workspace_bytes() +
                          batch_dev_.bytes();
  if (placement_.device == Device::CUDA)
    planned_device_bytes_ += optim_->native_state_bytes() + host_param_elements(on_host) * 2;
  spdlog::info("model: {} layers, {:.2f}M parameters ({:.2f}M active per token) | {} | data: {}",
               cfg_.model.num_layers, layout_.num_params() / 1e6, layout_.num_active_params() / 1e6,
               placement_.describe(), loader_->summary());
  spdlog::info("memory per rank: weights+grads {}, optimizer state {} + {} on the host, "
               "activations {}, backend workspaces {} = {} planned | batch: {} sequences × {} "
               "tokens per step, {} micro-batch(es) of {} per rank",
               format_bytes(double(weights)), format_bytes(double(optim_->native_state_bytes())),
               format_bytes(double(optim_->host_state_bytes())),
               format_bytes(double(model_->planned_bytes())), format_bytes(double(ops_->workspace_bytes())),
               format_bytes(double(planned_device_bytes_)), cfg_.train.global_batch_size,
               cfg_.data.seq_len, micro_batches_, cfg_.train.micro_batch_size);
  std::string metrics_path = cfg_.log.metrics_file.empty()
                                 ? cfg_.checkpoint.dir + "/metrics.jsonl"
                                 : cfg_.log.metrics_file;
  // Model FLOPs per token: 6·N_active (forward + backward of every active weight) plus causal
  // attention forward + backward, 6·S·heads·head_dim per layer.
  const ModelDims& d = layout_.dims;
  flops_per_token_ = 6.0 * double(layout_.num_active_params()) +
                     6.0 * double(cfg_.data.seq_len) * double(d.heads * d.head_dim) * double(d.layers);
  // The step's model FLOPs are those of all ranks: MFU is against the peak of all their GPUs.
  double peak = placement_.device == Device::CUDA ? kGpuPeakBf16Flops * world_.size : 0.0;
  metrics_ = std::make_unique<MetricsLog>(metrics_path, cfg_.train.steps, cfg_.log.interval,
                                          world_.is_root(), step_, peak);
  timed_->collect();  // setup work is not part of step 1
}

std::vector<bool> Trainer::assign_owners() {
  const int n = int(layout_.params.size());
  owner_.assign(size_t(n), 0);
  if (!cfg_.parallel.zero || world_.size == 1) return {};
  // Largest first onto the least-loaded rank of the group that replicates the parameter (dense:
  // all ranks; experts: the edp group): the same order and result on every rank.
  std::vector<int> order(n);
  for (int p = 0; p < n; ++p) order[p] = p;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return layout_.params[a].numel() > layout_.params[b].numel();
  });
  std::vector<int64_t> dense_load(size_t(world_.size), 0), expert_load(size_t(groups_->edp_size), 0);
  std::vector<bool> owned(static_cast<size_t>(n), false);
  for (int p : order) {
    bool expert = layout_.params[p].kind == ParamKind::Experts;
    auto& load = expert ? expert_load : dense_load;
    int best = int(std::min_element(load.begin(), load.end()) - load.begin());
    load[size_t(best)] += layout_.params[p].numel();
    owner_[size_t(p)] = best;
    owned[size_t(p)] = best == (expert ? groups_->edp : world_.rank);
  }
  return owned;
}

void Trainer::broadcast_weights() {
  if (!cfg_.parallel.zero || world_.size == 1) return;
  // Owned host-placed weights must be written (not the state: a two-pass host update may still be
  // writing it, which the broadcast does not need).
  for (int s = 0; s <= int(layout_.dims.layers) + 1; ++s) optim_->weights_ready(s);
  for (int p = 0; p < params_->num_params(); ++p) {
    bool expert = layout_.params[p].kind == ParamKind::Experts;
    (expert ? groups_->edp_data : groups_->world_data)->broadcast(params_->weight(p), owner_[size_t(p)]);
  }
}

int64_t Trainer::host_param_elements(const std::vector<bool>& on_host) const {
  int64_t n = 0;
  for (size_t p = 0; p < on_host.size(); ++p)
    if (on_host[p]) n += (layout_.params[p].numel() + kParamAlign - 1) / kParamAlign * kParamAlign;
  return n;
}

std::vector<bool> Trainer::choose_state_placement() {
  const std::string& mode = cfg_.optim.state_placement;
  const int n = int(layout_.params.size());
  const int stages = int(layout_.dims.layers) + 2;
  std::vector<bool> on_host;
  if (placement_.device == Device::CPU) {
    if (mode != "host") return {};
    MOP_USER_CHECK(placement_.compute == DType::F32, "optim.state_placement: host on the CPU needs "
                   "train.precision fp32 (the host engine reads fp32 or bf16 gradients)");
    on_host.assign(n, true);
  } else if (mode == "gpu") {
    return {};
  } else if (mode == "host") {
    on_host.assign(n, true);
  } else {
    // auto: everything on the host costs 2 bytes per parameter on the GPU (bf16 gradient staging);
    // moving a stage's state to the GPU costs 10 more. Stages are moved in the order the next
    // forward needs them (embedding, layer 0, …), whose host updates would be exposed first.
    constexpr double kMarginBytes = 2.0 * (1 << 30);  // allocator slack, lazily built plans
    std::vector<int64_t> stage_elems(stages, 0);
    for (int p = 0; p < n; ++p)
      stage_elems[param_stage(layout_, p)] += (layout_.params[p].numel() + kParamAlign - 1) / kParamAlign * kParamAlign;
    double free = double(device_memory_free()) - kMarginBytes, need = 0;
    for (int64_t e : stage_elems) need += 2.0 * double(e);
    std::vector<bool> stage_on_gpu(stages, false);
    for (int s = 0; s < stages && need + 10.0 * double(stage_elems[s]) <= free; ++s) {
      stage_on_gpu[s] = true;
      need += 10.0 * double(stage_elems[s]);
    }
    on_host.assign(n, false);
    for (int p = 0; p < n; ++p) on_host[p] = !stage_on_gpu[param_stage(layout_, p)];
  }
  int64_t host = host_param_elements(on_host);
  if (host == 0) return {};
  int64_t host_params = 0;
  for (int p = 0; p < n; ++p)
    if (on_host[p]) host_params += layout_.params[p].numel();
  // The host engine is memory-bound: ~28 bytes per parameter in one pass, 5.2 G params/s on the
  // H200 machine's 16-core host; the weights pass of a two-pass update reads 14 and writes 2,
  // 7.6 G params/s there (README). The prediction is what would be exposed if nothing hid it.
  spdlog::info("optimizer state: {:.2f}M parameters on the host ({}), {:.2f}M on the {}; host "
               "update ≈ {:.0f} ms per step at 5 G params/s{}",
               host_params / 1e6, format_bytes(16.0 * double(host)),
               (layout_.num_params() - host_params) / 1e6, device_name(placement_.device),
               1e3 * double(host_params) / 5e9,
               cfg_.optim.overlap
                   ? fmt::format(" (new weights after ≈ {:.0f} ms with two passes), overlapped "
                                 "with the next forward",
                                 1e3 * double(host_params) / 7.5e9)
                   : std::string(", not overlapped"));
  return on_host;
}

size_t Trainer::device_memory_free() const {
#ifdef MOP_HAVE_CUDA
  size_t free = 0, total = 0;
  if (placement_.device == Device::CUDA && cudaMemGetInfo(&free, &total) == cudaSuccess) return free;
#endif
  return 0;
}

void Trainer::resume_or_init() {
  std::optional<std::string> dir = resolve_resume_dir(cfg_);
  if (!dir) {
    optim_->init_weights(uint64_t(cfg_.train.seed));
    return;
  }
  TrainerState st = load_checkpoint(*dir, cfg_, *params_, *optim_, /*optim_state=*/true);
  broadcast_weights();  // each rank loaded the state it owns
  MOP_USER_CHECK(st.step < cfg_.train.steps, "checkpoint ", *dir, " is at step ", st.step,
                 ", which is not before train.steps (", cfg_.train.steps, "); nothing to do. "
                 "Raise train.steps to continue training");
  // An imported checkpoint (no samples consumed yet) has no data order to continue.
  if (st.consumed_samples > 0 && st.data_fingerprint != loader_->fingerprint())
    spdlog::warn("resuming from {}: the data, seq_len, seed or split differ from the checkpoint's; "
                 "the data order will not continue where it stopped", *dir);
  if (st.consumed_samples > 0 && st.seed != uint64_t(cfg_.train.seed))
    spdlog::warn("resuming from {}: train.seed differs from the checkpoint's ({})", *dir, st.seed);
  step_ = st.step;
  consumed_samples_ = st.consumed_samples;
  last_saved_step_ = step_;
  spdlog::info("resumed from {} at step {} ({} samples consumed)", *dir, step_, consumed_samples_);
}

int64_t Trainer::fill_local(int64_t first, bool valid_split, int32_t* ids, int32_t* targets,
                            int32_t* positions) {
  const int b = int(cfg_.train.micro_batch_size);
  auto fill = [&](int32_t* i, int32_t* t, int32_t* p) {
    return valid_split ? loader_->fill_valid(first, b, i, t, p) : loader_->fill(first, b, i, t, p);
  };
  if (local_positions_.empty()) return fill(ids, targets, positions);
  // Sequence parallelism: read whole sequences, keep this rank's chunks.
  fill(full_ids_.data(), full_targets_.data(), full_positions_.data());
  const int64_t S = cfg_.data.seq_len, sl = local_seq_;
  int64_t valid = 0;
  for (int64_t q = 0; q < b; ++q)
    for (int64_t l = 0; l < sl; ++l) {
      int64_t from = q * S + local_positions_[size_t(l)], to = q * sl + l;
      ids[to] = full_ids_[size_t(from)];
      targets[to] = full_targets_[size_t(from)];
      positions[to] = full_positions_[size_t(from)];
      valid += targets[to] >= 0;
    }
  return valid;
}

void Trainer::fill_step_batches() {
  const int64_t b = cfg_.train.micro_batch_size, T = b * local_seq_;
  int64_t valid = 0;
  for (int m = 0; m < micro_batches_; ++m) {
    int64_t first = consumed_samples_ + (int64_t(m) * dp_size_ + dp_rank_) * b;
    size_t off = size_t(m) * size_t(T);
    valid += fill_local(first, false, ids_.data() + off, targets_.data() + off, positions_.data() + off);
  }
  step_valid_tokens_ = int64_t(groups_->world_host->all_reduce_host(double(valid), Comm::Op::Sum));
}

void Trainer::reduce_stage(int stage) {
  // Dense weights are replicated on every rank: sum over all of them. Experts are sharded over
  // ep: sum over the ranks that hold the same experts.
  std::vector<Tensor> dense, expert;
  for (int p : stage_params_[size_t(stage)])
    (layout_.params[p].kind == ParamKind::Experts ? expert : dense).push_back(params_->grad(p));
  reducer_->reduce(dense, expert);
  stage_reduced_[size_t(stage)] = true;
}

void Trainer::join_reductions() {
  reducer_->join();  // timed as communication (TimedComm): the time the compute stream waits
}

void Trainer::reduce_gradients() {
  if (!reducer_) return;
  for (size_t s = 0; s < stage_reduced_.size(); ++s)
    if (!stage_reduced_[s]) reduce_stage(int(s));
  join_reductions();
  std::fill(stage_reduced_.begin(), stage_reduced_.end(), false);
}

Batch Trainer::micro_batch(int m) {
  const int64_t b = cfg_.train.micro_batch_size, S = local_seq_, T = b * S;
  size_t off = size_t(m) * size_t(T);
  Batch batch;
  batch.batch = int(b);
  batch.seq = int(S);
  batch.ids = Tensor(ids_.data() + off, DType::I32, {T});
  batch.targets = Tensor(targets_.data() + off, DType::I32, {T});
  batch.positions = Tensor(positions_.data() + off, DType::I32, {T});
  if (batch_dev_.data()) {
    int32_t* dev = static_cast<int32_t*>(batch_dev_.data());
    Tensor* parts[3] = {&batch.ids, &batch.targets, &batch.positions};
    for (int i = 0; i < 3; ++i) {
      Tensor d(dev + i * T, DType::I32, {T}, Device::CUDA);
      ops_->copy(d, *parts[i]);
      *parts[i] = d;
    }
  }
  return batch;
}

Trainer::StepLosses Trainer::compute_gradients() {
  fill_step_batches();
  float ce_scale = step_valid_tokens_ > 0 ? float(1.0 / double(step_valid_tokens_)) : 0.0f;
  if (step_valid_tokens_ == 0)
    spdlog::warn("step {}: every target of the step is masked; only the router losses train",
                 step_ + 1);
  ops_->fill(params_->grads_flat(), 0);
  // Router losses are averaged over the step's micro-batches on every data-parallel rank.
  const float aux_scale = 1.0f / float(micro_batches_ * dp_size_);
  for (int m = 0; m < micro_batches_; ++m) {
    last_micro_batch_ = m + 1 == micro_batches_;
    model_->forward_backward(micro_batch(m), ce_scale, aux_scale);
  }
  last_micro_batch_ = false;
  reduce_gradients();
  LossTerms lt;
  {
    // Reading the losses waits for the step's device work, NCCL collectives included: a peer
    // that hangs shows up here, so the watchdog times it.
    std::optional<ScopedCollective> watch;
    if (groups_->watchdog) watch.emplace(*groups_->watchdog, "the step's device work");
    lt = model_->take_losses();
  }
  double sums[3] = {lt.ce_sum, lt.aux, lt.z};
  groups_->world_host->all_reduce_host(sums, 3, Comm::Op::Sum);
  return {step_valid_tokens_ > 0 ? sums[0] / double(step_valid_tokens_) : 0.0, sums[1], sums[2]};
}

size_t Trainer::device_memory_used() const {
#ifdef MOP_HAVE_CUDA
  if (placement_.device == Device::CUDA) {
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) == cudaSuccess) return total - free;
  }
#endif
  return 0;
}

void Trainer::train_step(StepMetrics& sm) {
  const bool profile = cfg_.train.profile_step == step_ + 1 && world_.is_root();
  if (profile) {
    timed_->start_trace();
    if (optim_->offload()) optim_->offload()->set_tracing(true);
  }
  double t0 = now_seconds();
  double lr = learning_rate(cfg_.optim, step_, cfg_.train.steps);
  StepLosses losses = compute_gradients();
  sm.loss = losses.loss, sm.aux_loss = losses.aux, sm.z_loss = losses.z;
  sm.lr = lr;
  sm.tokens = cfg_.train.global_batch_size * cfg_.data.seq_len;

  std::string bad;
  StepReport rep;
  if (!std::isfinite(sm.loss) || !std::isfinite(sm.aux_loss) || !std::isfinite(sm.z_loss)) {
    bad = "the loss is " + std::to_string(sm.loss);
  } else {
    timed_->force_category(OpCategory::Optimizer);
    timed_->set_phase(StepPhase::Optimizer);
    rep = optim_->step(float(lr));
    if (rep.applied) broadcast_weights();
    timed_->clear_forced_category();
    sm.grad_norm = rep.grad_norm;
    if (!rep.applied) bad = "non-finite gradient in " + rep.nonfinite_param;
  }
  if (!bad.empty()) {
    MOP_USER_CHECK(cfg_.train.on_nonfinite != "abort", "step ", step_ + 1, ": ", bad,
                   " (train.on_nonfinite: abort)");
    spdlog::warn("step {}: {}; skipping the step (train.on_nonfinite: skip)", step_ + 1, bad);
    sm.skipped = true;
  }
  consumed_samples_ += cfg_.train.global_batch_size;
  ++step_;
  sm.step = step_;
  if (profile) {
    optim_->drain();  // the step's host updates belong to its trace
    std::vector<TraceEvent> events = timed_->stop_trace();
    if (HostOffload* off = optim_->offload()) {
      for (TraceEvent& e : off->take_trace(timed_->trace_host_start())) events.push_back(std::move(e));
      off->set_tracing(false);
    }
    std::string path = cfg_.checkpoint.dir + "/trace_step_" + std::to_string(step_) + ".json";
    write_chrome_trace(path, events);
    spdlog::info("wrote {} ({} events)", path, events.size());
  }
  sm.times = timed_->collect();
  sm.offload = optim_->take_offload_stats();
  sm.step_seconds = now_seconds() - t0;
  sm.model_flops = flops_per_token_ * double(sm.tokens);
}

double Trainer::evaluate() {
  const int64_t b = cfg_.train.micro_batch_size;
  double ce = 0, valid = 0;
  for (int64_t i = 0; i < cfg_.train.eval_batches; ++i) {
    int64_t first = (i * dp_size_ + dp_rank_) * b;
    valid += double(fill_local(first, true, ids_.data(), targets_.data(), positions_.data()));
    model_->forward(micro_batch(0), 0.0f);
    ce += model_->take_losses().ce_sum;
  }
  double sums[2] = {ce, valid};
  groups_->world_host->all_reduce_host(sums, 2, Comm::Op::Sum);
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

void Trainer::save_checkpoint() {
  optim_->drain();  // host-placed master weights and moments are final
  TrainerState st;
  st.step = step_;
  st.consumed_samples = consumed_samples_;
  st.optimizer_updates = optim_->updates();
  st.seed = uint64_t(cfg_.train.seed);
  st.data_fingerprint = loader_->fingerprint();
  std::string dir = mop::save_checkpoint(cfg_, *params_, *optim_, st, world_, groups_.get());
  last_saved_step_ = step_;
  spdlog::info("saved checkpoint {}", dir);
}

bool Trainer::stop_requested() {
  double sig = double(g_stop_signal.load());
  return groups_->world_host->all_reduce_host(sig, Comm::Op::Max) != 0;
}

void Trainer::run() {
  auto prev_term = std::signal(SIGTERM, on_stop_signal);
  auto prev_int = std::signal(SIGINT, on_stop_signal);
  spdlog::info("training steps {} → {}", step_ + 1, cfg_.train.steps);
  while (step_ < cfg_.train.steps) {
    StepMetrics sm;
    train_step(sm);
    if (cfg_.train.eval_interval > 0 &&
        (step_ % cfg_.train.eval_interval == 0 || step_ == cfg_.train.steps))
      sm.val_loss = evaluate();
    metrics_->record(sm);
    if (step_ == 1 && placement_.device == Device::CUDA) {
      // After a whole step every plan and workspace exists: compare with the plan.
      double used = double(device_memory_used() - device_used_at_start_);
      spdlog::info("device memory: planned {}, in use after step 1 {} ({:+.1f}%)",
                   format_bytes(double(planned_device_bytes_)), format_bytes(used),
                   100.0 * (used - double(planned_device_bytes_)) / double(planned_device_bytes_));
    }
    if (cfg_.checkpoint.interval > 0 && step_ % cfg_.checkpoint.interval == 0) save_checkpoint();
    if (stop_requested()) {
      spdlog::warn("stop requested by signal; checkpointing at step {} and exiting", step_);
      if (last_saved_step_ != step_) save_checkpoint();
      break;
    }
    if (cfg_.train.exit_interval > 0 && step_ % cfg_.train.exit_interval == 0 &&
        step_ < cfg_.train.steps) {
      if (last_saved_step_ != step_) save_checkpoint();
      spdlog::info("train.exit_interval: exiting at step {}; resume with --resume auto", step_);
      break;
    }
  }
  if (step_ == cfg_.train.steps && cfg_.checkpoint.save_final && last_saved_step_ != step_)
    save_checkpoint();
  std::signal(SIGTERM, prev_term);
  std::signal(SIGINT, prev_int);
}

}  // namespace mop
