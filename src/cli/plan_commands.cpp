// `mop plan` and `mop validate`, and the job they (and `mop emulate`) describe: the machine and
// ranks they plan for (plan_target), the layout where the config gives none for those ranks
// (plan_job: the search's fastest plan, as train.plan: auto takes it), and what would make a plan
// fit where none does.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <map>

#include "cli/commands.h"
#include "config/config.h"
#include "core/format.h"
#include "data/loader.h"
#include "plan/program.h"
#include "plan/report.h"
#include "plan/search.h"
#include "runtime/runtime.h"
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

// Whether the config (its file or --set) gives any of the foldings.
bool pins_layout(const Config& cfg) {
  for (const char* k : {"parallel.attention.cp", "parallel.attention.dp", "parallel.moe.ep", "parallel.moe.dp"})
    if (cfg.is_pinned(k)) return true;
  return false;
}

// The ranks the config's foldings make: the attention's, or the experts' where only they are given.
int config_world(const Config& cfg) {
  const auto& a = cfg.parallel.attention;
  const auto& m = cfg.parallel.moe;
  const bool attention = cfg.is_pinned("parallel.attention.cp") || cfg.is_pinned("parallel.attention.dp");
  const bool experts = cfg.is_pinned("parallel.moe.ep") || cfg.is_pinned("parallel.moe.dp");
  return int(cfg.parallel.pp * (!attention && experts ? m.ep * m.dp : a.cp * a.dp));
}

bool layout_makes(const Config& cfg, int world) {
  const auto& a = cfg.parallel.attention;
  const auto& m = cfg.parallel.moe;
  const int64_t stage = world % cfg.parallel.pp == 0 ? world / cfg.parallel.pp : -1;
  return a.cp * a.dp == stage && m.ep * m.dp == stage;
}

// The machine the plan describes: --machine FILE; else, on a machine without a GPU where the
// config lets the device follow the machine (train.device: auto) and no GPUs are asked for, the
// CPU backend, as `mop train` runs here; else the built-in description of this machine's GPU, or
// the built-in h200 on a machine without one (cpu for train.device: cpu).
// --nodes changes its shape.
Machine planning_machine(const Config& cfg, const std::string& file, int nodes, bool cpu_here) {
  // GPUs here: the built-in description of this machine's (its report says which, and why).
  if (!file.empty()) {
    Machine m = load_machine(file);
    if (nodes > 0) m.nodes = nodes;
    return m;
  }
  std::string note;
  const std::string gpu = cfg.train.device == "cpu" || cpu_here ? "cpu"
                          : gpu_count() > 0                     ? builtin_for_gpu(gpu_name(), &note)
                                                                : "h200";
  Machine m = builtin_machine(gpu);
  if (!note.empty()) m.origin += " (" + note + ")";
  if (nodes > 0) m.nodes = nodes;
  return m;
}

// "--gpus 16 --nodes 2" where `ranks` are whole nodes of `node` GPUs past one node.
std::string ranks_flags(int ranks, int node) {
  std::string s = "--gpus " + std::to_string(ranks);
  if (node > 1 && ranks > node && ranks % node == 0) s += " --nodes " + std::to_string(ranks / node);
  return s;
}

}  // namespace

// One line per moe.growth stage: its experts, steps and what its plan predicts ("" without growth;
// a run's config whose stages do not end at moe.num_experts is a UserError).
std::string growth_plan_text(const Config& cfg, const Machine& machine, int world) {
  const GrowthSchedule g = growth_schedule(cfg);
  std::string out;
  for (int s = 0; s < g.stages(); ++s) {
    const Plan p = make_plan(stage_config(cfg, g, s), machine, world, /*check_fit=*/false);
    out += fmt::format("growth stage {} of {}: {} experts, steps {}–{}: predicted step {:.4g} ms ({} tokens/s), "
                       "{} on the {}, optimizer state of {} parameters on the host\n",
                       s + 1, g.stages(), g.experts[size_t(s)], s ? g.end_step[size_t(s - 1)] + 1 : 1,
                       g.end_step[size_t(s)], 1e3 * p.time.step, grouped(p.time.tokens_per_second(p)),
                       format_bytes(double(p.memory.device_total())), device_name(p.run.device),
                       human_count(double(p.host_params)));
  }
  return out;
}

