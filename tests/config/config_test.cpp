// Config loading: defaults, overrides, every class of bad input gives one UserError naming the
// YAML path and value, and the resolved dump loads back to the same config.
#include <chrono>
#include <string>

#include "catch.h"
#include "config/config.h"
#include "core/error.h"

using namespace mop;

namespace {

// The message of the UserError that loading `yaml` with `overrides` raises ("" if none).
std::string error_of(const std::string& yaml, std::vector<std::string> overrides = {}) {
  try {
    load_config_text(yaml, overrides, "cfg.yaml");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("config: defaults and values load", "[cpu][config]") {
  Config c = load_config_text("model:\n  hidden_size: 64\n  num_heads: 8\nmoe:\n  top_k: 3\n");
  CHECK(c.model.hidden_size == 64);
  CHECK(c.head_dim() == 8);
  CHECK(c.moe.top_k == 3);
  CHECK(c.moe.num_experts == 8);  // default
  CHECK(load_config_text("").model.hidden_size == 128);
  CHECK(load_config_text("model:\n").model.hidden_size == 128);
  CHECK(load_config_text("optim: {lr: 1e-3}").optim.lr == 1e-3);
  CHECK(load_config_text("train: {steps: 1e3}").train.steps == 1000);  // integral float accepted
  Config l = load_config_text("data:\n  paths: [a, b]\n");
  REQUIRE(l.data.paths.size() == 2);
  CHECK(load_config_text("data: {paths: one}").data.paths.at(0) == "one");
}

TEST_CASE("config: --set overrides", "[cpu][config]") {
  Config c = load_config_text("moe: {top_k: 2}", {"moe.top_k=4", "data.paths=[x, y]", "model.qk_norm=false"});
  CHECK(c.moe.top_k == 4);
  CHECK(c.data.paths.size() == 2);
  CHECK_FALSE(c.model.qk_norm);
  CHECK(error_of("", {"moe.topk=4"}) == "--set moe.topk: unknown key (did you mean moe.top_k?)");
  CHECK(error_of("", {"moe.top_k"}) == "--set moe.top_k: expected section.key=value");
  CHECK(error_of("", {"moe.top_k=abc"}) == "--set moe.top_k: expected an integer, got 'abc'");
  // An override is validated like the file: top_k beyond the experts.
  CHECK(error_of("", {"moe.top_k=9"}) == "moe.top_k: 9 exceeds moe.num_experts (8)");
}

TEST_CASE("config: bad input names the path and value", "[cpu][config]") {
  CHECK(error_of("moe:\n  num_experts: 8\n  top_k: 9\n") == "moe.top_k: 9 exceeds moe.num_experts (8)");
  CHECK(error_of("moe:\n  topk: 2\n") == "cfg.yaml:2: unknown key moe.topk (did you mean moe.top_k?)");
  CHECK(error_of("modle:\n  hidden_size: 2\n") == "cfg.yaml:1: unknown key modle (did you mean model?)");
  CHECK(error_of("zzz: 1\n") == "cfg.yaml:1: unknown key zzz");
  CHECK(error_of("model:\n  hidden_size: abc\n") ==
        "cfg.yaml:2: model.hidden_size: expected an integer, got 'abc'");
  CHECK(error_of("model:\n  hidden_size: 2.5\n") ==
        "cfg.yaml:2: model.hidden_size: expected an integer, got 2.5");
  CHECK(error_of("model:\n  hidden_size: 0\n") ==
        "cfg.yaml:2: model.hidden_size: 0 is out of range (1 to 1048576)");
  CHECK(error_of("model:\n  hidden_size: -3\n") ==
        "cfg.yaml:2: model.hidden_size: -3 is out of range (1 to 1048576)");
  CHECK(error_of("model:\n  hidden_size: 99999999999999999999999\n") ==
        "cfg.yaml:2: model.hidden_size: 99999999999999999999999 is out of range (1 to 1048576)");
  // The GPU router and permutation hold at most 1,024 experts: more is refused at load time.
  CHECK(error_of("moe:\n  num_experts: 1025\n") ==
        "cfg.yaml:2: moe.num_experts: 1025 is out of range (1 to 1024)");
  CHECK(error_of("model:\n  hidden_size: [1, 2]\n") ==
        "cfg.yaml:2: model.hidden_size: expected a single int value");
  CHECK(error_of("model: 5\n") == "cfg.yaml:1: model: expected a mapping of keys");
  CHECK(error_of("- a\n- b\n") == "cfg.yaml:1: the top level must be a mapping of sections (model:, moe:, ...)");
  CHECK(error_of("model:\n  qk_norm: maybe\n") ==
        "cfg.yaml:2: model.qk_norm: expected true or false, got 'maybe'");
  CHECK(error_of("optim:\n  lr: .nan\n") == "cfg.yaml:2: optim.lr: expected a number, got '.nan'");
  CHECK(error_of("optim:\n  schedule: cosin\n") ==
        "cfg.yaml:2: optim.schedule: 'cosin' is not one of cosine, wsd or constant (did you mean cosine?)");
  CHECK(error_of("model: {hidden_size: 128, num_heads: 8, num_kv_heads: 3}") ==
        "model.num_kv_heads: 3 does not divide model.num_heads (8)");
  CHECK(error_of("model: {hidden_size: 130, num_heads: 4}") ==
        "model.hidden_size: 130 is not divisible by model.num_heads (4); set model.head_dim explicitly");
  CHECK(error_of("model: {head_dim: 33}") ==
        "model.head_dim: 33 must be even (RoPE rotates pairs of dimensions)");
  CHECK(error_of("model: {vocab_size: 100}") ==
        "data.eos_id: 256 is outside the vocabulary (model.vocab_size 100)");
  CHECK(error_of("train: {micro_batch_size: 16, global_batch_size: 8}") ==
        "train.micro_batch_size: 16 exceeds train.global_batch_size (8)");
  CHECK(error_of("optim: {lr: 1e-4, min_lr: 1e-3}") == "optim.min_lr: 0.001 exceeds optim.lr (0.0001)");
  CHECK(error_of("model: {num_layers: 2}\nmoe: {first_dense_layers: 3}") ==
        "moe.first_dense_layers: 3 exceeds model.num_layers (2)");
  // Ulysses attention shards heads over the cp ranks; ring attention and auto take any head count.
  CHECK(error_of("model: {hidden_size: 96, num_heads: 6, num_kv_heads: 3}\n"
                 "parallel: {attention: {cp: 2, dp: 1, impl: ulysses}}") ==
        "parallel.attention.impl: ulysses needs model.num_heads (6) and model.num_kv_heads (3) to "
        "divide by parallel.attention.cp (2); use ring or auto");
  CHECK(error_of("model: {hidden_size: 96, num_heads: 6, num_kv_heads: 3}\n"
                 "parallel: {attention: {cp: 2, dp: 1, impl: ring}}") == "");
  CHECK(error_of("model: {hidden_size: 96, num_heads: 6, num_kv_heads: 3}\n"
                 "parallel: {attention: {cp: 2, dp: 1}}") == "");
  CHECK(error_of("model: {num_heads: 4, num_kv_heads: 2}\nparallel: {attention: {cp: 2, impl: ulysses}}") == "");
  CHECK(error_of("parallel: {attention: {impl: rings}}") ==
        "cfg.yaml:1: parallel.attention.impl: 'rings' is not one of auto, ulysses or ring (did you mean ring?)");
  // The names other tools give a device come first: PyTorch's gpu is cuda here (not cpu by spelling).
  CHECK(error_of("", {"train.device=gpu"}) == "--set train.device: 'gpu' is not one of auto, cpu or cuda (did you mean cuda?)");
  CHECK(error_of("", {"optim.state_placement=cuda"}) ==
        "--set optim.state_placement: 'cuda' is not one of auto, gpu or host (did you mean gpu?)");
  // Attention in query tiles: the tile divides the sequence; ring attention runs its own blocks.
  CHECK(error_of("data: {seq_len: 96}\ntrain: {attention_tile: 40}") ==
        "train.attention_tile: 40 tokens do not divide data.seq_len (96); use a divisor, 0 (whole "
        "sequences) or -1 (the plan's choice)");
  CHECK(error_of("data: {seq_len: 96}\ntrain: {attention_tile: 32}") == "");
  CHECK(error_of("data: {seq_len: 96}\ntrain: {attention_tile: 32}\n"
                 "parallel: {attention: {cp: 2, dp: 1, impl: ring}}") ==
        "train.attention_tile: ring attention (parallel.attention.impl: ring) runs its own blocks; "
        "leave the tile at -1 or 0");
  // Kept attention tails: the last tiles of one recomputed sequence per micro-batch, fewer than all.
  const std::string tails = "data: {seq_len: 96}\ntrain: {recompute: true, micro_batch_size: 1, global_batch_size: 1, ";
  CHECK(error_of(tails + "attention_tile: 32, keep_attention_tail: 2}") == "");
  CHECK(error_of(tails + "keep_attention_tail: 2}") == "");  // the plan's tile
  CHECK(error_of(tails + "attention_tile: 32, keep_attention_tail: 3}") ==
        "train.keep_attention_tail: 3 tiles of 32 tokens leave none of data.seq_len (96) to "
        "recompute; keep the whole output with train.keep_attention instead");
  const std::string needs = "train.keep_attention_tail: kept tails are the last query tiles of one sequence: they "
                            "need train.recompute: true, parallel.attention.cp 1, train.micro_batch_size 1 and "
                            "attention in query tiles (train.attention_tile not 0)";
  CHECK(error_of(tails + "attention_tile: 0, keep_attention_tail: 1}") == needs);
  CHECK(error_of("data: {seq_len: 96}\ntrain: {micro_batch_size: 1, global_batch_size: 1, keep_attention_tail: 1}") == needs);
  CHECK(error_of("data: {seq_len: 96}\ntrain: {recompute: true, keep_attention_tail: 1}") == needs);
  // Sizes whose products overflow.
  CHECK(error_of("data: {seq_len: 16777216}\ntrain: {micro_batch_size: 1000, global_batch_size: 1000}") ==
        "train.micro_batch_size × data.seq_len = 16777216000 tokens per micro-batch exceeds 2^31 − 1");
  // Malformed YAML.
  std::string malformed = error_of("model:\n  hidden_size: [1, 2\n");
  CHECK(malformed.rfind("cfg.yaml:", 0) == 0);
  CHECK(malformed.find("malformed YAML") != std::string::npos);
}

TEST_CASE("config: values, keys and paths echoed in errors have their control characters escaped",
          "[cpu][config]") {
  // "\x1b[2J" clears a terminal; echoed as written it would wipe the message that names it.
  CHECK(error_of("model: {hidden_size: \"\\e[2J\"}") ==
        "cfg.yaml:1: model.hidden_size: expected an integer, got '\\x1b[2J'");
  CHECK(error_of("", {"model.hidden_size=\x1b[2Jbig"}) ==
        "--set model.hidden_size: expected an integer, got '\\x1b[2Jbig'");
  CHECK(error_of("", {"model.hid\rden=1"}) == "--set model.hid\\rden: unknown key");
  CHECK(error_of("model: {\"hidden\\nsize\": 1}").find("unknown key model.hidden\\nsize") !=
        std::string::npos);
  CHECK(error_of("", {"parallel.attention.impl=r\xc2\x9bing"}).find("'r\\u009bing' is not one of") !=
        std::string::npos);
  const std::string path = "conf\x1b]0;title\x07.yaml";
  try {
    load_config(path, {});
    FAIL("no error");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()) == "config file conf\\x1b]0;title\\x07.yaml: not found");
  }
}

TEST_CASE("config: a megabyte-long unknown key is refused at once", "[cpu][config]") {
  // did_you_mean compared it with every known key (length × length each): 16 MB took 40 s.
  const std::string key(16 << 20, 'x');
  const auto start = std::chrono::steady_clock::now();
  CHECK(error_of("model:\n  ? " + key + "\n  : 1\n")
            .starts_with("cfg.yaml:2: unknown key model.xxx"));
  CHECK(error_of("", {"model." + key + "=1"}).starts_with("--set model.xxx"));
  // Parsing 16 MB of YAML takes about a second; the comparisons took 40.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

TEST_CASE("config: parallel foldings must match the number of ranks", "[cpu][config]") {
  Config c = load_config_text("parallel: {attention: {cp: 2, dp: 2}, moe: {ep: 4}}\ntrain: {global_batch_size: 16}");
  CHECK_NOTHROW(validate_parallel(c, 4));
  try {
    validate_parallel(c, 8);
    FAIL("no error");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()) == "parallel.attention: cp (2) × dp (2) = 4 must equal the number of ranks (8)"
                                   "; give foldings that multiply to 8, or set train.plan: auto to have the plan choose those the config does not give");
  }
  Config e = load_config_text("parallel: {moe: {ep: 3}}");
  CHECK_THROWS_WITH(validate_parallel(e, 3), "parallel.attention: cp (1) × dp (1) = 1 must equal the number of ranks (3)"
                                             "; give foldings that multiply to 3, or set train.plan: auto to have the plan choose those the config does not give");
  Config g = load_config_text("parallel: {attention: {dp: 3}, moe: {dp: 3}}\ntrain: {global_batch_size: 8, micro_batch_size: 1}");
  CHECK_THROWS_WITH(validate_parallel(g, 3),
                    "train.global_batch_size: 8 is not a multiple of train.micro_batch_size (1) × parallel.attention.dp (3)");
}

