// `mop emulate` (see emulate.h).
#include "cli/emulate.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "ckpt/json.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/format.h"
#include "data/prepare_data.h"
#include "parallel/mesh.h"
#include "parallel/routing_model.h"
#include "parallel/standin_comm.h"
#include "plan/plan.h"
#include "runtime/runtime.h"
#include "train/trainer.h"

namespace mop {

namespace {

// A directory of its own under $TMPDIR for the random tokens and the run's files, removed after.
struct ScratchDir {
  std::filesystem::path path;
  ScratchDir() {
    std::string t = (std::filesystem::temp_directory_path() / "mop-emulate-XXXXXX").string();
    MOP_USER_CHECK(mkdtemp(t.data()) != nullptr, "mop emulate: cannot create a directory under ",
                   std::filesystem::temp_directory_path().string(), " (TMPDIR)");
    path = t;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// Categories whose time grows with the layers (the LM head, the embedding and the rest do not).
bool scales_with_layers(OpCategory c) {
  return c == OpCategory::Attention || c == OpCategory::DenseGemm || c == OpCategory::Experts ||
         c == OpCategory::RouterPermute || c == OpCategory::Optimizer || c == OpCategory::Communication;
}

// What one emulated rank measured.
struct Measured {
  int rank = 0;
  Plan plan;  // the trainer's (planned again where the backend's workspaces took more)
  MemoryPlan allocated;
  double device_in_use = 0;  // the device's own count after each step, the most (GPU runs)
  double host_resident = 0;  // the process's peak resident memory
  OpTimes times;             // per step, mean over the timed steps
  double step = 0;           // seconds per step, the same mean
  int timed_steps = 0;
};

// The config the rank runs: the plan's own (every choice written in) with the routing's data, no
// checkpoints or evaluation, `steps` steps and, with `layers`, that many layers whose optimizer
// state and gradients go where the whole model's go.
Config emulated_config(const Plan& full, const std::string& dir, int steps, int layers) {
  Config c = full.cfg;
  c.train.plan = "config";
  c.train.steps = steps;
  c.train.eval_interval = 0;
  c.train.profile_step = 0;
  c.train.exit_interval = 0;
  c.checkpoint.dir = dir + "/ckpt";
  c.checkpoint.resume = "none";
  c.checkpoint.init_from.clear();
  c.checkpoint.interval = 0;
  c.checkpoint.save_final = false;
  c.checkpoint.overwrite = true;
  c.log.metrics_file = dir + "/metrics.jsonl";
  c.log.tensorboard_dir.clear();
  c.moe.growth.clear();
  c.moe.growth_from = 0;
  c.data.paths = {dir + "/tokens"};
  c.data.format = "auto";
  c.data.tokenizer.clear();
  c.data.eos_id = -1;
  c.data.valid_fraction = 0;
  if (layers > 0 && layers < c.model.num_layers) {
    c.model.num_layers = layers;
    // The whole model's placement for the layers kept: where most of its segments keep their
    // optimizer state (auto would put more of a shallower model's on the GPU).
    size_t on_host = 0;
    for (bool h : full.segment_on_host) on_host += h;
    c.optim.state_placement = 2 * on_host > full.segment_on_host.size() ? "host" : "gpu";
    c.optim.gradients = full.stream_grads ? "host" : "gpu";
  }
  return c;
}

Measured run_rank(const Config& cfg, const Machine& machine, int world, int rank, const RoutingModel& routing,
                  int steps) {
  auto job = std::make_shared<StandInJob>();
  job->rank = rank, job->size = world;
  const int64_t k = cfg.moe.top_k;
  job->expert_counts = [&routing, k](int layer, int, int64_t rows, int64_t, int32_t* out) {
    routing.counts(layer, rows / k, out);
  };
  World w = standin_world(job, machine.gpus_per_node);
  Trainer trainer(cfg, w, machine);
  Measured m;
  m.rank = rank;
  m.plan = trainer.plan();
  // Pipeline stages: the prediction for this rank's stage, at its position (the plan's step is the
  // slowest stage's). Its
  // wait for the other stages is in communication, which the report takes from the plan: the
  // stand-ins' messages arrive at once.
  if (m.plan.pp > 1) m.plan.time = predict_step_time(m.plan, rank);
  m.allocated = trainer.allocated_memory();
  const Device dev = trainer.plan().run.device;
  for (int s = 1; s <= steps; ++s) {
    const StepMetrics sm = trainer.step_once();
    if (dev != Device::CPU) {
      const MemoryInfo now = memory_info(dev);
      m.device_in_use = std::max(m.device_in_use, double(now.total - now.free - trainer.device_used_at_start()));
    }
    if (s == 1 && steps > 1) continue;  // the warm-up: plans, workspaces, first touches
    for (int c = 0; c < kNumOpCategories; ++c) m.times.seconds[size_t(c)] += sm.times.seconds[size_t(c)];
    m.step += sm.step_seconds;
    ++m.timed_steps;
  }
  for (double& x : m.times.seconds) x /= m.timed_steps;
  m.step /= m.timed_steps;
  m.host_resident = double(peak_resident_bytes());
  return m;
}

double gib(double b) { return b / double(1ull << 30); }

// The step composed of what was measured (compute, host waits) and what the plan's link model
// says the collectives hold up: the stand-ins' own copies replaced by the plan's exposed time.
double composed_step(const Measured& m, const Plan& p) {
  const size_t comm = size_t(OpCategory::Communication);
  return m.step - m.times.seconds[comm] + p.time.seconds[comm];
}

Json rank_json(const Measured& m, const Plan& p) {
  Json j = Json::object();
  j["rank"] = m.rank;
  if (p.pp > 1) j["pipeline_stage"] = p.stage_of(m.rank);
  Json mem = Json::object();
  const MemoryPlan want = p.memory_of_rank(m.rank);
  mem["device_planned_gib"] = gib(double(want.device_total()));
  mem["device_allocated_gib"] = gib(double(m.allocated.device_total()));
  mem["device_in_use_gib"] = gib(m.device_in_use);
  mem["device_comm_buffers_gib"] = gib(double(want.comms));
  mem["host_planned_gib"] = gib(double(want.host_total()));
  mem["host_allocated_gib"] = gib(double(m.allocated.host_total()));
  mem["host_peak_resident_gib"] = gib(m.host_resident);
  j["memory"] = std::move(mem);
  Json cats = Json::object();
  for (int c = 0; c < kNumOpCategories; ++c) {
    Json e = Json::object();
    e["predicted_ms"] = 1e3 * p.time.seconds[size_t(c)];
    e["measured_ms"] = 1e3 * m.times.seconds[size_t(c)];
    e["scales_with_layers"] = scales_with_layers(OpCategory(c));
    cats[op_category_name(OpCategory(c))] = std::move(e);
  }
  j["categories"] = std::move(cats);
  const double step = composed_step(m, p), tokens = double(p.tokens_per_step());
  j["step_measured_ms"] = 1e3 * m.step;
  j["step_composed_ms"] = 1e3 * step;
  j["step_predicted_ms"] = 1e3 * p.time.step;
  j["tokens_per_s_per_gpu"] = tokens / step / p.world;
  j["tokens_per_s_per_gpu_predicted"] = p.time.tokens_per_second(p) / p.world;
  j["collectives_total_ms"] = 1e3 * p.time.comm_total;
  j["collectives_exposed_ms"] = 1e3 * p.time.seconds[size_t(OpCategory::Communication)];
  j["timed_steps"] = m.timed_steps;
  return j;
}

std::string pct(double got, double want) {
  if (want <= 0) return "";
  char b[32];
  std::snprintf(b, sizeof b, "%+.1f%%", 100.0 * (got - want) / want);
  return b;
}

std::string rank_text(const Measured& m, const Plan& p, const std::string& title) {
  std::string out = title + "\n";
  const MemoryPlan want = p.memory_of_rank(m.rank);
  char line[512];
  const bool gpu = p.run.device != Device::CPU;
  out += "  " + std::string(gpu ? "device" : "memory (CPU backend)") + ": planned " +
         format_bytes(double(want.device_total())) + ", allocated " + format_bytes(double(m.allocated.device_total()));
  if (gpu)
    out += ", in use " + format_bytes(m.device_in_use) + " per the device (with NCCL's buffers, " +
           format_bytes(double(want.comms)) + " in the plan and not made here: " +
           pct(m.device_in_use + double(want.comms), double(want.device_total())) + " of planned)";
  out += "\n  host: planned " + format_bytes(double(want.host_total())) + ", allocated " +
         format_bytes(double(m.allocated.host_total())) + ", peak resident " + format_bytes(m.host_resident) + "\n";
  out += "  per step, ms       predicted   measured\n";
  for (int c = 0; c < kNumOpCategories; ++c) {
    const OpCategory cat = OpCategory(c);
    const double pr = 1e3 * p.time.seconds[size_t(c)], me = 1e3 * m.times.seconds[size_t(c)];
    std::snprintf(line, sizeof line, "  %-17s %10.1f %10.1f %8s%s\n", op_category_name(cat), pr, me,
                  cat == OpCategory::Communication ? "" : pct(me, pr).c_str(),
                  cat == OpCategory::Communication ? "  (measured: the stand-ins' copies; the plan's link model "
                                                     "is used below)"
                                                   : "");
    out += line;
  }
  const double step = composed_step(m, p);
  std::snprintf(line, sizeof line,
                "  collectives (link model): %.1f ms in all, %.1f ms exposed\n"
                "  step: measured %.1f ms with stand-ins; composed %.1f ms (predicted %.1f, %s) = %s tokens/s per GPU "
                "(predicted %s)\n",
                1e3 * p.time.comm_total, 1e3 * p.time.seconds[size_t(OpCategory::Communication)], 1e3 * m.step,
                1e3 * step, 1e3 * p.time.step, pct(step, p.time.step).c_str(),
                grouped(double(p.tokens_per_step()) / step / p.world).c_str(),
                grouped(p.time.tokens_per_second(p) / p.world).c_str());
  out += line;
  return out;
}

// Why rank `rank` of plan `p` does not fit this machine ("" when it does): its host memory (with
// the device's on a CPU run) against what this process may use, its device memory against the
// GPU's free memory.
std::string misfit_here(const Plan& p, int rank) {
  const MemoryPlan m = p.memory_of_rank(rank);
  const MemoryInfo host = memory_info(Device::CPU);
  double host_need = double(m.host_total());
  if (p.run.device == Device::CPU) host_need += double(m.device_total());
  if (host_need > double(host.free))
    return "needs " + format_bytes(host_need) + " of host memory and this machine has " +
           format_bytes(double(host.free)) + " free";
  if (p.run.device != Device::CPU && gpu_count() > 0) {
    const MemoryInfo dev = memory_info(p.run.device);
    if (double(m.device_total()) > double(dev.free))
      return "needs " + format_bytes(double(m.device_total())) + " of device memory and this GPU has " +
             format_bytes(double(dev.free)) + " free";
  }
  return "";
}

// The emulated config with `layers` layers, planned.
Plan plan_with_layers(const Plan& full, const Machine& machine, int world, const std::string& dir, int steps,
                      int layers) {
  return make_plan(emulated_config(full, dir, steps, layers), machine, world, /*check_fit=*/false);
}

// "pipeline stage 3 of 12 (segments 5–9, 30–34), " for a rank of a pipeline, else "".
std::string stage_text(const Plan& p, int rank) {
  if (p.pp == 1) return "";
  const int stage = p.stage_of(rank);
  std::string runs;
  for (int c = 0; c < p.pp_chunks; ++c) {
    const int v = c * p.pp + stage;
    const int a = p.split.first[size_t(v)], b = p.split.first[size_t(v + 1)] - 1;
    runs += (c ? ", " : "") + std::to_string(a) + (b > a ? "–" + std::to_string(b) : "");
  }
  return "pipeline stage " + std::to_string(stage) + " of " + std::to_string(p.pp) + " (segments " + runs + "), ";
}

void write_random_tokens(const Config& c) {
  // Uniformly random tokens: a few steps' worth (the loader reuses them in later epochs).
  RandomTokensOptions r;
  r.output = c.data.paths.front();
  const int64_t seq = c.data.seq_len + 1;
  r.num_tokens = std::min<int64_t>(seq * (c.train.global_batch_size + 1), int64_t(1) << 28);
  r.vocab_size = c.model.vocab_size;
  r.seed = uint64_t(c.train.seed);
  prepare_random_tokens(r);
}

}  // namespace

RankTimes time_rank(const Config& cfg, const Machine& machine, int world, int rank, int steps) {
  const Plan full = make_plan(planned_config(cfg, machine, world), machine, world);
  ScratchDir scratch;
  const Config ecfg = emulated_config(full, scratch.path.string(), steps, 0);
  const Plan eplan = make_plan(ecfg, machine, world, /*check_fit=*/false);
  const std::string why = misfit_here(eplan, rank);
  MOP_USER_CHECK(why.empty(), "rank ", rank, " of ", cfg.model.num_layers, " layers ", why);
  write_random_tokens(ecfg);
  const RoutingModel balanced = RoutingModel::parse("balanced", full.dims.experts, full.dims.top_k);
  const Measured m = run_rank(ecfg, machine, world, rank, balanced, steps);
  return {m.plan, m.times, m.step};
}

int cmd_emulate(const EmulateArgs& args) {
  MOP_USER_CHECK(args.steps >= 1 && args.steps <= 1000, "--steps ", args.steps, ": 1 to 1000");
  Config cfg = load_config(args.config, args.overrides);
  // The rank's own log (the trainer's lines) on stderr; the report alone on stdout.
  if (!spdlog::get("mop-emulate")) spdlog::set_default_logger(spdlog::stderr_color_mt("mop-emulate"));
  spdlog::set_level(spdlog::level::from_str(cfg.log.level));
  // The job's layout where the config gives none for its ranks (as mop plan chooses it).
  const PlanJob job = plan_job(cfg, args.machine, args.gpus, args.nodes);
  const Machine& machine = job.target.machine;
  const int world = job.target.world;
  MOP_USER_CHECK(args.rank >= 0 && args.rank < world, "--rank ", args.rank, ": the job has ", world,
                 " rank(s), 0 to ", world - 1);
  MOP_USER_CHECK(args.layers >= 0 && args.layers <= cfg.model.num_layers, "--layers ", args.layers, ": 1 to ",
                 cfg.model.num_layers, " (model.num_layers)");
  // The whole job's plan: refused here, before anything is allocated, when it does not fit.
  const Plan full = make_plan(job.cfg, machine, world);
  const RoutingModel routing = RoutingModel::parse(args.routing, full.dims.experts, full.dims.top_k);
  const int layers = args.layers > 0 ? args.layers : int(cfg.model.num_layers);
  const int64_t moe_layers = layers - full.dims.first_dense;
  MOP_USER_CHECK(routing.layers() == 0 || routing.layers() >= moe_layers, "--routing ", args.routing, ": ",
                 routing.layers(), " MoE layers, the emulated model has ", moe_layers);

  ScratchDir scratch;
  const std::string dir = scratch.path.string();
  const Config ecfg = emulated_config(full, dir, args.steps, layers);
  // Pipeline stages keep their number and chunks: every virtual stage needs a segment.
  const int virtual_stages = full.pp * full.pp_chunks;
  MOP_USER_CHECK(full.pp == 1 || layers + 2 >= virtual_stages, "--layers ", layers, ": the pipeline's ", full.pp,
                 " stages × ", full.pp_chunks, " chunks need at least ", virtual_stages - 2,
                 " layers (a virtual stage runs at least one segment: the embedding, a layer or the head)");
  const Plan eplan = make_plan(ecfg, machine, world, /*check_fit=*/false);
  // Refused before anything is allocated when this machine cannot hold the rank: with the most
  // layers that fit named.
  if (const std::string why = misfit_here(eplan, args.rank); !why.empty()) {
    int fits = 0;
    for (int l = layers - 1; l >= std::max(1, virtual_stages - 2) && fits == 0; --l)
      if (misfit_here(plan_with_layers(full, machine, world, dir, args.steps, l), args.rank).empty()) fits = l;
    throw_user_error("rank ", args.rank, " with ", layers, " of its ", cfg.model.num_layers, " layers ", why,
                     fits > 0 ? ": emulate it with --layers " + std::to_string(fits) + " (the most that fit here)"
                              : full.pp > 1 ? ": not even the fewest layers its pipeline needs (" +
                                                  std::to_string(std::max(1, virtual_stages - 2)) + ") fit here"
                                            : std::string(": not even one layer fits here"));
  }
  MOP_USER_CHECK(full.run.device == Device::CPU || gpu_count() > 0, "the plan runs on ", machine.device.name,
                 " GPUs and this machine has no GPU: emulate on one, or plan a CPU job (--set train.device=cpu)");
  MOP_USER_CHECK(args.trace.empty() || std::ofstream(args.trace, std::ios::app).good(), "--trace ", args.trace,
                 ": cannot write to it");
  write_random_tokens(ecfg);
  const Mesh mesh = Mesh::of(eplan.cfg, world);
  std::vector<int> ranks = {args.rank};
  // Under a skewed routing, also the rank whose experts receive the most.
  int loaded = args.rank;
  if (args.routing != "balanced" && eplan.ep > 1) {
    const int64_t tokens = int64_t(ecfg.train.micro_batch_size) * eplan.local_seq;
    const int q = RoutingModel::most_loaded(routing, eplan.ep, tokens);
    MeshCoord at;  // in the rank's pipeline stage
    at[Axis::Pp] = mesh.coord(args.rank)[Axis::Pp];
    at[Axis::Ep] = q;
    loaded = mesh.rank_of(at, Axis::Ep);
    if (loaded != args.rank) ranks.push_back(loaded);
  }
  std::vector<Measured> measured;
  for (int r : ranks) {
    // --trace: the rank asked for traces its last step (the trainer writes it into the scratch
    // checkpoint directory); the most-loaded rank runs untraced.
    Config rcfg = ecfg;
    if (!args.trace.empty() && r == args.rank) {
      rcfg.train.profile_step = args.steps;
      std::filesystem::create_directories(rcfg.checkpoint.dir);
    }
    measured.push_back(run_rank(rcfg, machine, world, r, routing, args.steps));
    if (rcfg.train.profile_step > 0) {
      const std::string written =
          rcfg.checkpoint.dir + "/trace_step_" + std::to_string(args.steps) + ".json";
      std::error_code ec;
      std::filesystem::copy_file(written, args.trace,
                                 std::filesystem::copy_options::overwrite_existing, ec);
      MOP_USER_CHECK(!ec, "--trace ", args.trace, ": cannot write it (", ec.message(), ")");
    }
  }

  const MeshCoord at = mesh.coord(args.rank);
  // The whole model's prediction for this rank (pipeline stages: its own stage's, as its rows).
  const StepTime full_time = full.pp > 1 && layers < cfg.model.num_layers ? predict_step_time(full, args.rank) : full.time;
  if (args.json) {
    Json j = Json::object();
    j["machine"] = machine.name;
    j["world"] = world;
    Json notes = Json::array();
    for (const std::string& n : job.target.notes) notes.push_back(n);
    j["notes"] = std::move(notes);
    j["mesh"] = mesh.str();
    j["routing"] = routing.describe();
    j["layers"] = layers;
    j["layers_total"] = cfg.model.num_layers;
    j["steps"] = args.steps;
    Json rs = Json::array();
    for (const Measured& m : measured) {
      Json r = rank_json(m, m.plan);
      if (m.rank == loaded && eplan.ep > 1)
        r["routing_load"] =
            RoutingModel::load(routing, mesh.coord(m.rank)[Axis::Ep], eplan.ep,
                               int64_t(ecfg.train.micro_batch_size) * eplan.local_seq);
      rs.push_back(std::move(r));
    }
    j["ranks"] = std::move(rs);
    if (layers < cfg.model.num_layers) {
      Json f = Json::object();
      f["device_gib"] = gib(double(full.memory_of_rank(args.rank).device_total()));
      f["host_gib"] = gib(double(full.memory_of_rank(args.rank).host_total()));
      f["step_ms"] = 1e3 * full_time.step;
      f["tokens_per_s_per_gpu"] = full_time.tokens_per_second(full) / world;
      j["plan_full_depth"] = std::move(f);
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "emulated rank %d of %d on %s (%s; this rank: %sattention dp %d cp %d, MoE edp %d ep %d), %d "
      "of %lld layers, "
      "routing %s, %d step(s), the first a warm-up\n",
      args.rank, world, machine.name.c_str(), mesh.str().c_str(), stage_text(eplan, args.rank).c_str(),
      at[Axis::Dp], at[Axis::Cp], at[Axis::Edp], at[Axis::Ep], layers, (long long)cfg.model.num_layers,
      routing.describe().c_str(), args.steps);
  for (const std::string& n : job.target.notes) std::printf("note: %s\n", n.c_str());
  for (const Measured& m : measured) {
    std::string title = m.rank == args.rank ? "rank " + std::to_string(m.rank)
                                            : "the most-loaded rank, " + std::to_string(m.rank);
    if (m.rank == loaded && eplan.ep > 1 && args.routing != "balanced") {
      char b[96];
      std::snprintf(b, sizeof b, " (its experts receive %.2f× the balanced share)",
                    RoutingModel::load(routing, mesh.coord(m.rank)[Axis::Ep], eplan.ep,
                                       int64_t(ecfg.train.micro_batch_size) * eplan.local_seq));
      title += b;
    }
    std::printf("%s", rank_text(m, m.plan, title).c_str());
  }
  if (layers < cfg.model.num_layers) {
    const MemoryPlan f = full.memory_of_rank(args.rank);
    std::printf("the plan at full depth (%lld layers), rank %d: device %.2f GiB, host %.2f GiB, step %.1f ms, "
                "%s tokens/s per GPU. Memory and the categories attention, dense GEMMs, experts, router/permute, "
                "optimizer and communication scale with the layers; LM head+loss and other do not.\n",
                (long long)cfg.model.num_layers, args.rank, gib(double(f.device_total())), gib(double(f.host_total())),
                1e3 * full_time.step, grouped(full_time.tokens_per_second(full) / world).c_str());
  }
  return 0;
}

}  // namespace mop
