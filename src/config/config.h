// The run configuration: one struct per YAML section with documented defaults (see
// config_schema.cpp for the documentation of every key and its valid range), loading with
// `--set section.key=value` overrides, validation with messages that name the YAML path, and the
// resolved dump that is logged at start and stored in checkpoints.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace mop {

struct ModelConfig {
  int64_t vocab_size = 257;
  int64_t hidden_size = 128;
  int64_t num_layers = 4;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 0;  // 0: hidden_size / num_heads
  double rope_theta = 1e6;
  bool qk_norm = true;
  double rms_eps = 1e-6;
  bool tie_embeddings = false;
  double init_std = 0.02;
  // The context length export-hf writes as config.json's max_position_embeddings (import-hf reads
  // it); 0: not known. Not used by the model (RoPE has no table).
  int64_t max_position_embeddings = 0;
};

// One stage of progressive expert growth (moe.growth): each MoE layer's expert count during it and
// its budget, in tokens or in steps (0: not given; only the last stage may give neither: the rest
// of the run).
struct GrowthStage {
  int64_t experts = 0;
  double tokens = 0;
  int64_t steps = 0;
  bool operator==(const GrowthStage&) const = default;
};
// "[{experts: 8, tokens: 2e+09}, {experts: 16, steps: 100}]" (YAML flow style).
std::string growth_text(const std::vector<GrowthStage>& stages);

struct MoeConfig {
  int64_t num_experts = 8;
  int64_t top_k = 2;
  int64_t expert_ffn = 256;
  bool renormalize = true;
  int64_t shared_expert_ffn = 0;  // 0: no shared expert
  int64_t first_dense_layers = 0;
  int64_t dense_ffn = 0;  // FFN width of the dense layers; 0: expert_ffn · top_k
  double aux_loss_coef = 1e-3;
  double z_loss_coef = 0;
  // Progressive expert growth (train/growth.h): stages, or the doubling schedule from
  // growth_from experts; the copies' router rows get noise of this relative scale; their
  // optimizer moments are copied from the source expert or start at zero (copy | fresh).
  std::vector<GrowthStage> growth;
  int64_t growth_from = 0;
  double growth_noise = 0.01;
  std::string growth_optimizer = "copy";
};

// The same N ranks folded two ways: attention as cp × dp, the MoE feed-forward as ep × dp.
struct AttentionFold {
  int64_t cp = 1;
  int64_t dp = 1;
  // How attention runs over the cp ranks: auto | ulysses | ring. auto: Ulysses when num_heads and
  // num_kv_heads both divide by cp, ring attention otherwise.
  std::string impl = "auto";
};

struct MoeFold {
  int64_t ep = 1;
  int64_t dp = 1;
  // ep > 1: the rank's experts run in this many chunks, each chunk's token exchange overlapping
  // with another chunk's experts on the GPU (at most the rank's expert count).
  int64_t chunks = 2;
  // Rows a rank receives for its experts per MoE layer and micro-batch, as a multiple of its
  // balanced share (tokens × top_k); more arrive in rounds. 0: the worst case (ep × tokens ×
  // top_k), never in rounds.
  double exchange_budget = 0;
};

// Pipeline stages (the pp axis): the layers are split into `pp` stages of consecutive segments,
// each run by world / pp ranks (attention cp × dp, experts ep × dp within the stage), micro-batches
// passing from stage to stage.
struct PipelineConfig {
  std::string schedule = "1f1b";  // 1f1b | interleaved
  int64_t virtual_stages = 1;     // interleaved: model chunks per rank (1f1b: 1)
};

struct ParallelConfig {
  AttentionFold attention;
  MoeFold moe;
  int64_t pp = 1;  // pipeline stages
  PipelineConfig pipeline;
  bool zero = true;  // shard the optimizer state over the ranks that replicate a parameter
  // owner: parameters whole on every replica (ZeRO-1 owners with `zero`); slice: each replica
  // keeps a slice of every parameter and its state, weights gathered per segment (ZeRO-3).
  std::string shard = "owner";
  bool overlap_grad_reduce = true;  // GPU: gradient sums on their own stream during backward
  double collective_timeout = 600;  // seconds; a collective not done by then aborts the job
};

struct OptimConfig {
  double lr = 3e-4;
  double min_lr = 3e-5;
  std::string schedule = "cosine";  // cosine | wsd | constant
  int64_t warmup_steps = 0;
  double decay_fraction = 0.2;  // wsd: fraction of the steps spent in the final decay
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // 0: no clipping
  std::string state_placement = "auto";  // auto | gpu | host (GPU runs)
  bool overlap = true;                   // host updates overlap the next step's forward
  int64_t host_threads = 0;              // 0: every core this rank may use
  // Host-updated segments' fp32 gradients: gpu (whole step on the GPU, to the host once final),
  // host (streamed: to the host as each segment's are final, summed there over micro-batches;
  // the GPU keeps only the segments in flight), auto (the plan's choice).
  std::string gradients = "auto";
};

