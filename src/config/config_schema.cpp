// Every configuration key: where it lives, its type and range, and what it means. This table is
// the single source of the configuration reference in docs/configuration.md (`mop config-reference`).
#include <cstdint>

#include "config/schema.h"

namespace mop {
namespace {

using K = FieldSpec::Kind;

struct SchemaBuilder {
  std::vector<FieldSpec> fields;
  FieldSpec& add(const char* path, K kind, void* ptr, const char* doc) {
    FieldSpec spec;
    spec.path = path;
    spec.kind = kind;
    spec.ptr = ptr;
    spec.doc = doc;
    fields.push_back(std::move(spec));
    return fields.back();
  }
  void i(const char* path, int64_t& v, double lo, double hi, const char* doc) {
    auto& spec = add(path, K::Int, &v, doc);
    spec.min = lo, spec.max = hi;
  }
  void f(const char* path, double& v, double lo, double hi, const char* doc) {
    auto& spec = add(path, K::Float, &v, doc);
    spec.min = lo, spec.max = hi;
  }
  void b(const char* path, bool& v, const char* doc) { add(path, K::Bool, &v, doc); }
  void s(const char* path, std::string& v, std::vector<std::string> choices, const char* doc,
         bool open = false) {
    auto& spec = add(path, K::String, &v, doc);
    spec.choices = std::move(choices);
    spec.open_choices = open;
  }
  void l(const char* path, std::vector<std::string>& v, const char* doc) {
    add(path, K::StringList, &v, doc);
  }
  void g(const char* path, std::vector<GrowthStage>& v, const char* doc) { add(path, K::GrowthStages, &v, doc); }
};

constexpr double kMaxDim = 1 << 20;      // hidden sizes, FFN widths
constexpr double kMaxVocab = 2147483647;  // token ids are int32
constexpr double kMaxCount = 1e12;        // steps, batch sizes, intervals

}  // namespace

const char* kind_name(FieldSpec::Kind kind) {
  switch (kind) {
    case K::Int: return "int";
    case K::Float: return "float";
    case K::Bool: return "bool";
    case K::String: return "string";
    case K::StringList: return "list of strings";
    case K::GrowthStages: return "list of {experts, tokens \\| steps}";
  }
  return "?";
}

std::vector<FieldSpec> config_schema(Config& c) {
  SchemaBuilder s;
  auto& m = c.model;
  s.i("model.vocab_size", m.vocab_size, 2, kMaxVocab, "Vocabulary size (embedding rows, LM-head outputs). 257 for the byte-level data of `mop prepare-data`.");
  s.i("model.hidden_size", m.hidden_size, 1, kMaxDim, "Width of the residual stream.");
  s.i("model.num_layers", m.num_layers, 1, 4096, "Transformer layers.");
  s.i("model.num_heads", m.num_heads, 1, 4096, "Query heads.");
  s.i("model.num_kv_heads", m.num_kv_heads, 1, 4096, "Key/value heads (GQA); must divide num_heads.");
  s.i("model.head_dim", m.head_dim, 0, 1024, "Per-head width; 0 means hidden_size / num_heads. Must be even (RoPE).");
  s.f("model.rope_theta", m.rope_theta, 1, 1e12, "RoPE base frequency.");
  s.b("model.qk_norm", m.qk_norm, "Per-head RMSNorm on queries and keys before RoPE (Qwen3).");
  s.f("model.rms_eps", m.rms_eps, 1e-12, 1e-1, "RMSNorm epsilon.");
  s.b("model.tie_embeddings", m.tie_embeddings, "Share the embedding table with the LM head.");
  s.f("model.init_std", m.init_std, 1e-6, 1, "Standard deviation of the normal initialisation of weight matrices.");
  s.i("model.max_position_embeddings", m.max_position_embeddings, 0, 1 << 30, "The context length `mop export-hf` writes into config.json as max_position_embeddings; `mop import-hf` sets it from there (set it higher after training on longer sequences). 0: not known (export writes the larger of 32768 and data.seq_len). Training does not use it (RoPE has no table), and a resume ignores a change of it.");

  auto& e = c.moe;
  s.i("moe.num_experts", e.num_experts, 1, 1024,
      "Routed experts per MoE layer (at most 1,024: the GPU router keeps a token's scores in "
      "registers).");
  s.i("moe.top_k", e.top_k, 1, 65536, "Experts each token is routed to.");
  s.i("moe.expert_ffn", e.expert_ffn, 1, kMaxDim, "FFN width of one routed expert (moe_intermediate_size).");
  s.b("moe.renormalize", e.renormalize, "Renormalise the top-k router probabilities to sum to 1 (norm_topk_prob).");
  s.i("moe.shared_expert_ffn", e.shared_expert_ffn, 0, kMaxDim, "FFN width of a shared expert every token passes through; 0: none.");
  s.i("moe.first_dense_layers", e.first_dense_layers, 0, 4096, "The first N layers use a dense SwiGLU FFN instead of experts.");
  s.i("moe.dense_ffn", e.dense_ffn, 0, kMaxDim, "FFN width of the dense layers; 0: expert_ffn × top_k.");
  s.f("moe.aux_loss_coef", e.aux_loss_coef, 0, 1e3, "Weight of the load-balancing loss (averaged over MoE layers).");
  s.f("moe.z_loss_coef", e.z_loss_coef, 0, 1e3, "Weight of the router z-loss (mean squared log-sum-exp of router logits).");
  s.g("moe.growth", e.growth, "Progressive expert growth: train with few experts and grow the pool in stages, e.g. [{experts: 8, tokens: 2e9}, {experts: 16, tokens: 4e9}, {experts: 32}]. Each stage's experts are a multiple of the previous stage's (each expert becomes that many copies of itself: weights copied, router rows copied with moe.growth_noise), the last stage's are moe.num_experts; budgets in tokens or steps add up to train.steps (the last stage may give none: the rest of the run). A checkpoint written at a stage boundary holds the grown model.");
  s.i("moe.growth_from", e.growth_from, 0, 65536, "Shorthand for moe.growth: double the experts from this count to moe.num_experts, every stage training each of its experts on the same number of tokens (stage i of n gets 2^i / (2^n − 1) of the run). 0: no growth (or moe.growth's stages).");
  s.f("moe.growth_noise", e.growth_noise, 0, 10, "Growth: the router rows of an expert's new copies (all but the first) get Gaussian noise of this standard deviation relative to the row's RMS, seeded by train.seed; 0: exact copies.");
  s.s("moe.growth_optimizer", e.growth_optimizer, {"copy", "fresh"}, "Growth: the Adam moments of the experts after a growth are copied from their source expert (copy) or start at zero (fresh; the update count stays the run's).");

  auto& p = c.parallel;
  s.i("parallel.pp", p.pp, 1, 1 << 12, "Pipeline stages: the model's segments (embedding, layers, final norm and LM head) are split into this many stages of consecutive segments, each run by (ranks / pp) ranks whose attention and expert foldings (cp × dp, ep × dp) multiply to that; micro-batches pass from stage to stage (activations forward, their gradients back). The plan prices it (mop plan; --search tries it); each rank holds only its stage's parameters and state. Tested on CPU ranks (1f1b and interleaved, bit for bit as without stages) and emulated on one GPU (mop emulate); the NCCL messages between GPUs have not run on a multi-GPU machine yet.");
  s.s("parallel.pipeline.schedule", p.pipeline.schedule, {"1f1b", "interleaved"}, "pp > 1: the order of each stage's micro-batch passes: 1f1b (warm-up forwards, then one forward and one backward in turn, then the remaining backwards: a stage keeps at most pp − its index micro-batches in flight) or interleaved (each rank holds parallel.pipeline.virtual_stages model chunks; a smaller bubble for more messages; micro-batches per rank must be a multiple of pp).");
  s.i("parallel.pipeline.virtual_stages", p.pipeline.virtual_stages, 1, 64, "pp > 1 with schedule interleaved: model chunks per rank (virtual stages); 1 with 1f1b.");
  s.i("parallel.attention.cp", p.attention.cp, 1, 1 << 20, "Attention: ranks the sequence is sharded over.");
  s.i("parallel.attention.dp", p.attention.dp, 1, 1 << 20, "Attention: data-parallel ranks; cp × dp = number of ranks (of a pipeline stage: ranks / parallel.pp).");
  s.s("parallel.attention.impl", p.attention.impl, {"auto", "ulysses", "ring"}, "Attention over cp > 1 ranks: ulysses (an all-to-all trades the sequence shards for head shards; num_heads and num_kv_heads must divide by cp), ring (K/V blocks pass around the cp ranks, partial outputs merged by their log-sum-exp; any head count), or auto: ulysses when both head counts divide by cp, ring otherwise.");
  s.i("parallel.moe.ep", p.moe.ep, 1, 1 << 20, "MoE: ranks the experts are sharded over; must divide num_experts.");
  s.i("parallel.moe.dp", p.moe.dp, 1, 1 << 20, "MoE: data-parallel ranks; ep × dp = number of ranks (of a pipeline stage: ranks / parallel.pp).");
  s.i("parallel.moe.chunks", p.moe.chunks, 1, 1 << 16, "ep > 1: each rank's experts run in this many chunks (at most its expert count); on GPU ranks the all-to-all that brings one chunk's tokens, and the one that returns them, run on their own streams while the experts of the neighbouring chunks compute. 1: exchange, experts, exchange, one after the other. The experts see the same rows whatever the value (on CPU ranks the results are bitwise the same).");
  s.f("parallel.moe.exchange_budget", p.moe.exchange_budget, 0, 1 << 20, "ep > 1: the rows a rank receives for its experts per MoE layer and micro-batch are held in buffers of this multiple of its balanced share (its tokens × top_k, at least one row); a rank whose experts receive more takes them in rounds (the backward then recomputes the experts round by round). Dropless either way: no token is dropped and the results do not depend on the budget (on CPU ranks bitwise). 0: buffers for the worst case (ep × tokens × top_k rows), never in rounds.");
  s.f("parallel.collective_timeout", p.collective_timeout, 0, 1e7, "Seconds a collective may take before the job is aborted with a message naming it, the waiting rank and the ranks that did not arrive (a peer failed or hung); 0: wait forever.");
  s.b("parallel.overlap_grad_reduce", p.overlap_grad_reduce, "GPU ranks: sum each layer's data-parallel gradients on a separate stream (own NCCL communicators) as soon as the last micro-batch's backward finishes the layer, overlapped with the backward of the earlier layers; false: the same sums on the compute stream, in turn.");
  s.b("parallel.zero", p.zero, "Shard the optimizer state (ZeRO-1): each replicated parameter's master weights and Adam moments live on one of the ranks that hold it, which updates it and broadcasts the new weights.");
  s.s("parallel.shard", p.shard, {"owner", "slice"}, "How the ranks that hold copies of a parameter share it: owner (each holds it whole; with parallel.zero one of them keeps its optimizer state: ZeRO-1) or slice (ZeRO-3: each keeps 1/n of every parameter — weights, gradients, master weights and Adam moments; a segment's weights are gathered before its forward and again before its backward, released after, and its gradients reduce-scattered). Dense parameters are sliced over the attention ranks (cp × dp), experts over their data group (parallel.moe.dp).");

  auto& o = c.optim;
  s.f("optim.lr", o.lr, 0, 10, "Peak learning rate.");
  s.f("optim.min_lr", o.min_lr, 0, 10, "Final learning rate of the cosine / WSD decay.");
  s.s("optim.schedule", o.schedule, {"cosine", "wsd", "constant"}, "Linear warmup, then cosine decay to min_lr, warmup-stable-decay (linear decay over the last decay_fraction of the steps), or constant.");
  s.i("optim.warmup_steps", o.warmup_steps, 0, kMaxCount, "Linear warmup steps from 0 to lr.");
  s.f("optim.decay_fraction", o.decay_fraction, 0, 1, "WSD: fraction of train.steps spent decaying to min_lr.");
  s.f("optim.beta1", o.beta1, 0, 0.999999, "Adam β1.");
  s.f("optim.beta2", o.beta2, 0, 0.999999999, "Adam β2.");
  s.f("optim.eps", o.eps, 1e-30, 1, "Adam ε.");
  s.f("optim.weight_decay", o.weight_decay, 0, 10, "Decoupled weight decay (AdamW); never applied to norms and biases.");
  s.f("optim.grad_clip", o.grad_clip, 0, 1e6, "Clip the global gradient norm to this value; 0: no clipping.");
  s.s("optim.state_placement", o.state_placement, {"auto", "gpu", "host"}, "Where fp32 master weights and Adam m, v live on GPU runs: gpu, host (pinned memory, updated by the CPU), or auto (on the GPU what fits after the planned activations, earliest-needed groups first; the rest on the host). On CPU runs the state is in host memory either way; host runs it through the host engine and its pipeline.");
  s.b("optim.overlap", o.overlap, "Run optimizer updates in the background: each layer's next forward waits only for its own weights. Host updates may write the weights first and the optimizer state while the next step computes (two passes, when they measure cheaper than one); with every parameter's state on the device (no host state, no ZeRO-1) the device AdamW runs layer by layer on a stream of its own. false: the step waits for every update (same results).");
  s.s("optim.gradients", o.gradients, {"auto", "gpu", "host"}, "Where the fp32 gradients of segments whose optimizer state is on the host accumulate: gpu (the whole step's on the GPU, copied to the host once final), host (streamed: the GPU keeps gradient buffers only for the segments in flight; a segment's leave as soon as its backward is done — with several micro-batches their fp32 running sum waits in host memory and comes back for the next micro-batch's backward, which adds to it on the GPU as it would have without streaming — and the last micro-batch's go to the host optimizer; the same bits as gpu), or auto (the plan's choice from memory and bandwidth; gpu on CPU runs).");
  s.i("optim.host_threads", o.host_threads, 0, 4096, "Threads of the host optimizer; 0: one per core this rank may use.");

  auto& d = c.data;
  s.l("data.paths", d.paths, "Token shards, concatenated in order: Megatron indexed datasets (prefix of .bin/.idx) or flat binary token files.");
  s.s("data.format", d.format, {"auto", "megatron", "flat"}, "Shard format; auto picks megatron when PATH.idx exists.");
  s.s("data.flat_dtype", d.flat_dtype, {"uint16", "uint32"}, "Token type of flat binary shards.");
  s.i("data.eos_id", d.eos_id, -1, kMaxVocab, "End-of-document token id; -1: none. 256 for `mop prepare-data` shards.");
  s.s("data.tokenizer", d.tokenizer, {}, "The Hugging Face tokenizer.json of the data, copied (with tokenizer_config.json and special_tokens_map.json beside it) into every checkpoint for generate, score and export-hf. Empty: the one `mop prepare-data --tokenizer` wrote beside the first shard (PATH.tokenizer.json), else the resumed or init_from checkpoint's; byte-level data have none. Its vocabulary must fit model.vocab_size.");
  s.i("data.seq_len", d.seq_len, 1, 1 << 24, "Tokens per training sequence.");
  s.b("data.eod_mask_loss", d.eod_mask_loss, "Do not train on predicting the token after an end-of-document.");
  s.b("data.reset_position_ids", d.reset_position_ids, "Restart RoPE positions after every end-of-document.");
  s.f("data.valid_fraction", d.valid_fraction, 0, 0.5, "Fraction of the data held out for evaluation.");

  auto& t = c.train;
  s.i("train.steps", t.steps, 1, kMaxCount, "Optimizer steps.");
  s.i("train.global_batch_size", t.global_batch_size, 1, kMaxCount, "Sequences per optimizer step over all ranks (= micro_batch_size × micro-batches × data-parallel ranks).");
  s.i("train.micro_batch_size", t.micro_batch_size, 1, kMaxCount, "Sequences per forward/backward pass on one rank.");
  s.i("train.seed", t.seed, 0, 9.2e18, "Seed of the initialisation and the data order.");
  s.s("train.device", t.device, {"auto", "cpu", "cuda"}, "Where the step runs; auto: cuda when a GPU is present.");
  s.s("train.precision", t.precision, {"auto", "fp32", "fp64", "bf16"}, "Compute dtype; auto: fp32 on the CPU, bf16 on the GPU.");
  s.b("train.recompute", t.recompute, "Keep only each layer's input during forward and recompute the rest in backward.");
  s.i("train.moe_chunk", t.moe_chunk, -1, 1 << 30, "Tokens per chunk of the MoE block (router → dispatch → experts → combine) and the dense FFN in forward and backward; a chunked block recomputes its experts in backward and holds O(chunk) routed rows. 0: the whole micro-batch at once; -1: the plan's choice (chunks of 32768 tokens with recompute on longer micro-batches).");
  s.i("train.offload_layers", t.offload_layers, -1, 1 << 20, "With recompute: the first N layers keep their saved tensors (input, kept attention) in pinned host memory, copied out in forward and back one layer ahead in backward; -1: the plan's choice (as few as the device needs).");
  s.i("train.keep_attention", t.keep_attention, -1, 1 << 20, "With recompute: the first N layers keep their attention output and log-sum-exp, so backward does not recompute their attention; -1: the plan's choice (as many as device and host memory hold).");
  s.i("train.keep_attention_tail", t.keep_attention_tail, -1, 1 << 20, "With recompute and attention in query tiles (cp 1, train.micro_batch_size 1): the layers that do not keep their whole attention output (train.keep_attention) keep its last N query tiles, and their backward recomputes the tiles before them only (a late tile costs the most to recompute). Fewer than the sequence's tiles. 0: none; -1: the plan's choice (the tail that memory holds and that saves the most recompute).");
  s.i("train.attention_tile", t.attention_tile, -1, 1 << 30, "Tokens per query tile of the causal attention over whole sequences (cp 1 or Ulysses): each tile attends to its prefix of keys in tile-sized blocks merged by their log-sum-exp, so attention's workspace is bounded by the tile, not the sequence (lossless). Must divide data.seq_len. 0: whole sequences in one call; -1: the plan's choice (the tile its measured attention rates make fastest; whole sequences on the CPU).");
  s.s("train.on_nonfinite", t.on_nonfinite, {"skip", "abort"}, "When the loss or a gradient is NaN/Inf: skip the step (and log the first offending tensor) or abort.");
  s.i("train.lm_head_chunk", t.lm_head_chunk, 1, 1 << 24, "Tokens per chunk of the fused LM-head + cross-entropy.");
  s.i("train.eval_interval", t.eval_interval, 0, kMaxCount, "Evaluate on the held-out data every N steps; 0: never.");
  s.i("train.eval_batches", t.eval_batches, 1, kMaxCount, "Micro-batches per evaluation.");
  s.i("train.profile_step", t.profile_step, 0, kMaxCount, "Write a Chrome trace (chrome://tracing, Perfetto) of this step's GPU ops, host optimizer threads and waits to <checkpoint.dir>/trace_step_N.json; 0: none. Also --profile-step N.");
  s.i("train.exit_interval", t.exit_interval, 0, kMaxCount, "Checkpoint and exit after steps that are multiples of N (work in chunks of a job queue's time limit); 0: never.");
  s.s("train.plan", t.plan, {"config", "auto"}, "config: run the foldings, recompute, micro-batch size and state placement this config gives (defaults where it gives none); auto: take the plan `mop plan --search` ranks first for this machine and world size — only the keys the config does not set (parallel.attention.cp/dp/impl, parallel.moe.ep/dp/chunks, parallel.zero, train.micro_batch_size, train.recompute, optim.state_placement) are chosen.");
  s.s("train.machine", t.machine, {}, "Machine file (YAML, `mop calibrate` writes one) whose rates and limits the plan uses; empty: the built-in description of the device in use (h100 or h200 by the GPU's name, another GPU's with a warning naming the stand-in; cpu for the CPU backend) with the memory this machine reports. Also --machine FILE.");

  auto& k = c.checkpoint;
  s.s("checkpoint.dir", k.dir, {}, "Directory of step_N/ checkpoints and the `latest` pointer.");
  s.i("checkpoint.interval", k.interval, 0, kMaxCount, "Save every N steps; 0: only at the end.");
  s.i("checkpoint.keep_last", k.keep_last, 0, kMaxCount, "Keep the newest N checkpoints; 0: keep all.");
  s.s("checkpoint.resume", k.resume, {"none", "auto"}, "none, auto (latest complete checkpoint in dir, else fresh) or a checkpoint path.", true);
  s.b("checkpoint.save_final", k.save_final, "Save a checkpoint after the last step.");
  s.b("checkpoint.overwrite", k.overwrite, "With checkpoint.resume: none, replace a run already in checkpoint.dir (its checkpoints are removed once the new run has started); without it such a start is refused.");
  s.s("checkpoint.init_from", k.init_from, {}, "Start a new run (step 0, fresh optimizer and data order) from this checkpoint's weights — a deliberate fine-tune, where model and MoE settings may differ from the checkpoint's as long as the tensors fit (changes are listed). Used only when checkpoint.resume finds nothing to resume in checkpoint.dir; a resume itself refuses any model or MoE change.");

  auto& g = c.log;
  s.i("log.interval", g.interval, 1, kMaxCount, "Log a line every N steps.");
  s.s("log.metrics_file", g.metrics_file, {}, "JSON-lines metrics file; empty: <checkpoint.dir>/metrics.jsonl.");
  s.s("log.tensorboard_dir", g.tensorboard_dir, {},
      "Folder for a TensorBoard event file (events.out.tfevents.*) with the metrics file's "
      "scalars every step, written by rank 0; a relative path is taken from the working "
      "directory; empty: none.");
  s.s("log.router_histogram", g.router_histogram, {},
      "JSON file of the rows the routers sent to each expert of each MoE layer, summed over the "
      "training steps this process ran (training forward passes only: no recomputation, no "
      "evaluation) and over all ranks: {\"format\": \"mop-router-histogram\", \"version\": 1, "
      "\"experts\", \"top_k\", \"tokens\" (per layer), \"layers\": [[a count per expert], one "
      "per MoE layer]}; a routing model (parallel/routing_model.h, for emulation) reads it back as "
      "each layer's expert shares. Rank 0 replaces it atomically at every checkpoint and at the end "
      "of the run; a relative path is taken from the working directory; empty: none.");
  s.s("log.level", g.level, {"trace", "debug", "info", "warn", "error"}, "Log level.");
  s.b("log.all_ranks", g.all_ranks, "Log from every rank, not only rank 0.");
  return std::move(s.fields);
}

}  // namespace mop
