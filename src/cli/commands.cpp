// The subcommands train, prepare-data and generate (validate and plan: plan_commands.cpp).
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
#include "ckpt/manifest.h"
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

// The layout needs as many processes as it has ranks: a job started with fewer (one, most
// often) is told how to start it (Megatron-LM and torchtitan runs start under torchrun the same way).
void check_launched_ranks(const Config& cfg, const World& world, const std::string& config_path) {
  const auto& a = cfg.parallel.attention;
  const auto& m = cfg.parallel.moe;
  const int64_t ranks = a.cp * a.dp != world.size ? a.cp * a.dp : m.ep * m.dp;
  if (world.size != 1 || ranks == 1) return;  // other mismatches: validate_parallel's message
  throw_user_error(a.cp * a.dp != 1 ? "parallel.attention: cp (" + std::to_string(a.cp) + ") × dp (" +
                                          std::to_string(a.dp) + ")"
                                    : "parallel.moe: ep (" + std::to_string(m.ep) + ") × dp (" + std::to_string(m.dp) + ")",
                   " = ", ranks, " ranks, and mop train runs as one process: start one per rank, e.g. mpirun -np ",
                   ranks, " mop train --config ", config_path, " … (srun -n ", ranks,
                   " under Slurm; docs/parallelism.md)");
}

// "" unless the checkpoint a resume would continue is at train.steps or past it; then the line
// saying the run is complete.
std::string finished_run(const Config& cfg) {
  const std::optional<std::string> dir = resolve_resume_dir(cfg);
  if (!dir) return "";
  const int64_t step = read_manifest(*dir).step;
  if (step < cfg.train.steps) return "";
  return "checkpoint " + *dir + " is at step " + std::to_string(step) + " of train.steps " +
         std::to_string(cfg.train.steps) + ": the run is complete, nothing to train (raise train.steps to continue it)";
}

// After a start that failed: the lock file alone left in checkpoint.dir goes, and the directory
// too where this run created it.
void remove_lock_left_alone(const std::string& dir, bool dir_existed) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec))
    if (e.path().filename() != ".lock") return;
  fs::remove(fs::path(dir) / ".lock", ec);
  if (!dir_existed) fs::remove(dir, ec);
}

int train_locked(Config cfg, World& world, DirLock& lock, bool replace);

}  // namespace

int cmd_train(const TrainArgs& args, World& world) {
  std::vector<std::string> overrides = args.overrides;
  if (!args.resume.empty()) overrides.push_back("checkpoint.resume=" + args.resume);
  if (args.profile_step > 0) overrides.push_back("train.profile_step=" + std::to_string(args.profile_step));
  if (!args.machine.empty()) overrides.push_back("train.machine=" + args.machine);
  Config cfg = load_config(args.config, overrides);
  setup_logging(cfg.log, world.rank, world.size);
  spdlog::info("mop {} | {} rank(s) | config {}", MOP_VERSION, world.size, args.config);
  check_launched_ranks(cfg, world, args.config);
  // A finished run asked to run again (a requeue loop, a resubmitted job) has nothing to train:
  // that is its success.
  if (const std::string done = finished_run(cfg); !done.empty()) {
    spdlog::info("{}", done);
    return 0;
  }
  // The run holds its directory from here to its exit; a fresh run does not replace another
  // run's checkpoints unless asked to.
  DirLock lock;
  const bool replace = world.is_root() && cfg.checkpoint.resume == "none" && cfg.checkpoint.overwrite;
  const std::string dir = cfg.checkpoint.dir;
  std::error_code ec;
  const bool dir_existed = std::filesystem::exists(dir, ec);
  if (world.is_root()) lock = DirLock::acquire(dir);
  try {
    if (world.is_root() && cfg.checkpoint.resume == "none" && !cfg.checkpoint.overwrite) {
      const std::string run = existing_run(cfg);
      MOP_USER_CHECK(run.empty(), "checkpoint.dir ", cfg.checkpoint.dir, " already holds a run (", run,
                     ") and checkpoint.resume is none: continue it with checkpoint.resume: auto, give "
                     "this run a checkpoint.dir of its own, or set checkpoint.overwrite: true to replace it");
    }
    return train_locked(std::move(cfg), world, lock, replace);
  } catch (...) {
    if (lock.held()) {
      lock = DirLock();
      remove_lock_left_alone(dir, dir_existed);
    }
    throw;
  }
}

namespace {

int train_locked(Config cfg, World& world, DirLock& lock, bool replace) {
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

}  // namespace

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
