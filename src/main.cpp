// mop — command-line entry point: parses the subcommand, runs it, maps errors to exit codes
// (0 success, 2 bad input or usage, 1 internal failure; a failing rank of a multi-rank job aborts
// the whole job).
#include <algorithm>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <iostream>
#include <optional>

#include "cli/commands.h"
#include "cli/emulate.h"
#include "cli/hf_interop.h"
#include "cli/score.h"
#include "config/config.h"
#include "core/error.h"
#include "parallel/world.h"
#include "train/signals.h"

namespace {

// The examples of `mop --help`; each subcommand's --help shows its own.
constexpr const char* kExamples[] = {
    "mop train --config configs/tiny.yaml",
    "mop train --config configs/tiny.yaml --set train.steps=50 --set optim.lr=1e-3",
    "mop train --config configs/tiny.yaml --resume auto",
    "mpirun -np 8 mop train --config configs/q3moe-8l.yaml --set train.plan=auto",
    "mop validate --config configs/tiny.yaml --scan-data",
    "mop validate --config configs/moe-1t.yaml --gpus 96 --nodes 12",
    "mop plan --config configs/q3moe-8l.yaml",
    "mop plan --config configs/q3moe-8l.yaml --gpus 8",
    "mop plan --config configs/qwen3-30b-a3b.yaml --gpus 8 --search",
    "mop plan --config configs/q3moe-8l.yaml --machine configs/machines/h200-1-node.yaml",
    "mop calibrate --out machine.yaml",
    "mop emulate --config configs/moe-1t.yaml --gpus 96 --nodes 12 --layers 8",
    "mop prepare-data --input corpus.txt --output data/corpus --split blank-line",
    "mop prepare-data --random-tokens 100000000 --vocab-size 151936 --output data/random",
    "mop prepare-data --input docs.jsonl --json-key text --tokenizer tokenizer.json --output data/docs",
    "mop generate --checkpoint checkpoints/tiny --prompt \"In the beginning\"",
    "mop import-hf path/to/Qwen3-30B-A3B --out checkpoints/q3-30b > model.yaml",
    "mop export-hf checkpoints/run --out hf/run --dtype bf16",
    "mop score --checkpoint checkpoints/run --tokens tokens.txt --out logits.bin",
    "mop score --checkpoint checkpoints/run --text held_out.txt",
};

// The footer of `command`'s help: its examples ("" for mop's own: all of them).
std::string examples_of(const std::string& command) {
  std::string out;
  for (const char* e : kExamples) {
    const std::string line(e);
    if (command.empty() || line.find("mop " + command + " ") != std::string::npos) out += "  " + line + "\n";
  }
  return out.empty() ? "" : "\nExamples:\n" + out;
}

// The options that say which job `mop plan` and `mop emulate` are about: its config and the
// machine and ranks it runs on (cli/commands.h's plan_target).
void add_job_options(CLI::App* cmd, std::string& config, std::vector<std::string>& overrides, std::string& machine,
                     int& gpus, int& nodes) {
  cmd->add_option("-c,--config", config, "YAML config file")->required();
  cmd->add_option("--set", overrides, "Override a config key: section.key=value (repeatable)");
  cmd->add_option("--machine", machine, "Machine file of the job's machine (mop calibrate writes one); default: this machine's GPUs; without one, the CPU run mop train does here (train.device: auto) or, asked for GPUs, the built-in h200 node");
  cmd->add_option("--gpus", gpus, "Ranks (GPUs) of the job in all; without a layout in the config for them, the plan chooses it (as --search); default: every GPU of --nodes or of --machine's file, else the config's foldings")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--nodes", nodes, "Nodes of the job; default: the machine file's")->check(CLI::Range(1, 1 << 16));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mop — Mixture-of-Parallelisms training engine for Mixture-of-Experts models"};
  app.footer(examples_of(""));
  app.set_version_flag("--version", std::string("mop ") + MOP_VERSION);
  app.require_subcommand(1);

  mop::TrainArgs train;
  auto* t = app.add_subcommand("train", "Train a model from a YAML config");
  t->add_option("-c,--config", train.config, "YAML config file")->required();
  t->add_option("--set", train.overrides, "Override a config key: section.key=value (repeatable)");
  t->add_option("--resume", train.resume, "auto (latest checkpoint in checkpoint.dir) or a checkpoint path");
  t->add_option("--profile-step", train.profile_step, "Write a Chrome trace of step N to <checkpoint.dir>/trace_step_N.json")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  t->add_option("--machine", train.machine, "Machine file the plan uses (train.machine); default: built in for the device");

  mop::ValidateArgs validate;
  auto* v = app.add_subcommand("validate", "Check a config: resolved values, parameter counts, the plan's memory per rank (exit 2 where it does not fit), data");
  add_job_options(v, validate.config, validate.overrides, validate.machine, validate.gpus, validate.nodes);
  v->add_flag("--scan-data", validate.scan_data, "Check every token of the data against the vocabulary");

  mop::PlanArgs plan;
  auto* pl = app.add_subcommand("plan", "Where every component runs, the memory per rank and the predicted step time; --search ranks every plan");
  add_job_options(pl, plan.config, plan.overrides, plan.machine, plan.gpus, plan.nodes);
  pl->add_flag("--search", plan.search, "Rank every plan the keys the config leaves open allow, and say why the others do not fit");
  pl->add_flag("--json", plan.json, "Print JSON instead of text");
  pl->add_option("--top", plan.top, "--search: how many plans to list")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  pl->add_flag("--program", plan.program, "Also print the step program: the actions one rank's step runs, in order, with their streams");
  pl->add_option("--rank", plan.rank, "--program: whose program (ranks differ where ZeRO-1 owners keep state on the host)")->capture_default_str()->check(CLI::Range(0, (1 << 20) - 1));

  mop::EmulateArgs emu;
  auto* em = app.add_subcommand("emulate", "Run one rank of a job planned for another machine (e.g. 96 GPUs) on this device, its collectives stand-ins, and compare its memory and time with the plan");
  add_job_options(em, emu.config, emu.overrides, emu.machine, emu.gpus, emu.nodes);
  em->add_option("--rank", emu.rank, "The rank to run")->capture_default_str()->check(CLI::Range(0, (1 << 20) - 1));
  em->add_option("--routing", emu.routing, "What the other ranks send this rank's experts: balanced, zipf:S (expert e's share ∝ 1/(e+1)^S), or a router histogram file (log.router_histogram of mop train)")->capture_default_str();
  em->add_option("--steps", emu.steps, "Steps to run; the first is a warm-up")->capture_default_str()->check(CLI::Range(1, 1000));
  em->add_option("--layers", emu.layers, "Run the rank with this many of its layers (where the host cannot hold its whole share); the plan's full-depth figures are printed beside")->check(CLI::Range(1, 1 << 16));
  em->add_flag("--json", emu.json, "Print JSON instead of text");
  em->add_option(
      "--trace", emu.trace,
      "Write a Chrome trace (chrome://tracing, Perfetto) of the rank's last step to this file");

  mop::CalibrateArgs cal;
  auto* ca = app.add_subcommand("calibrate", "Measure this machine (GEMMs, attention, memory-bound ops, copies, host AdamW, collectives under mpirun) into a machine file for mop plan");
  ca->add_option("-o,--out", cal.out, "Machine file (YAML) to write; default: print it");
  ca->add_option("--device", cal.device, "auto (the GPU when there is one), cpu or cuda")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  ca->add_option("--step", cal.step_config, "Also run this config's step here (one rank, random tokens) and write the in-step factors: measured ÷ predicted per category");
  ca->add_option("--set", cal.step_overrides, "--step: override a config key: section.key=value (repeatable)");

  mop::PrepareDataArgs prep;
  auto* p = app.add_subcommand("prepare-data", "Turn text files into a byte-level token shard (Megatron .bin/.idx), or write random tokens for benchmarks");
  auto* p_in = p->add_option("-i,--input", prep.inputs, "Text files");
  p->add_option("-o,--output", prep.output, "Output prefix (writes PREFIX.bin and PREFIX.idx)")->required();
  p->add_option("--split", prep.split, "Documents: file (one per file) or blank-line (blocks between empty lines)")
      ->capture_default_str()
      ->check(CLI::IsMember({"file", "blank-line"}));
  auto* p_rand = p->add_option("--random-tokens", prep.random_tokens,
                               "Instead of text: this many token ids drawn uniformly from [0, --vocab-size) (benchmarks; train with data.eos_id: -1)");
  p_rand->excludes(p_in);
  auto* p_tok = p->add_option("--tokenizer", prep.tokenizer,
                              "A Hugging Face tokenizer.json (BPE: GPT-2, Qwen2/3, Llama 3 byte-level; Llama 2, Mixtral with byte fallback): each document's ids with the tokenizer's template tokens (BOS), then its EOS; copied beside the shards");
  p_tok->excludes(p_rand);
  p->add_option("--eos-token", prep.eos_token, "The end-of-document token (default: the tokenizer's <|endoftext|>, <|end_of_text|>, <|im_end|> or </s>)")->needs(p_tok);
  p->add_option("--json-key", prep.json_key, "Inputs are JSON lines; this key's string is one document")->needs(p_tok);
  p->add_option("--vocab-size", prep.vocab_size, "Vocabulary of --random-tokens")->needs(p_rand);
  p->add_option("--document-tokens", prep.document_tokens, "Tokens per document of --random-tokens")
      ->capture_default_str()
      ->needs(p_rand);
  p->add_option("--seed", prep.seed, "Seed of --random-tokens")->capture_default_str()->needs(p_rand);

  mop::GenerateArgs gen;
  auto* g = app.add_subcommand("generate", "Print a continuation of a prompt from a checkpoint, decoded with its tokenizer");
  g->add_option("--checkpoint", gen.checkpoint, "A step_N checkpoint or a checkpoint directory (its latest)")->required();
  g->add_option("--prompt", gen.prompt, "Text to continue (encoded with the checkpoint's tokenizer; bytes for a byte-level model)");
  g->add_option("-n,--tokens", gen.tokens, "Tokens to generate (fewer where the model ends the document)")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  g->add_option("--temperature", gen.temperature, "Sampling temperature; 0: greedy")->capture_default_str()->check(CLI::Range(0.0, 100.0));
  g->add_option("--top-k", gen.top_k, "Sample among the k most likely tokens; 0: all")->capture_default_str()->check(CLI::Range(0, 1 << 30));
  g->add_option("--seed", gen.seed, "Sampling seed")->capture_default_str();

  mop::ImportHfArgs imp;
  auto* ih = app.add_subcommand("import-hf", "Import a Hugging Face Qwen3-MoE or Mixtral model directory as a checkpoint (step 0)");
  ih->add_option("dir", imp.dir, "Model directory: config.json and *.safetensors (sharded with model.safetensors.index.json or not)")->required();
  ih->add_option("-o,--out", imp.out, "Checkpoint directory to create (gets step_0/ and model.yaml); the model/moe YAML goes to stdout, the rest to stderr")->required();

  mop::ExportHfArgs exp;
  auto* eh = app.add_subcommand("export-hf", "Export a checkpoint as a Hugging Face model directory (config.json, safetensors shards)");
  eh->add_option("checkpoint", exp.checkpoint, "A step_N checkpoint or a checkpoint directory (its latest)")->required();
  eh->add_option("-o,--out", exp.out, "Directory to write the model into")->required();
  eh->add_option("--dtype", exp.dtype, "Tensor dtype: bf16 or fp32 (the master weights)")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "fp32"}));
  eh->add_option("--arch", exp.arch, "auto (qwen3_moe with q/k norm, else mixtral), qwen3_moe or mixtral")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "qwen3_moe", "mixtral"}));
  eh->add_option("--layout", exp.layout, "Experts: per-expert (what save_pretrained writes) or fused (transformers 5 in-memory)")
      ->capture_default_str()
      ->check(CLI::IsMember({"per-expert", "fused"}));
  eh->add_option("--max-shard-size", exp.max_shard_size, "Largest safetensors file, e.g. 5GB, 500MB, 2GiB")->capture_default_str();

  mop::ScoreArgs score;
  auto* sc = app.add_subcommand("score", "Mean next-token cross-entropy (and logits) of token sequences under a checkpoint");
  sc->add_option("--checkpoint", score.checkpoint, "A step_N checkpoint or a checkpoint directory (its latest)")->required();
  auto* sc_tokens = sc->add_option("--tokens", score.tokens, "Token ids: text (one sequence per line) or binary int32");
  sc->add_option("--text", score.text, "Text, one sequence per line, encoded with the checkpoint's tokenizer (bytes for a byte-level model); instead of --tokens")
      ->excludes(sc_tokens);
  sc->add_option("--seq-len", score.seq_len, "Binary token files: tokens per sequence (default: the whole file)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 31));
  sc->add_option("--device", score.device, "cpu (fp32) or cuda (bf16)")->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  sc->add_option("--out", score.out, "Write every position's logits here (float32, [tokens, vocab])");

  auto* ref = app.add_subcommand("config-reference", "Print the configuration reference (Markdown)");
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) sub->footer(examples_of(sub->get_name()));

  // A mistyped command would reach CLI11 as a stray argument ("A subcommand is required").
  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
      names.push_back(sub->get_name());
    if (std::find(names.begin(), names.end(), std::string(argv[1])) == names.end()) {
      std::fprintf(stderr, "error: unknown command '%s'%s\nRun 'mop --help' for usage.\n",
                   mop::printable(argv[1]).c_str(), mop::did_you_mean(argv[1], names).c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // CLI11's messages quote the arguments as given.
    std::fprintf(stderr, "error: %s\nRun 'mop --help' for usage.\n", mop::printable(e.what()).c_str());
    return 2;
  }

  mop::World world;
  int rc = 0;
  // `mop train` takes SIGTERM/SIGINT/SIGUSR1 as a request to stop from here on, before MPI starts:
  // a preemption notice while the ranks start still ends in exit 0 and a requeue.
  std::optional<mop::StopSignals> stop_signals;
  if (*t) stop_signals.emplace();
  try {
    if (*t) {
      world = mop::World::init(&argc, &argv);
      rc = mop::cmd_train(train, world);
    } else if (*v) {
      rc = mop::cmd_validate(validate);
    } else if (*pl) {
      rc = mop::cmd_plan(plan);
    } else if (*em) {
      rc = mop::cmd_emulate(emu);
    } else if (*ca) {
      world = mop::World::init(&argc, &argv);
      rc = mop::cmd_calibrate(cal, world);
    } else if (*p) {
      rc = mop::cmd_prepare_data(prep);
    } else if (*g) {
      rc = mop::cmd_generate(gen);
    } else if (*ih) {
      rc = mop::cmd_import_hf(imp);
    } else if (*eh) {
      rc = mop::cmd_export_hf(exp);
    } else if (*sc) {
      rc = mop::cmd_score(score);
    } else if (*ref) {
      std::fputs(mop::config_reference_markdown().c_str(), stdout);
    }
  } catch (const mop::UserError& e) {
    std::fflush(stdout);
    std::string who = world.size > 1 ? "[rank " + std::to_string(world.rank) + "] " : "";
    std::fprintf(stderr, "%serror: %s\n", who.c_str(), e.what());
    if (world.mpi && world.size > 1) world.abort(2);
    rc = 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "internal error: %s\n", mop::printable(e.what()).c_str());
    if (world.mpi && world.size > 1) world.abort(1);
    rc = 1;
  }
  world.finalize();
  return rc;
}
