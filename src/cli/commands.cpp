// The subcommands: train, validate, plan, prepare-data, generate.
#include "cli/commands.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/dir_lock.h"
#include "ckpt/file_io.h"
#include "cli/forward_memory.h"
#include "cli/text_codec.h"
#include "config/config.h"
#include "core/rng.h"
#include "data/loader.h"
#include "data/prepare_data.h"
#include "parallel/launch.h"
#include "plan/program.h"
#include "plan/report.h"
#include "plan/search.h"
#include "runtime/runtime.h"
#include "train/checkpointing.h"
#include "train/growth.h"
#include "train/trainer.h"

namespace mop {

namespace {

std::string human_count(double n) {
  char buf[32];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else if (n >= 1e3) std::snprintf(buf, sizeof buf, "%.1fK", n / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

}  // namespace

namespace {

// What of another run `cfg`'s checkpoint directory holds that a resume would continue ("" when
// nothing): checkpoints, or the `latest` pointer. (A directory with only a metrics file, a
// benchmark's, is started over.)
std::string existing_run(const Config& cfg) {
  const std::filesystem::path dir = cfg.checkpoint.dir;
  std::error_code ec;
  const std::vector<CheckpointInfo> all = list_checkpoints(dir);
  if (!all.empty())
    return std::to_string(all.size()) + " checkpoint(s), the newest " + all.back().dir.filename().string();
  if (std::filesystem::exists(dir / "latest", ec)) return "a latest pointer";
  return "";
}

}  // namespace

int cmd_train(const TrainArgs& args, World& world) {
  std::vector<std::string> overrides = args.overrides;
  if (!args.resume.empty()) overrides.push_back("checkpoint.resume=" + args.resume);
  if (args.profile_step > 0) overrides.push_back("train.profile_step=" + std::to_string(args.profile_step));
  if (!args.machine.empty()) overrides.push_back("train.machine=" + args.machine);
  Config cfg = load_config(args.config, overrides);
  setup_logging(cfg.log, world.rank, world.size);
  spdlog::info("mop {} | {} rank(s) | config {}", MOP_VERSION, world.size, args.config);
  // The run holds its directory from here to its exit; a fresh run does not replace another
  // run's checkpoints unless asked to.
  DirLock lock;
  const bool replace = world.is_root() && cfg.checkpoint.resume == "none" && cfg.checkpoint.overwrite;
  if (world.is_root()) {
    lock = DirLock::acquire(cfg.checkpoint.dir);
    if (cfg.checkpoint.resume == "none" && !cfg.checkpoint.overwrite) {
      const std::string run = existing_run(cfg);
      MOP_USER_CHECK(run.empty(), "checkpoint.dir ", cfg.checkpoint.dir, " already holds a run (", run,
                     ") and checkpoint.resume is none: continue it with checkpoint.resume: auto, give "
                     "this run a checkpoint.dir of its own, or set checkpoint.overwrite: true to replace it");
    }
  }
  const int64_t final_experts = cfg.moe.num_experts, total_steps = cfg.train.steps;
  const RunOutcome out = train_run(std::move(cfg), world, [&](Trainer& trainer, bool first) {
    if (!first) return;
    if (replace)
      for (const CheckpointInfo& c : list_checkpoints(trainer.config().checkpoint.dir)) {
        spdlog::warn("checkpoint.overwrite: removing the earlier run's {}", c.dir.string());
        std::filesystem::remove_all(c.dir);
      }
    // The configuration as planned (train.plan: auto writes its choices in).
    spdlog::info("resolved config:\n{}", dump_config(trainer.config()));
    // Written with the run's first checkpoint (or at its end), so that a run refused on the way
    // (bad data, say) leaves the directory's earlier file alone. With moe.growth it names the
    // run's experts, not the first stage's.
    if (world.is_root())
      trainer.set_on_started([&trainer, final_experts] {
        Config c = trainer.config();
        c.moe.num_experts = final_experts;
        const std::string path = c.checkpoint.dir + "/config.resolved.yaml";
        write_file_atomic(path, dump_config(c));
        spdlog::info("resolved config written to {}", path);
      });
  });
  spdlog::info("done at step {}", out.step);
  // SIGUSR1 is a preemption notice (Slurm's --signal=USR1@N, scancel --signal=USR1): under Slurm
  // the job goes back to the queue and resumes from the checkpoint just written. SIGTERM and SIGINT
  // only stop.
  const std::string job = slurm_job_id();
  if (out.stop_signal == SIGUSR1 && !job.empty() && world.is_root() &&
      out.step < total_steps) {
    lock = DirLock();  // released: the requeued job takes the directory over
    const std::string why = requeue_slurm_job(job);
    if (why.empty())
      spdlog::info("SIGUSR1 (a preemption notice): requeued Slurm job {}; it resumes from step {}",
                   job, out.step);
    else
      spdlog::warn("SIGUSR1 (a preemption notice): could not requeue Slurm job {} ({}); resubmit it "
                   "to resume from step {}", job, why, out.step);
  }
  return 0;
}

namespace {

// The machine `mop plan` and `mop validate` plan for: --machine FILE, or the built-in h200 (cpu
// for train.device: cpu); --nodes and --gpus (GPUs per node) change its shape.
Machine planning_machine(const Config& cfg, const std::string& file, int nodes, int gpus_per_node) {
  Machine m = !file.empty() ? load_machine(file)
                            : builtin_machine(cfg.train.device == "cpu" ? "cpu" : "h200");
  if (nodes > 0) m.nodes = nodes;
  if (gpus_per_node > 0) m.gpus_per_node = gpus_per_node;
  return m;
}

}  // namespace

// One line per moe.growth stage: its experts, steps and what its plan predicts ("" without growth;
// a run's config whose stages do not end at moe.num_experts is a UserError).
std::string growth_plan_text(const Config& cfg, const Machine& machine, int world) {
  const GrowthSchedule g = growth_schedule(cfg);
  std::string out;
  for (int s = 0; s < g.stages(); ++s) {
    const Plan p = make_plan(stage_config(cfg, g, s), machine, world, /*check_fit=*/false);
    out += fmt::format("growth stage {} of {}: {} experts, steps {}–{}: predicted step {:.4g} ms ({:.0f} tokens/s), "
                       "{} on the {}, optimizer state of {} parameters on the host\n",
                       s + 1, g.stages(), g.experts[size_t(s)], s ? g.end_step[size_t(s - 1)] + 1 : 1,
                       g.end_step[size_t(s)], 1e3 * p.time.step, p.time.tokens_per_second(p),
                       format_bytes(double(p.memory.device_total())), device_name(p.run.device),
                       human_count(double(p.host_params)));
  }
  return out;
}

int cmd_validate(const ValidateArgs& args) {
  Config cfg = load_config(args.config, args.overrides);
  const int world = int(cfg.parallel.attention.cp * cfg.parallel.attention.dp);
  validate_parallel(cfg, world);
  const Machine machine = planning_machine(cfg, args.machine, 0, 0);
  const Plan plan = make_plan(cfg, machine, world, /*check_fit=*/false);
  const ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  const MemoryPlan& mem = plan.memory;
  std::printf("# resolved configuration\n%s\n", dump_config(cfg).c_str());
  std::printf("parameters: %s total, %s active per token (excluding the embedding table)\n",
              human_count(double(layout.num_params())).c_str(),
              human_count(double(layout.num_active_params())).c_str());
  std::printf("ranks: %d (attention cp %lld × dp %lld, moe ep %lld × dp %lld); step on %s\n", world,
              (long long)cfg.parallel.attention.cp, (long long)cfg.parallel.attention.dp,
              (long long)cfg.parallel.moe.ep, (long long)cfg.parallel.moe.dp,
              plan.run.describe().c_str());
  std::printf("estimated memory per rank on %s (mop plan): %s on the %s (weights %s, gradients %s, "
              "optimizer state %s, activations %s, workspaces %s), %s in host memory\n",
              machine.name.c_str(), format_bytes(double(mem.device_total())).c_str(),
              std::string(device_name(plan.run.device)).c_str(), format_bytes(double(mem.weights)).c_str(),
              format_bytes(double(mem.grads)).c_str(),
              format_bytes(double(mem.optimizer_state + mem.host_grad_staging)).c_str(),
              format_bytes(double(mem.activations)).c_str(), format_bytes(double(mem.workspaces)).c_str(),
              format_bytes(double(mem.host_total())).c_str());
  const std::string overflow = plan_overflow(plan);
  if (!overflow.empty()) std::printf("warning: %s\n", overflow.c_str());
  std::printf("%s", growth_plan_text(cfg, machine, world).c_str());
  if (cfg.data.paths.empty()) {
    std::printf("data: none given (data.paths)\n");
  } else {
    TokenLoader loader(make_loader_options(cfg));
    std::printf("data: %s\n", loader.summary().c_str());
    if (args.scan_data) {
      loader.validate_all_tokens();
      std::printf("data: every token is inside the vocabulary (%lld)\n",
                  (long long)cfg.model.vocab_size);
    }
  }
  std::printf("config OK\n");
  return 0;
}

PlanTarget plan_target(const Config& cfg, const std::string& machine_file, int gpus, int nodes,
                       bool whole_machine) {
  PlanTarget t{planning_machine(cfg, machine_file, nodes, 0), 0};
  Machine& machine = t.machine;
  const bool builtin_gpu = machine_file.empty() && cfg.train.device != "cpu";
  if (builtin_gpu && gpus == 0 && nodes == 0 && !whole_machine && gpu_count() > 0) {
    // Not told otherwise, on a machine with GPUs: this machine — its GPUs, its host's memory and
    // cores — with the config's foldings.
    const int world = int(cfg.parallel.attention.cp * cfg.parallel.attention.dp);
    machine.name = "h200 (this machine)";
    machine.gpus_per_node = std::min(world, gpu_count());
    machine.nodes = (world + machine.gpus_per_node - 1) / machine.gpus_per_node;
    machine.host.memory_bytes = double(memory_info(Device::CPU).total);
    share_builtin_host(machine, this_node_cores(machine.gpus_per_node), machine.gpus_per_node);
    t.world = world;
    return t;
  }
  // --gpus: the ranks in all; with --nodes too, spread over them.
  if (gpus > 0) {
    t.world = gpus;
    if (nodes > 0) {
      MOP_USER_CHECK(gpus % nodes == 0, "--gpus ", gpus, " does not divide over --nodes ", nodes);
      machine.gpus_per_node = gpus / nodes;
    } else {
      machine.nodes = (gpus + machine.gpus_per_node - 1) / machine.gpus_per_node;
      machine.gpus_per_node = std::min(machine.gpus_per_node, gpus);
    }
  } else if (nodes > 0 || whole_machine) {
    t.world = machine.ranks();
  } else {
    t.world = int(cfg.parallel.attention.cp * cfg.parallel.attention.dp);
  }
  // Fewer ranks on a built-in node than it holds share its host among fewer.
  if (builtin_gpu && machine.gpus_per_node < 8) share_builtin_host(machine, machine.host.cores, machine.gpus_per_node);
  return t;
}

int cmd_plan(const PlanArgs& args) {
  Config cfg = load_config(args.config, args.overrides);
  const PlanTarget target = plan_target(cfg, args.machine, args.gpus, args.nodes, args.search);
  const Machine& machine = target.machine;
  const int world = target.world;
  if (args.search || cfg.train.plan == "auto") {
    const SearchResult r = search_plans(cfg, machine, world);
    if (args.json) {
      std::printf("%s\n", search_json(r, args.top).dump(2).c_str());
    } else {
      std::printf("%s", search_text(r, args.top).c_str());
      if (!r.feasible.empty()) std::printf("\nthe best plan:\n%s", plan_text(r.feasible.front().plan).c_str());
    }
    MOP_USER_CHECK(!r.feasible.empty(), "no plan fits ", machine.name, " with ", world, " rank(s)");
    return 0;
  }
  // A plan that does not fit is printed too (where the memory goes), then refused.
  const Plan plan = make_plan(cfg, machine, world, /*check_fit=*/false);
  MOP_USER_CHECK(args.rank < world, "--rank ", args.rank, ": the plan has ", world, " rank(s), 0 to ", world - 1);
  if (args.json) {
    Json j = plan_json(plan);
    if (args.program) j["program"] = program_json(make_step_program(plan, args.rank));
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s%s", plan_text(plan).c_str(), growth_plan_text(cfg, machine, world).c_str());
    if (args.program)
      std::printf("\nrank %d's %s", args.rank, program_text(make_step_program(plan, args.rank)).c_str());
  }
  const std::string overflow = plan_overflow(plan);
  MOP_USER_CHECK(overflow.empty(), overflow);
  return 0;
}

int cmd_prepare_data(const PrepareDataArgs& args) {
  if (args.random_tokens != 0) {
    MOP_USER_CHECK(args.vocab_size != 0, "prepare-data --random-tokens needs --vocab-size");
    RandomTokensOptions r;
    r.output = args.output;
    r.num_tokens = args.random_tokens;
    r.vocab_size = args.vocab_size;
    r.document_tokens = args.document_tokens;
    r.seed = args.seed;
    const PrepareDataStats st = prepare_random_tokens(r);
    std::printf("wrote %s and %s: %lld documents, %lld tokens drawn uniformly from [0, %lld), seed "
                "%llu, no EOS (train with data.eos_id: -1)\n",
                st.bin_path.c_str(), st.idx_path.c_str(), (long long)st.num_documents,
                (long long)st.num_tokens, (long long)args.vocab_size, (unsigned long long)args.seed);
    return 0;
  }
  MOP_USER_CHECK(!args.inputs.empty(), "prepare-data needs --input FILE... (text) or --random-tokens N "
                 "--vocab-size V");
  PrepareDataOptions o;
  o.inputs = args.inputs;
  o.output = args.output;
  o.split = parse_doc_split(args.split);
  o.tokenizer = args.tokenizer;
  o.eos_token = args.eos_token;
  o.json_key = args.json_key;
  o.progress = true;
  PrepareDataStats st = prepare_data(o);
  std::printf("wrote %s and %s: %lld documents, %lld tokens (%s, vocab %lld, eos %lld: train with "
              "model.vocab_size ≥ %lld, data.eos_id: %lld) from %lld input bytes\n",
              st.bin_path.c_str(), st.idx_path.c_str(), (long long)st.num_documents,
              (long long)st.num_tokens, o.tokenizer.empty() ? "byte-level" : o.tokenizer.c_str(),
              (long long)st.vocab_size, (long long)st.eos_id, (long long)st.vocab_size,
              (long long)st.eos_id, (long long)st.num_input_bytes);
  return 0;
}

int cmd_generate(const GenerateArgs& args) {
  namespace fs = std::filesystem;
  std::string dir = args.checkpoint;
  if (!fs::exists(fs::path(dir) / "manifest.json")) {
    Config probe;
    probe.checkpoint.dir = dir;
    probe.checkpoint.resume = "auto";
    auto found = resolve_resume_dir(probe);
    MOP_USER_CHECK(found.has_value(), "--checkpoint ", dir, ": no checkpoint found there");
    dir = *found;
  }
  Config cfg = checkpoint_config(dir);
  const TextCodec codec = TextCodec::for_checkpoint(dir, cfg);
  cfg.train.device = "cpu";
  cfg.train.precision = "fp32";
  RunPlacement placement = resolve_placement(cfg, Device::CPU);
  auto ops = make_cpu_ops();
  ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  ParamStore params(layout, placement.compute, placement.grad, MemKind::Host);
  Optimizer optim(cfg.optim, params, *ops);
  load_checkpoint(dir, cfg, params, optim, /*optim_state=*/false);
  const int S = int(cfg.data.seq_len);
  TransformerOptions topt;
  topt.plan.max_batch = 1;
  topt.plan.max_seq = S;
  check_forward_memory("generate: the checkpoint's window (data.seq_len)", layout.dims, topt.plan, 0, Device::CPU);
  Transformer model(layout, params, *ops, topt);
  model.allocate();

  std::vector<int32_t> context = codec.encode(args.prompt);
  // An empty prompt starts a document: after the end-of-document token (a newline for a model
  // trained without one).
  if (context.empty()) context.push_back(cfg.data.eos_id >= 0 ? int32_t(cfg.data.eos_id) : int32_t('\n'));
  std::vector<int32_t> ids(S), targets(S, -1), pos(S);
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<float> logits(size_t(cfg.model.vocab_size));
  // The continuation is printed as the decoded text grows past what is out already; a decode that
  // ends in U+FFFD waits for the rest of its character.
  std::string printed = codec.decode(context);
  std::fputs(args.prompt.c_str(), stdout);
  for (int n = 0; n < args.tokens; ++n) {
    // Causal attention: positions after the context do not influence it, so the window is padded.
    int len = std::min<int>(int(context.size()), S);
    std::fill(ids.begin(), ids.end(), 0);
    std::copy(context.end() - len, context.end(), ids.begin());
    Batch b{1, S, Tensor(ids.data(), DType::I32, {S}), Tensor(targets.data(), DType::I32, {S}),
            Tensor(pos.data(), DType::I32, {S})};
    model.forward(b, 0.0f);
    model.take_losses();
    model.logits(Tensor(logits.data(), DType::F32, {cfg.model.vocab_size}), len - 1);
    // Temperature and top-k sampling; temperature 0 is greedy.
    int V = int(cfg.model.vocab_size);
    std::vector<int> order(V);
    std::iota(order.begin(), order.end(), 0);
    int k = args.top_k > 0 ? std::min(args.top_k, V) : V;
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int a, int c) { return logits[a] > logits[c]; });
    int next = order[0];
    if (args.temperature > 0) {
      std::vector<double> p(k);
      double z = 0;
      for (int i = 0; i < k; ++i) z += p[i] = std::exp((logits[order[i]] - logits[order[0]]) / args.temperature);
      double u = double(philox_u64(args.seed, 11, uint64_t(n)) >> 11) / 9007199254740992.0 * z;
      for (int i = 0; i < k; ++i) {
        if ((u -= p[i]) <= 0) {
          next = order[i];
          break;
        }
      }
    }
    if (next == cfg.data.eos_id) break;
    context.push_back(next);
    const std::string text = codec.decode(context);
    if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0 &&
        !text.ends_with("\xEF\xBF\xBD")) {
      std::fwrite(text.data() + printed.size(), 1, text.size() - printed.size(), stdout);
      printed = text;
    }
    std::fflush(stdout);
  }
  std::fputc('\n', stdout);
  return 0;
}

}  // namespace mop