TEST_CASE("config: the resolved dump loads back to the same config", "[cpu][config]") {
  Config c = load_config_text(
      "model: {hidden_size: 96, num_heads: 6, rope_theta: 500000.5}\noptim: {lr: 0.00123, schedule: wsd}\n"
      "data: {paths: [a/b, 'c d']}\ncheckpoint: {resume: some/path}");
  std::string dump = dump_config(c);
  Config back = load_config_text(dump);
  CHECK(dump_config(back) == dump);
  CHECK(back.model.rope_theta == 500000.5);
  CHECK(back.optim.lr == 0.00123);
  CHECK(back.data.paths.at(1) == "c d");
  CHECK(back.checkpoint.resume == "some/path");
}

TEST_CASE("config: the reference lists every key", "[cpu][config]") {
  std::string ref = config_reference_markdown();
  for (const char* key : {"`model.hidden_size`", "`moe.top_k`", "`parallel.moe.ep`", "`optim.lr`",
                          "`data.paths`", "`train.steps`", "`checkpoint.dir`", "`log.interval`"})
    CHECK(ref.find(key) != std::string::npos);
}

TEST_CASE("config: moe.growth stages load, dump back and refuse what cannot run", "[cpu][config]") {
  // 4 sequences × 32 tokens = 128 tokens per step; 10 steps.
  const std::string rest = "data: {seq_len: 32}\ntrain: {steps: 10, global_batch_size: 4, micro_batch_size: 2}\n";
  const std::string base = "moe: {num_experts: 8, top_k: 2}\n" + rest;
  auto growth = [&](const std::string& stages) {
    return rest + "moe: {num_experts: 8, top_k: 2, growth: " + stages + "}\n";
  };
  Config c = load_config_text(base, {"moe.growth=[{experts: 2, tokens: 384}, {experts: 4, steps: 3}, {experts: 8}]"});
  REQUIRE(c.moe.growth.size() == 3);
  CHECK(c.moe.growth[0] == GrowthStage{2, 384, 0});
  CHECK(c.moe.growth[1] == GrowthStage{4, 0, 3});
  CHECK(c.moe.growth[2] == GrowthStage{8, 0, 0});
  CHECK(growth_text(c.moe.growth) == "[{experts: 2, tokens: 384.0}, {experts: 4, steps: 3}, {experts: 8}]");
  Config back = load_config_text(dump_config(c));
  CHECK(back.moe.growth == c.moe.growth);
  // A stage's config (a checkpoint's) names that stage's experts.
  CHECK(load_config_text(base, {"moe.num_experts=4", "moe.growth=[{experts: 2, steps: 3}, {experts: 4, steps: 3}, {experts: 8}]"})
            .moe.num_experts == 4);

  CHECK(error_of(base, {"moe.growth=[{experts: 2, steps: 3}, {experts: 3, steps: 3}, {experts: 8}]"}) ==
        "moe.growth: stage 2 (3 experts) is not a multiple of stage 1's 2 experts (each expert grows into a "
        "whole number of copies)");
  CHECK(error_of(base, {"moe.growth=[{experts: 2, steps: 3}, {experts: 8, steps: 3}]"}) ==
        "moe.growth: the stages add up to 6 steps (768 tokens at 128 per step), train.steps is 10; make them "
        "agree, or leave out the last stage's budget (it takes the rest)");
  CHECK(error_of(base, {"moe.growth=[{experts: 2}, {experts: 8}]"}) ==
        "moe.growth: stage 1 (2 experts): no budget (tokens or steps); only the last stage may leave it out");
  CHECK(error_of(base, {"moe.growth=[{experts: 2, steps: 10}, {experts: 8}]"}) ==
        "moe.growth: stage 1 (2 experts) ends at step 10 (1280 tokens at 128 per step), not before train.steps (10)");
  // A budget past int64's steps, and a step past int64's tokens (found by fuzz/config_fuzz.cpp).
  CHECK(error_of(base, {"moe.growth=[{experts: 2, tokens: 1e300}, {experts: 8}]"}) ==
        "moe.growth: stage 1 (2 experts) ends at step 1000000000000000000 (1e+300 tokens at 128 "
        "per step), not before train.steps (10)");
  CHECK(error_of(base, {"moe.growth=[{experts: 2, steps: 3}, {experts: 8}]",
                        "data.seq_len=16777216", "train.global_batch_size=1e12"}) ==
        "train.global_batch_size × data.seq_len overflows a 64-bit integer");
  CHECK(error_of(base, {"moe.growth=[{experts: 2, steps: 3}, {experts: 4}]"}) ==
        "moe.growth: no stage has moe.num_experts (8) experts; the last stage's count is the model's");
  CHECK(error_of(base, {"moe.growth=[{experts: 1, steps: 3}, {experts: 8}]"}) ==
        "moe.top_k: 2 exceeds the first stage's 1 experts (moe.growth)");
  CHECK(error_of(growth("[{experts: 2, steps: 3, tokens: 5}, {experts: 8}]")) ==
        "cfg.yaml:3: moe.growth: stage 1: give tokens or steps, not both");
  CHECK(error_of(growth("[{experts: 2, step: 3}, {experts: 8}]")) ==
        "cfg.yaml:3: moe.growth: stage 1: unknown key 'step' (a stage has experts and one of tokens, steps)");
  CHECK(error_of(growth("[{steps: 3}, {experts: 8}]")) == "cfg.yaml:3: moe.growth: stage 1: no experts");
  CHECK(error_of(growth("8")) ==
        "cfg.yaml:3: moe.growth: expected a list of stages, e.g. [{experts: 8, tokens: 2e9}, {experts: 16}]");
  CHECK(error_of(growth("[{experts: 2.5, steps: 3}, {experts: 8}]")) ==
        "cfg.yaml:3: moe.growth: stage 1: experts: expected a positive integer, got 2.5");
  CHECK(error_of(base, {"moe.growth_from=3"}) == "moe.growth_from: 3 experts do not double up to moe.num_experts (8)");
  CHECK(error_of(base, {"moe.growth_from=2", "moe.growth=[{experts: 2, steps: 3}, {experts: 8}]"}) ==
        "moe.growth_from and moe.growth: give one of them");
  // Sharded experts: every stage's count divides by ep.
  Config e = load_config_text(base + "parallel: {moe: {ep: 4}, attention: {dp: 4}}",
                              {"moe.growth=[{experts: 2, steps: 3}, {experts: 8}]", "train.micro_batch_size=1"});
  CHECK_THROWS_WITH(validate_parallel(e, 4), "parallel.moe.ep: 4 does not divide the 2 experts of a moe.growth stage "
                                             "(every stage's experts are sharded over the ep ranks)");
}