PlanTarget plan_target(const Config& cfg, const std::string& machine_file, int gpus, int nodes,
                       bool whole_machine) {
  const bool cpu_here = machine_file.empty() && cfg.train.device == "auto" && gpus == 0 && nodes == 0 &&
                        gpu_count() == 0;
  PlanTarget t{planning_machine(cfg, machine_file, nodes, cpu_here), 0, 1, {}};
  Machine& machine = t.machine;
  t.node_gpus = machine.gpus_per_node;
  if (cpu_here)
    t.notes.push_back("this machine has no GPU, so mop train runs this config here on the CPU (train.device: "
                      "auto) and the plan describes that run; --gpus N, --machine FILE or --set "
                      "train.device=cuda plans a GPU job");
  const bool builtin_gpu = machine_file.empty() && cfg.train.device != "cpu" && !cpu_here;
  if (builtin_gpu && gpus == 0 && nodes == 0 && !whole_machine && gpu_count() > 0) {
    // Not told otherwise, on a machine with GPUs: this machine — its GPUs, its host's memory and
    // cores — with the config's foldings.
    const int world = config_world(cfg);
    machine.name = machine.base + " (this machine)";
    machine.gpus_per_node = std::min(world, gpu_count());
    machine.nodes = (world + machine.gpus_per_node - 1) / machine.gpus_per_node;
    machine.host.memory_bytes = double(memory_info(Device::CPU).total);
    share_builtin_host(machine, this_node_cores(machine.gpus_per_node), machine.gpus_per_node);
    t.world = world;
    return t;
  }
  // A machine file with no ranks asked for and no foldings in the config: all of its GPUs, as a
  // job on it would take them (Megatron-LM and torchtitan fill the world they are given).
  const bool whole_file = !machine_file.empty() && gpus == 0 && nodes == 0 && !pins_layout(cfg);
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
  } else if (nodes > 0 || whole_machine || whole_file) {
    t.world = machine.ranks();
    if (whole_file && !whole_machine && t.world > 1)
      t.notes.push_back(std::to_string(t.world) + " ranks: every GPU of " + machine_file + " (" +
                        std::to_string(machine.nodes) + " node(s) of " + std::to_string(machine.gpus_per_node) +
                        "); --gpus N plans fewer");
  } else {
    t.world = config_world(cfg);
  }
  // Fewer ranks on a built-in node than it holds share its host among fewer.
  if (builtin_gpu && machine.gpus_per_node < 8) share_builtin_host(machine, machine.host.cores, machine.gpus_per_node);
  return t;
}

