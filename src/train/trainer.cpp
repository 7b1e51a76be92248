// The training loop (see trainer.h). Samples of optimizer step s: global samples
// [s·G, (s+1)·G) of the loader; data-parallel rank r takes micro-batch m's samples
// s·G + (m·dp + r)·b … +b (data/step_batches.h). Each token's cross-entropy is weighted by
// 1 / (unmasked targets of the whole step over all ranks), so gradient accumulation and data
// parallelism give the same gradient as one big batch.
#include "train/trainer.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>
#include <utility>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/manifest.h"
#include "core/error.h"
#include "core/format.h"
#include "ops/timed_ops.h"
#include "optim/schedule.h"
#include "parallel/routing_model.h"
#include "parallel/sequence_parallel.h"
#include "parallel/timed_comm.h"
#include "plan/search.h"
#include "runtime/runtime.h"
#include "train/checkpointing.h"

namespace mop {

namespace {

// "attention 77 ms (16%) | ...": the plan's time split in the log's form.
std::string predicted_split(const std::array<double, kNumOpCategories>& seconds) {
  OpTimes t;
  t.seconds = seconds;
  return t.describe();
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

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

Machine run_machine(const Config& cfg, World& world) {
  const bool gpu = cfg.train.device != "cpu" && gpu_count() > 0;
  MOP_USER_CHECK(cfg.train.device != "cuda" || cuda_built(),
                 "train.device: cuda, but this mop was built without CUDA (MOP_CUDA=OFF)");
  MOP_USER_CHECK(cfg.train.device != "cuda" || gpu, "train.device: cuda, but no CUDA device is available");
  // Without train.machine, the built-in description of this machine's GPU (or of the CPU backend).
  std::string note;
  Machine m = !cfg.train.machine.empty() ? load_machine(cfg.train.machine)
                                         : builtin_machine(gpu ? builtin_for_gpu(gpu_name(), &note) : "cpu");
  if (!note.empty()) {
    m.origin += " (" + note + ")";
    if (world.is_root()) spdlog::warn("{}", note);
  }
  if (!gpu) m.device.kind = Device::CPU;
  // This machine's memory, the least any rank finds (so every rank makes the same plan).
  const MemoryInfo host = memory_info(Device::CPU);
  double mem[2] = {double(host.total), gpu ? 0.0 : double(host.total)};
  if (gpu) {
    select_gpu(world.local_rank % gpu_count());
    mem[1] = double(memory_info(Device::CUDA).free);
  }
  world.comm->all_reduce_host(mem, 2, Comm::Op::Min);
  if (const size_t limit = host_memory_limit(); limit > 0 && double(limit) <= mem[0])
    spdlog::info("host memory: {} by this process's limits (its cgroup's memory limit, ulimit -v), the "
                 "plan's budget", format_bytes(double(limit)));
  m.host.memory_bytes = mem[0];
  m.device.memory_bytes = mem[1];
  m.gpus_per_node = world.local_size;
  m.nodes = std::max(1, world.size / std::max(1, world.local_size));
  // The built-in node's host as this job's ranks share this host (a machine file says its own).
  if (gpu && cfg.train.machine.empty()) share_builtin_host(m, this_node_cores(world.local_size), world.local_size);
  return m;
}

Config planned_config(const Config& cfg, const Machine& machine, int world) {
  if (cfg.train.plan != "auto") return cfg;
  SearchResult r = search_plans(cfg, machine, world);
  MOP_USER_CHECK(!r.feasible.empty(), "train.plan: auto: no plan fits ", machine.name, " with ", world,
                 " rank(s): ", r.rejected.empty() ? std::string("no candidates") : r.rejected.front().why,
                 " (mop plan --search lists every candidate)");
  return r.feasible.front().plan.cfg;
}

Trainer::Trainer(RunStage stage, World& world, std::shared_ptr<const HeldCheckpoint> held)
    : cfg_(std::move(stage.cfg)),
      world_(world),
      growth_(std::move(stage.growth)),
      stage_(stage.stage),
      held_in_(std::move(held)) {
  build();
}

Trainer::Trainer(const Config& cfg, World& world, std::shared_ptr<const HeldCheckpoint> held)
    : Trainer(start_stage(cfg, world, held.get()), world, held) {}

Trainer::Trainer(const Config& cfg, World& world, const Machine& machine)
    : cfg_(cfg), world_(world), machine_(machine) {
  build();
}

Trainer::~Trainer() = default;

StepMetrics Trainer::step_once() {
  StepMetrics sm;
  train_step(sm);
  return sm;
}

void Trainer::build() {
  MOP_USER_CHECK(!cfg_.data.paths.empty(), "data.paths: no training data given");
  MOP_USER_CHECK(world_.comm->all_equal(dump_config(cfg_)),
                 "the ranks were started with different configurations");

  // 1. The plan: every choice below comes from it (train.plan: auto searched for it).
  const Machine machine = machine_ ? *machine_ : run_machine(cfg_, world_);
  cfg_ = planned_config(cfg_, machine, world_.size);
  plan_ = make_plan(cfg_, machine, world_.size);
  if (plan_.pp > 1 && plan_.run.device != Device::CPU && world_.size > 1 && world_.is_root())
    spdlog::warn("parallel.pp {}: pipeline stages on GPUs send their activations over NCCL, which this version has "
                 "tested on CPU ranks and on one emulated GPU rank, not yet between GPUs", plan_.pp);

  // 2. Backend, side streams and parallel groups (attention: cp × dp, MoE: ep × dp).
  auto timed = std::make_unique<TimedOps>(make_ops(plan_.run.device, world_.local_rank));
  timed_ = timed.get();
  ops_ = std::move(timed);
  if (plan_.run.device != Device::CPU) {
    const MemoryInfo at_start = memory_info(plan_.run.device);
    device_used_at_start_ = at_start.total - at_start.free;
  }
  streams_ = std::make_unique<SideStreams>(plan_);
  groups_ = ParallelGroups::build(cfg_, world_, *ops_, streams_->comm_streams());
  if (world_.size > 1)  // tensor collectives count as communication in the step's time split
    groups_->wrap_tensor_comms([&](std::unique_ptr<Comm> c, const std::string& label) {
      return time_comm(std::move(c), *timed_, label);
    });
  slicer_ = std::make_unique<SequenceSlicer>(
      int(cfg_.train.micro_batch_size), int(cfg_.data.seq_len), plan_.cp, groups_->coord(Axis::Cp));

  // 3. Layout (this rank's experts), parameters.
  layout_ =
      ModelLayout::build(ModelDims::from(cfg_, groups_->coord(Axis::Ep), groups_->size(Axis::Ep)));
  // Pipeline stages: the parameters of this rank's segments only.
  MemKind mem = plan_.run.device == Device::CUDA ? MemKind::Device : MemKind::Host;
  const std::vector<bool> held = plan_.held_segments(world_.rank);
  if (plan_.parallel.sliced()) {  // parallel.shard: slice
    params_ = std::make_unique<ParamStore>(layout_, plan_.run.compute, plan_.run.grad, mem,
                                           param_slices(plan_.parallel, world_.rank, plan_.micro_batches), held);
  } else if (plan_.stream_grads) {  // optim.gradients: host (or auto, planned so)
    params_ = std::make_unique<ParamStore>(layout_, plan_.run.compute, plan_.run.grad, mem,
                                           PooledGrads{plan_.streamed_segments()}, held);
  } else {
    params_ = std::make_unique<ParamStore>(layout_, plan_.run.compute, plan_.run.grad, mem, true, held);
  }

  // 4. Data.
  loader_ = std::make_unique<TokenLoader>(make_loader_options(cfg_));
  MOP_USER_CHECK(cfg_.train.eval_interval == 0 || loader_->num_valid_windows() > 0,
                 "train.eval_interval: ", cfg_.train.eval_interval,
                 " needs held-out data; set data.valid_fraction > 0");

  // 5. Activations, as planned, allocated once.
  // Pipeline stages: a model per chunk of the rank's (interleaved: several), each over its segments
  // with its banks.
  const Axes cp{Axis::Cp}, ep{Axis::Ep};
  model_ = std::make_unique<ModelChunks>();
  for (int c = 0; c < plan_.pp_chunks; ++c) {
    TransformerOptions topt;
    topt.plan = plan_.stage_activation_options(world_.rank, c);
    topt.comms = {&groups_->data(cp),
                  groups_->side(CommKind::Ring, cp),
                  &groups_->data(ep),
                  &groups_->host(ep),
                  groups_->side(CommKind::Dispatch, ep),
                  groups_->side(CommKind::Combine, ep)};
    model_->add(std::make_unique<Transformer>(layout_, *params_, *ops_, topt));
    model_->at(c).allocate();
  }
  // The backend has now built its plans and workspaces for these shapes. Where they take more than
  // the plan estimated (the machine's workspace figures are a fit over two sizes), plan again with
  // what they take — the largest over the ranks, so all make the same plan — and the optimizer
  // state goes where there is room. Nothing allocated so far changes.
  if (plan_.run.device != Device::CPU) {
    double extra = double(ops_->workspace_bytes()) - double(plan_.memory_of_rank(world_.rank).workspaces);
    extra = groups_->world_host().all_reduce_host(extra, Comm::Op::Max);
    if (extra > 0) {
      Machine m = plan_.machine;
      m.device.workspace_bytes += extra;
      plan_ = make_plan(cfg_, m, world_.size);
      spdlog::info("plan: the backend's workspaces take {} more than the plan estimated; planned the "
                   "optimizer state again with them", format_bytes(extra));
    }
  }
  // This rank's samples of a step, cut to its cp rank's tokens, on the host.
  const BatchGeometry geometry{int(cfg_.train.micro_batch_size), plan_.local_seq,
                               plan_.micro_batches, plan_.dp, groups_->coord(Axis::Dp)};
  batches_ = std::make_unique<StepBatches>(
      *loader_, geometry,
      [this](const StepBatches::Read& read, int32_t* ids, int32_t* targets, int32_t* positions) {
        return slicer_->fill(read, ids, targets, positions);
      });
  if (plan_.run.device != Device::CPU)  // one micro-batch's ids/targets/positions on the GPU
    batch_dev_ = Buffer(MemKind::Device, 3 * size_t(geometry.micro_batch_tokens()) * sizeof(int32_t));

  // 6. Optimizer state where the plan put it; ZeRO owners from the plan.
  std::vector<bool> owned;
  if (plan_.parallel.zero1() || plan_.pp > 1)  // pipeline stages: the stage's parameters
    for (int p = 0; p < int(layout_.params.size()); ++p) owned.push_back(plan_.owns(world_.rank, p));
  optim_ = std::make_unique<Optimizer>(cfg_.optim, *params_, *ops_, plan_.state_on_host, owned);
  if (world_.size > 1) {  // each parameter's norm over the ranks whose pieces of it differ
    std::vector<Comm*> norm_comms;
    for (int p = 0; p < int(layout_.params.size()); ++p) {
      const Axes axes = plan_.parallel.norm_axes(p);
      norm_comms.push_back(groups_->mesh().size(axes) > 1 ? &groups_->host(axes) : nullptr);
    }
    optim_->set_distributed(std::move(norm_comms), &groups_->world_host());
  }

  // 7. The step's schedule runs this rank's step program: gradient sums, host pipeline; with every
  // parameter's state with the backend, its AdamW overlapped with the next forward on a stream of
  // its own.
  StepProgram program = make_step_program(plan_, world_.rank);
  std::unique_ptr<TimedOps> update_ops;
  if (program.shape.device_update_overlapped)
    update_ops = std::make_unique<TimedOps>(make_ops(plan_.run.device, world_.local_rank));
  schedule_ = std::make_unique<StepSchedule>(plan_, std::move(program), *model_, *params_, *optim_,
                                             *groups_, *timed_, std::move(update_ops));

  // 8. Weights.
  resume_or_init();

  check_plan_memory();
  const MemoryPlan& m = plan_.memory_of_rank(world_.rank);
  // The whole model's counts (layout_ holds this rank's experts only).
  const ModelLayout whole = ModelLayout::build(ModelDims::from(cfg_));
  spdlog::info("model: {} layers, {:.2f}M parameters ({:.2f}M active per token) | {} | data: {}",
               cfg_.model.num_layers, whole.num_params() / 1e6, whole.num_active_params() / 1e6,
               plan_.run.describe(), loader_->summary());
  spdlog::info("memory per rank: weights+grads {}, optimizer state {} + {} on the host, "
               "activations {}, backend workspaces {} = {} planned | batch: {} sequences × {} "
               "tokens per step, {} micro-batch(es) of {} per rank",
               format_bytes(double(m.weights + m.grads)),
               format_bytes(double(m.optimizer_state + m.host_grad_staging)),
               format_bytes(double(m.host_optimizer_state)), format_bytes(double(m.activations)),
               format_bytes(double(ops_->workspace_bytes())), format_bytes(double(planned_device_bytes())),
               cfg_.train.global_batch_size, cfg_.data.seq_len, plan_.micro_batches,
               cfg_.train.micro_batch_size);
  if (plan_.host_params > 0) {
    // The host engine is memory-bound; the machine's rates say how long the update takes. The
    // prediction is what would be exposed if nothing hid it.
    const HostSpec& h = plan_.machine.host;
    spdlog::info("optimizer state: {:.2f}M parameters on the host ({}), {:.2f}M on the {}; host "
                 "update ≈ {:.0f} ms per step at {:.1f} G params/s{}",
                 plan_.host_params / 1e6, format_bytes(double(m.host_optimizer_state) * 4 / 3),
                 (whole.num_params() - plan_.host_params) / 1e6, device_name(plan_.run.device),
                 1e3 * double(plan_.host_params) / h.adamw_one_pass, h.adamw_one_pass / 1e9,
                 cfg_.optim.overlap
                     ? fmt::format(" (new weights after ≈ {:.0f} ms with two passes), overlapped "
                                   "with the next forward",
                                   1e3 * double(plan_.host_params) / h.adamw_weights_pass)
                     : std::string(", not overlapped"));
  }
  const StepTime& t = plan_.time;
  spdlog::info("plan: predicted step {:.0f} ms ({} tokens/s, MFU {:.1f}%) on {}: {}{}", 1e3 * t.step,
               grouped(t.tokens_per_second(plan_)), 100 * t.mfu(plan_), plan_.machine.name,
               predicted_split(t.seconds), t.host_exposed > 0 ? fmt::format(" | host wait {:.0f} ms", 1e3 * t.host_exposed) : "");
  if (!plan_.machine.origin.empty()) spdlog::info("plan: machine description: {}", plan_.machine.origin);
  if (!cfg_.log.router_histogram.empty() && world_.is_root()) {
    // A path that cannot be written fails now, not after the run.
    const std::filesystem::path hist = cfg_.log.router_histogram;
    std::error_code ec;
    MOP_USER_CHECK(!std::filesystem::is_directory(hist, ec), "log.router_histogram: ",
                   hist.string(), " is a directory");
    ec.clear();  // a file that does not exist yet is what is asked for
    if (hist.has_parent_path()) std::filesystem::create_directories(hist.parent_path(), ec);
    MOP_USER_CHECK(!ec, "log.router_histogram: cannot create ", hist.parent_path().string(), ": ",
                   ec.message());
  }
  std::string metrics_path = cfg_.log.metrics_file.empty()
                                 ? cfg_.checkpoint.dir + "/metrics.jsonl"
                                 : cfg_.log.metrics_file;
  // The step's model FLOPs are those of all ranks: MFU is against the peak of all their GPUs.
  const double peak = plan_.run.device == Device::CUDA ? plan_.machine.device.peak_flops * world_.size : 0.0;
  metrics_ = std::make_unique<MetricsLog>(metrics_path, cfg_.train.steps, cfg_.log.interval,
                                          world_.is_root(), step_, peak, cfg_.log.tensorboard_dir,
                                          plan_.run.device);
  timed_->collect();  // setup work is not part of step 1
}

MemoryPlan Trainer::allocated_memory() const {
  MemoryPlan m;
  m.weights = params_->weight_bytes();
  m.grads = params_->grad_bytes();
  m.optimizer_state = optim_->native_state_bytes();
  m.host_optimizer_state = optim_->host_state_bytes();
  if (const HostPipeline* p = std::as_const(*schedule_).host_pipeline()) {
    m.host_grad_staging = p->device_staging_bytes();
    m.host_staging = p->host_staging_bytes();
  }
  m.host_staging += schedule_->host_bytes();
  m.activations = model_->planned_bytes();
  m.activations_by_component = model_->device_by_component();
  m.host_activations = model_->host_bytes();
  m.workspaces = ops_->workspace_bytes();
  m.batch = batch_dev_.bytes();
  m.comms = plan_.memory_of_rank(world_.rank).comms;  // inside NCCL: the plan's estimate
  return m;
}

// What the plan predicted must be what was allocated: exactly for every class the trainer sizes
// itself; the backend's workspaces (cuBLASLt, cuDNN plans) and the communicators' buffers are
// estimates on GPUs (0 on the CPU).
void Trainer::check_plan_memory() {
  const MemoryPlan want = plan_.memory_of_rank(world_.rank), got = allocated_memory();
  const std::pair<const char*, std::pair<size_t, size_t>> exact[] = {
      {"weights", {want.weights, got.weights}},
      {"gradients", {want.grads, got.grads}},
      {"optimizer state", {want.optimizer_state, got.optimizer_state}},
      {"host optimizer state", {want.host_optimizer_state, got.host_optimizer_state}},
      {"gradient staging", {want.host_grad_staging, got.host_grad_staging}},
      {"host staging", {want.host_staging, got.host_staging}},
      {"activations", {want.activations, got.activations}},
      {"host activations", {want.host_activations, got.host_activations}},
      {"batch", {want.batch, got.batch}}};
  for (const auto& [what, v] : exact) {
    MOP_CHECK(v.first == v.second, "the plan's ", what, " (", v.first, " bytes) differ from what the "
              "trainer allocated (", v.second, " bytes)");
  }
  if (plan_.run.device == Device::CPU) MOP_CHECK(got.workspaces == 0, "CPU workspaces");
}

size_t Trainer::planned_device_bytes() const {
  const MemoryPlan m = allocated_memory();
  return m.device_total();
}

void Trainer::resume_or_init() {
  std::optional<std::string> dir = resolve_resume_dir(cfg_);
  if (!dir && !cfg_.checkpoint.init_from.empty()) {
    // A new run from another checkpoint's weights: step 0, fresh optimizer state and data order.
    const std::string& src = cfg_.checkpoint.init_from;
    std::error_code ec;
    MOP_USER_CHECK(std::filesystem::is_directory(src, ec), "checkpoint.init_from: ", src, ": not found");
    // A step_N directory, or a checkpoint root (its latest complete checkpoint).
    std::optional<std::filesystem::path> from =
        is_complete_checkpoint(src) ? resolve_resume(src, ResumeMode::Path) : resolve_resume(src, ResumeMode::Auto);
    MOP_USER_CHECK(from.has_value(), "checkpoint.init_from: ", src, ": no complete checkpoint there");
    const std::string changed = config_key_differences(checkpoint_config(from->string()), cfg_, {"model.", "moe."});
    tokenizer_ = resolve_run_tokenizer(cfg_, from->string());
    optim_->init_weights(uint64_t(cfg_.train.seed));  // what the checkpoint lacks keeps its init
    load_checkpoint(from->string(), cfg_, *params_, *optim_, /*optim_state=*/false);
    optim_->set_updates(0);
    schedule_->broadcast_weights();
    spdlog::info("starting a new run from the weights of {}{}", from->string(),
                 changed.empty() ? std::string() : " with model changes: " + changed);
    return;
  }
  if (held_in_) {  // the next growth stage, from the state the last one held in memory
    tokenizer_ = held_in_->tokenizer;
    const auto t0 = std::chrono::steady_clock::now();
    const TrainerState st = load_held_checkpoint(*held_in_, cfg_, *params_, *optim_);
    held_in_.reset();
    schedule_->broadcast_weights();
    step_ = st.step;
    consumed_samples_ = st.consumed_samples;
    spdlog::info("continuing at step {} ({} samples consumed) from the state held in memory (loaded in {:.1f} s)",
                 step_, consumed_samples_, seconds_since(t0));
    return;
  }
  tokenizer_ = resolve_run_tokenizer(cfg_, dir);
  if (!dir) {
    optim_->init_weights(uint64_t(cfg_.train.seed));
    return;
  }
  // A resume continues the run the checkpoint belongs to, with the model it trained (init_std
  // only shapes a fresh start). A checkpoint that consumed no data (an import) starts one.
  const Config saved = checkpoint_config(*dir);
  Config now = cfg_;
  now.model.init_std = saved.model.init_std;
  const std::string changed = config_key_differences(saved, now, {"model.", "moe."});
  const Manifest manifest = read_manifest(*dir);
  const bool started = manifest.state.find("consumed_samples") &&
                       manifest.state.at("consumed_samples").as_int64() > 0;
  MOP_USER_CHECK(changed.empty() || !started, "resume from ", *dir, ": the model differs from the "
                 "checkpoint's: ", changed, ". A resume continues the checkpoint's run with its model; to "
                 "start a new run from these weights on purpose, set checkpoint.init_from: ", *dir,
                 " with a checkpoint.dir of its own");
  if (!changed.empty()) spdlog::warn("starting from {} (no data consumed yet) with model changes: {}", *dir, changed);
  TrainerState st = load_checkpoint(*dir, cfg_, *params_, *optim_, /*optim_state=*/true);
  schedule_->broadcast_weights();  // each rank loaded the state it owns
  MOP_USER_CHECK(st.step < cfg_.train.steps, "checkpoint ", *dir, " is at step ", st.step,
                 ", which is not before train.steps (", cfg_.train.steps, "); nothing to do. "
                 "Raise train.steps to continue training");
  // An imported checkpoint (no samples consumed yet) has no data order to continue.
  if (st.consumed_samples > 0 && st.data_fingerprint != loader_->fingerprint()) {
    const std::string what = config_key_differences(saved, cfg_, {"data.", "train.seed"});
    spdlog::warn("resuming from {}: {}; the data order will not continue where it stopped", *dir,
                 what.empty() ? "the data files' contents differ from the checkpoint's" : what);
  } else if (st.consumed_samples > 0 && st.seed != uint64_t(cfg_.train.seed)) {
    spdlog::warn("resuming from {}: train.seed {} → {}", *dir, st.seed, cfg_.train.seed);
  }
  step_ = st.step;
  consumed_samples_ = st.consumed_samples;
  last_saved_step_ = step_;
  spdlog::info("resumed from {} at step {} ({} samples consumed)", *dir, step_, consumed_samples_);
}

Batch Trainer::micro_batch(int m) {
  const BatchGeometry& g = batches_->geometry();
  const int64_t T = g.micro_batch_tokens();
  const StepBatches::HostMicroBatch host = batches_->micro_batch(m);
  Batch batch;
  batch.batch = g.micro_batch_size;
  batch.seq = g.local_seq;
  batch.ids = Tensor(host.ids, DType::I32, {T});
  batch.targets = Tensor(host.targets, DType::I32, {T});
  batch.positions = Tensor(host.positions, DType::I32, {T});
  if (batch_dev_.data()) {
    int32_t* dev = static_cast<int32_t*>(batch_dev_.data());
    Tensor* parts[3] = {&batch.ids, &batch.targets, &batch.positions};
    for (int i = 0; i < 3; ++i) {
      Tensor d(dev + i * T, DType::I32, {T}, plan_.run.device);
      ops_->copy(d, *parts[i]);
      *parts[i] = d;
    }
  }
  return batch;
}

Trainer::StepLosses Trainer::compute_gradients() {
  const int64_t valid = batches_->fill_step(consumed_samples_);
  // Over a stage's ranks: every pipeline stage reads the same batches.
  step_valid_tokens_ = int64_t(groups_->host(kAttentionAxes).all_reduce_host(double(valid), Comm::Op::Sum));
  const float ce_scale = step_valid_tokens_ > 0 ? float(1.0 / double(step_valid_tokens_)) : 0.0f;
  if (step_valid_tokens_ == 0)
    spdlog::warn("step {}: every target of the step is masked; only the router losses train",
                 step_ + 1);
  // Router losses are averaged over the step's micro-batches on every data-parallel rank.
  const float aux_scale = 1.0f / float(plan_.micro_batches * plan_.dp);
  const LossTerms sums = schedule_->gradients([this](int m) { return micro_batch(m); }, ce_scale, aux_scale);
  return {step_valid_tokens_ > 0 ? sums.ce_sum / double(step_valid_tokens_) : 0.0, sums.aux, sums.z};
}

void Trainer::train_step(StepMetrics& sm) {
  // The root traces; an emulated rank (whichever) traces itself.
  const bool profile = cfg_.train.profile_step == step_ + 1 && (world_.is_root() || world_.standin);
  HostPipeline* host = schedule_->host_pipeline();
  if (profile) {
    timed_->start_trace();
    if (host) host->set_tracing(true);
  }
  double t0 = now_seconds();
  double lr = learning_rate(cfg_.optim, step_, cfg_.train.steps);
  StepLosses losses = compute_gradients();
  sm.loss = losses.loss, sm.aux_loss = losses.aux, sm.z_loss = losses.z;
  sm.lr = lr;
  sm.tokens = cfg_.train.global_batch_size * cfg_.data.seq_len;

  std::string bad;
  if (!std::isfinite(sm.loss) || !std::isfinite(sm.aux_loss) || !std::isfinite(sm.z_loss)) {
    bad = "the loss is " + std::to_string(sm.loss);
  } else {
    timed_->force_category(OpCategory::Optimizer);
    timed_->set_phase(StepPhase::Optimizer);
    const StepReport rep = schedule_->apply(float(lr));
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
    schedule_->drain();  // the step's host updates belong to its trace
    std::vector<TraceEvent> events = timed_->stop_trace();
    if (host) {
      for (TraceEvent& e : host->take_trace(timed_->trace_host_start())) events.push_back(std::move(e));
      host->set_tracing(false);
    }
    std::string path = cfg_.checkpoint.dir + "/trace_step_" + std::to_string(step_) + ".json";
    write_chrome_trace(path, events);
    spdlog::info("wrote {} ({} events)", path, events.size());
  }
  sm.times = timed_->collect();
  sm.update_stream_seconds = schedule_->update_stream_seconds();
  sm.offload = schedule_->take_host_stats();
  sm.step_seconds = now_seconds() - t0;
  sm.model_flops = model_flops_per_token(cfg_) * double(sm.tokens);
}

double Trainer::evaluate() {
  double ce = 0, valid = 0;
  for (int64_t i = 0; i < cfg_.train.eval_batches; ++i) {
    valid += double(batches_->fill_eval(i));
    schedule_->evaluate(micro_batch(0));
    ce += model_->take_losses().ce_sum;
  }
  // The cross-entropy over every rank (pipeline stages: the last one's); the tokens over a stage's
  // ranks (every stage reads the same batches).
  ce = groups_->world_host().all_reduce_host(ce, Comm::Op::Sum);
  valid = groups_->host(kAttentionAxes).all_reduce_host(valid, Comm::Op::Sum);
  return valid > 0 ? ce / valid : 0.0;
}

TrainerState Trainer::drained_state() {
  schedule_->drain();  // host-placed master weights and moments are final
  TrainerState st;
  st.step = step_;
  st.consumed_samples = consumed_samples_;
  st.optimizer_updates = optim_->updates();
  st.seed = uint64_t(cfg_.train.seed);
  st.data_fingerprint = loader_->fingerprint();
  if (!growth_.empty()) st.growth_stage = stage_ + 1, st.growth_stages = growth_.stages();
  return st;
}

void Trainer::save_checkpoint() {
  if (on_started_) std::exchange(on_started_, nullptr)();
  const TrainerState st = drained_state();
  std::string dir = mop::save_checkpoint(cfg_, *params_, *optim_, st, world_, groups_.get(),
                                         tokenizer_ ? &*tokenizer_ : nullptr);
  last_saved_step_ = step_;
  spdlog::info("saved checkpoint {}", dir);
  save_router_histogram();
  // At the end of a stage the checkpoint becomes the next stage's model.
  if (growth_.is_boundary(step_)) {
    if (world_.is_root())
      grow_checkpoint(dir, growth_options(cfg_, growth_, stage_ + 1));
    world_.comm->barrier();
  }
}

// The model counts the rows of this rank's tokens for every global expert, and each token is one
// rank's (dp × cp ranks hold distinct tokens; ep shards experts, not tokens): the world's sum is
// the run's. Sums of doubles are exact below 2^53 rows. Nothing is written before a step has run.
void Trainer::save_router_histogram() {
  if (cfg_.log.router_histogram.empty() || histogram_step_ == step_) return;
  histogram_step_ = step_;
  const std::vector<int64_t> local = model_->routed_counts();
  std::vector<double> sums(local.begin(), local.end());
  sums.push_back(double(model_->routed_tokens()));
  groups_->world_host().all_reduce_host(sums.data(), int(sums.size()), Comm::Op::Sum);
  RouterHistogram h;
  h.experts = layout_.dims.experts, h.top_k = layout_.dims.top_k;
  h.tokens = int64_t(sums.back());
  if (h.tokens == 0 || !world_.is_root()) return;
  for (size_t i = 0; i + 1 < sums.size(); ++i) h.counts.push_back(int64_t(sums[i]));
  write_router_histogram(cfg_.log.router_histogram, h);
}

bool Trainer::stop_requested() {
  const double sig = double(pending_stop_signal());
  stop_signal_ = int(groups_->world_host().all_reduce_host(sig, Comm::Op::Max));
  return stop_signal_ != 0;
}

void Trainer::run() {
  // SIGTERM, SIGINT and SIGUSR1 (Slurm's usual preemption notice, --signal=USR1@N) all stop the
  // run at the next step boundary with a checkpoint, so that a requeue resumes.
  StopSignals signals;
  // What an interrupted save or prune left behind (the run holds the directory from here on).
  if (world_.is_root())
    for (const auto& gone : remove_checkpoint_leftovers(cfg_.checkpoint.dir))
      spdlog::warn("removed {}: left by an interrupted checkpoint save or prune", gone.string());
  spdlog::info("training steps {} → {}", step_ + 1, cfg_.train.steps);
  // A signal during start-up: nothing new to save.
  const bool stopped_early = step_ < cfg_.train.steps && stop_requested();
  if (stopped_early) spdlog::warn("stop requested by signal before step {}; exiting", step_ + 1);
  while (!stopped_early && step_ < cfg_.train.steps) {
    StepMetrics sm;
    train_step(sm);
    if (cfg_.train.eval_interval > 0 &&
        (step_ % cfg_.train.eval_interval == 0 || step_ == cfg_.train.steps))
      sm.val_loss = evaluate();
    metrics_->record(sm);
    if (step_ == 1 && plan_.run.device != Device::CPU) {
      // After a whole step every backend plan and workspace exists: compare with the plan.
      const MemoryInfo now = memory_info(plan_.run.device);
      const double used = double(now.total - now.free - device_used_at_start_);
      const double planned = double(planned_device_bytes()), predicted = double(plan_.memory.device_total());
      spdlog::info("device memory: planned {} (the plan predicted {}), in use after step 1 {} "
                   "({:+.1f}% of planned, {:+.1f}% of predicted)",
                   format_bytes(planned), format_bytes(predicted), format_bytes(used),
                   100.0 * (used - planned) / planned, 100.0 * (used - predicted) / predicted);
      spdlog::info("host memory: the plan's pinned buffers {}, peak resident after step 1 {}",
                   format_bytes(double(plan_.memory.host_total())),
                   format_bytes(double(peak_resident_bytes())));
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
    if (growth_.is_boundary(step_)) {
      // The next stage's Trainer starts from the boundary checkpoint when one was due (it is
      // grown), else — on one rank — from the state held in host memory, which spares writing
      // and reading the model twice; several ranks go through the checkpoint.
      grew_at_ = std::chrono::steady_clock::now();
      if (last_saved_step_ != step_ && world_.size == 1) {
        held_out_ = std::make_shared<HeldCheckpoint>(hold_checkpoint(cfg_, *params_, *optim_, drained_state()));
        held_out_->tokenizer = tokenizer_;
        spdlog::info("growth: step {}: the state ({}) staged to host memory in {:.1f} s", step_,
                     format_bytes(double(held_out_->bytes())), seconds_since(grew_at_));
      } else if (last_saved_step_ != step_) {
        save_checkpoint();
      }
      grew_ = true;
      break;
    }
  }
  if (step_ == cfg_.train.steps && cfg_.checkpoint.save_final && last_saved_step_ != step_)
    save_checkpoint();
  schedule_->drain();  // the weights and the state are final for whoever reads them next
  save_router_histogram();
  if (on_started_) std::exchange(on_started_, nullptr)();  // a run that saved no checkpoint
}

}  // namespace mop