struct DataConfig {
  std::vector<std::string> paths;
  std::string format = "auto";  // auto | megatron | flat
  std::string flat_dtype = "uint16";
  int64_t eos_id = 256;  // -1: none
  std::string tokenizer;  // tokenizer.json saved with the checkpoints; empty: the data's, if any
  int64_t seq_len = 256;
  bool eod_mask_loss = false;
  bool reset_position_ids = false;
  double valid_fraction = 0;
};

struct TrainConfig {
  int64_t steps = 100;
  int64_t global_batch_size = 8;  // sequences per optimizer step, all ranks together
  int64_t micro_batch_size = 8;   // sequences per forward/backward on one rank
  int64_t seed = 1234;
  std::string device = "auto";     // auto | cpu | cuda
  std::string precision = "auto";  // auto | fp32 | fp64 | bf16
  bool recompute = false;          // keep only layer inputs, recompute the rest in backward
  int64_t moe_chunk = -1;          // tokens per MoE/FFN chunk; 0: whole micro-batch; -1: the plan's
  int64_t offload_layers = -1;     // recompute: layers whose saved tensors go to host; -1: the plan's
  int64_t keep_attention = -1;     // recompute: layers that keep attention's output; -1: the plan's
  int64_t keep_attention_tail = -1;  // recompute, query tiles: last tiles the other layers keep; -1: the plan's
  int64_t attention_tile = -1;     // tokens per query tile of attention; 0: whole sequences; -1: the plan's
  std::string on_nonfinite = "skip";  // skip | abort
  int64_t lm_head_chunk = 1024;       // tokens per fused LM-head/loss chunk
  int64_t eval_interval = 0;          // 0: no evaluation
  int64_t eval_batches = 4;
  int64_t exit_interval = 0;  // checkpoint and exit at steps that are multiples of N; 0: never
  int64_t profile_step = 0;   // write a Chrome trace of this step; 0: none
  std::string plan = "config";  // config | auto (the best plan; pinned keys kept)
  std::string machine;          // machine file for the plan; empty: built in for the device
};

struct CheckpointConfig {
  std::string dir = "checkpoints/run";
  int64_t interval = 0;  // 0: only at the end
  int64_t keep_last = 3;
  std::string resume = "none";  // none | auto | PATH
  bool save_final = true;
  std::string init_from;  // a checkpoint whose weights start a new run (fine-tune); empty: none
  bool overwrite = false;  // resume: none in a directory holding a run replaces that run
};

struct LogConfig {
  int64_t interval = 10;
  std::string metrics_file;  // empty: <checkpoint.dir>/metrics.jsonl
  std::string tensorboard_dir;  // empty: no TensorBoard event file
  std::string router_histogram;  // rows per expert and MoE layer over the run (JSON); empty: none
  std::string level = "info";
  bool all_ranks = false;
};

struct Config {
  ModelConfig model;
  MoeConfig moe;
  ParallelConfig parallel;
  OptimConfig optim;
  DataConfig data;
  TrainConfig train;
  CheckpointConfig checkpoint;
  LogConfig log;

  // The keys the YAML file or a --set gave (the rest are defaults): what `train.plan: auto` may
  // not change.
  std::set<std::string> pinned;
  bool is_pinned(const std::string& key) const { return pinned.count(key) > 0; }

  // Derived values (valid after validate()).
  int64_t head_dim() const { return model.head_dim ? model.head_dim : model.hidden_size / model.num_heads; }
  int64_t dense_ffn() const { return moe.dense_ffn ? moe.dense_ffn : moe.expert_ffn * moe.top_k; }
  bool layer_is_moe(int64_t layer) const { return layer >= moe.first_dense_layers; }
};

// Parse a YAML file, apply `key=value` overrides (dotted paths; values parsed as YAML scalars or
// flow sequences), validate. Every problem is a UserError naming the YAML path and value.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
Config load_config_text(const std::string& yaml_text, const std::vector<std::string>& overrides = {},
                        const std::string& origin = "<string>");

// Checks that need the world size (parallel foldings must multiply to it).
void validate_parallel(const Config& cfg, int world_size);

// The resolved configuration as YAML (every key, defaults filled in), loadable again.
std::string dump_config(const Config& cfg);

// Markdown table of every key: path, type, default, description (docs/configuration.md).
std::string config_reference_markdown();

// " (did you mean moe.top_k?)" for the nearest of `known` to a mistyped (dotted) name, or "" when
// nothing is close.
std::string did_you_mean(const std::string& name, const std::vector<std::string>& known);

}  // namespace mop