std::string no_fit_message(const Config& cfg, const PlanTarget& t, const std::string& machine_file,
                           const SearchResult& r) {
  std::string out = "no plan fits " + t.machine.name + " with " + std::to_string(t.world) + " rank(s)";
  // The reasons, most common first.
  std::map<std::string, std::pair<int, const Candidate*>> groups;  // count, the first
  bool batch = false;
  for (const Candidate& c : r.rejected) {
    auto& g = groups[c.group.find("memory") != std::string::npos ? "over " + c.group : c.group];
    if (g.first++ == 0) g.second = &c;
    batch = batch || c.why.find("train.global_batch_size") != std::string::npos;
  }
  std::vector<std::pair<int, std::string>> by_count;
  for (const auto& [g, n] : groups) by_count.push_back({n.first, g});
  std::sort(by_count.begin(), by_count.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  out += " (" + grouped(double(r.rejected.size())) + " plans:";
  for (size_t i = 0; i < by_count.size() && i < 3; ++i) {
    out += std::string(i ? "," : "") + " " + grouped(by_count[i].first) + " " + by_count[i].second;
    // An invalid setting says itself in a line; a memory overflow's account is --search's to show.
    if (i == 0 && by_count[i].second == "invalid settings")
      out += ", e.g. " + groups[by_count[i].second].second->why;
  }
  out += "; mop plan --search lists them)";
  const FitAdvice a = fit_advice(cfg, t.world, t.node_gpus, batch, [&](int w) {
    return plan_target(cfg, machine_file, w, 0, false).machine;
  });
  std::vector<std::string> fixes;
  if (a.fewer) fixes.push_back(ranks_flags(a.fewer, t.node_gpus));
  if (a.more) fixes.push_back(ranks_flags(a.more, t.node_gpus));
  if (a.batch_below || a.batch_above) {
    const int64_t b = a.batch_below && a.batch_above
                          ? (cfg.train.global_batch_size - a.batch_below <= a.batch_above - cfg.train.global_batch_size
                                 ? a.batch_below : a.batch_above)
                          : std::max(a.batch_below, a.batch_above);
    const int64_t other = b == a.batch_below ? a.batch_above : a.batch_below;
    fixes.push_back("with " + std::to_string(t.world) + " ranks and train.global_batch_size " + std::to_string(b) +
                    (other ? " (or " + std::to_string(other) + ")" : "") + " in place of " +
                    std::to_string(cfg.train.global_batch_size) + ": --set train.global_batch_size=" +
                    std::to_string(b));
  }
  if (fixes.empty())
    return out + "; none fits with up to 64 nodes of " + std::to_string(t.node_gpus) +
           " either: lower model or data sizes, or give a machine file of a larger device (--machine)";
  out += "; one fits with ";
  for (size_t i = 0; i < fixes.size(); ++i) out += (i ? i + 1 == fixes.size() ? ", or " : ", " : "") + fixes[i];
  return out;
}

PlanJob plan_job(const Config& cfg, const std::string& machine_file, int gpus, int nodes) {
  PlanJob job{plan_target(cfg, machine_file, gpus, nodes, false), cfg, ""};
  const int world = job.target.world;
  const bool open = !layout_makes(cfg, world);
  if (cfg.train.plan != "auto" && !open) return job;
  const SearchResult r = search_plans(cfg, job.target.machine, world);
  MOP_USER_CHECK(!r.feasible.empty(), no_fit_message(cfg, job.target, machine_file, r));
  job.cfg = r.feasible.front().plan.cfg;
  job.chosen = r.feasible.front().settings;
  job.target.notes.push_back(
      (open ? "layout for " + std::to_string(world) + " ranks: the config's foldings make " +
                  std::to_string(config_world(cfg)) + ", so the plan chose the keys it leaves open"
            : std::string("train.plan: auto: the plan chose the keys the config leaves open")) +
      ", the fastest plan that fits as mop plan --search ranks them (mop train: train.plan: auto): " + job.chosen);
  return job;
}

int cmd_validate(const ValidateArgs& args) {
  const PlanJob job = plan_job(load_config(args.config, args.overrides), args.machine, args.gpus, args.nodes);
  const Config& cfg = job.cfg;
  const Machine& machine = job.target.machine;
  const int world = job.target.world;
  const Plan plan = make_plan(cfg, machine, world, /*check_fit=*/false);
  const ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  const MemoryPlan& mem = plan.memory;
  std::printf("# resolved configuration\n%s\n", dump_config(cfg).c_str());
  std::printf("parameters: %s total, %s active per token (excluding the embedding table)\n",
              human_count(double(layout.num_params())).c_str(),
              human_count(double(layout.num_active_params())).c_str());
  for (const std::string& n : job.target.notes) std::printf("note: %s\n", n.c_str());
  std::printf("ranks: %d (attention cp %lld × dp %lld, moe ep %lld × dp %lld); step on %s\n", world,
              (long long)cfg.parallel.attention.cp, (long long)cfg.parallel.attention.dp,
              (long long)cfg.parallel.moe.ep, (long long)cfg.parallel.moe.dp, plan.run.describe().c_str());
  const bool gpu = plan.run.device != Device::CPU;
  std::printf("estimated memory per rank on %s (mop plan): %s %s (weights %s, gradients %s, "
              "optimizer state %s, activations %s, workspaces %s), %s in host memory\n",
              machine.name.c_str(), format_bytes(double(mem.device_total())).c_str(),
              gpu ? "on the GPU" : "with the CPU backend", format_bytes(double(mem.weights)).c_str(),
              format_bytes(double(mem.grads)).c_str(),
              format_bytes(double(mem.optimizer_state + mem.host_grad_staging)).c_str(),
              format_bytes(double(mem.activations)).c_str(), format_bytes(double(mem.workspaces)).c_str(),
              format_bytes(double(mem.host_total())).c_str());
  std::printf("%s", growth_plan_text(cfg, machine, world).c_str());
  if (cfg.data.paths.empty()) {
    std::printf("data: none given (data.paths)\n");
  } else {
    TokenLoader loader(make_loader_options(cfg));
    std::printf("data: %s\n", loader.summary().c_str());
    if (args.scan_data) {
      loader.validate_all_tokens();
      std::printf("data: every token is inside the vocabulary (%lld)\n", (long long)cfg.model.vocab_size);
    }
  }
  // A plan that does not fit is a config that cannot run there: refused, as mop plan refuses it.
  const std::string overflow = plan_overflow(plan);
  MOP_USER_CHECK(overflow.empty(), overflow, " (mop plan --search ranks the plans that fit)");
  std::printf("config OK\n");
  return 0;
}

int cmd_plan(const PlanArgs& args) {
  const Config cfg = load_config(args.config, args.overrides);
  if (args.search || cfg.train.plan == "auto") {
    const PlanTarget target = plan_target(cfg, args.machine, args.gpus, args.nodes, args.search);
    const SearchResult r = search_plans(cfg, target.machine, target.world, /*pipelines=*/args.search);
    if (args.json) {
      Json j = search_json(r, args.top);
      Json notes = Json::array();
      for (const std::string& n : target.notes) notes.push_back(n);
      j["notes"] = notes;
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      for (const std::string& n : target.notes) std::printf("note: %s\n", n.c_str());
      std::printf("%s", search_text(r, args.top).c_str());
      if (!r.feasible.empty()) std::printf("\nthe best plan:\n%s", plan_text(r.feasible.front().plan).c_str());
    }
    MOP_USER_CHECK(!r.feasible.empty(), no_fit_message(cfg, target, args.machine, r));
    return 0;
  }
  const PlanJob job = plan_job(cfg, args.machine, args.gpus, args.nodes);
  const Machine& machine = job.target.machine;
  const int world = job.target.world;
  // A plan that does not fit is printed too (where the memory goes), then refused.
  Plan plan = make_plan(job.cfg, machine, world, /*check_fit=*/false);
  plan.notes.insert(plan.notes.begin(), job.target.notes.begin(), job.target.notes.end());
  MOP_USER_CHECK(args.rank < world, "--rank ", args.rank, ": the plan has ", world, " rank(s), 0 to ", world - 1);
  if (args.json) {
    Json j = plan_json(plan);
    if (args.program) j["program"] = program_json(make_step_program(plan, args.rank));
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s%s", plan_text(plan).c_str(), growth_plan_text(job.cfg, machine, world).c_str());
    if (args.program)
      std::printf("\nrank %d's %s", args.rank, program_text(make_step_program(plan, args.rank)).c_str());
  }
  const std::string overflow = plan_overflow(plan);
  MOP_USER_CHECK(overflow.empty(), overflow);
  return 0;
}

}  // namespace mop
