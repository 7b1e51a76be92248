// What mop cannot represent is refused with one line naming the config.json field and its value (or
// the tensor and its file): other architectures, RoPE scaling, biases, sliding windows, dense
// layers other than the first N, missing / misshapen / extra / non-float tensors; exports that the
// target architecture cannot express; malformed sizes and token files.
#include <filesystem>

#include "catch.h"
#include "ckpt/file_io.h"
#include "cli/hf_interop.h"
#include "cli/score.h"
#include "hf/hf_test_util.h"
#include "test_util.h"

using namespace mop;
using namespace mop::hf_test;
namespace fs = std::filesystem;

namespace {

// Imports a tiny model whose config.json has `key` set to `value` (JSON text; "" removes it).
std::string import_error_with(const TinyHf& m, const std::string& key, const std::string& value) {
  test::TempDir tmp;
  Json cfg = tiny_config(m);
  Json::Object kept;
  for (auto& [k, v] : cfg.as_object())
    if (k != key) kept.emplace_back(k, v);
  cfg = Json(std::move(kept));
  if (!value.empty()) cfg[key] = parse_json(value, "test");
  write_tiny_hf(tmp.path / "hf", m, cfg, tiny_tensors(m));
  return test::user_error_of([&] { import_hf(tmp / "hf", tmp / "ckpt"); });
}

std::string import_error_with_tensors(const TinyHf& m, std::vector<NamedTensor> tensors) {
  test::TempDir tmp;
  write_tiny_hf(tmp.path / "hf", m, tiny_config(m), tensors);
  return test::user_error_of([&] { import_hf(tmp / "hf", tmp / "ckpt"); });
}

// One config.json field set to a value, and what the import's error must say.
struct ImportCase {
  const TinyHf& m;
  const char* key;
  const char* value;
  const char* message;
};

std::string check_import_error(const ImportCase& c) {
  INFO(c.key << " = " << c.value);
  std::string msg = import_error_with(c.m, c.key, c.value);
  INFO("message: " << msg);
  CHECK(msg.find(c.message) != std::string::npos);
  return msg;
}

}  // namespace

TEST_CASE("hf: config.json fields mop cannot represent are named with their value", "[cpu][hf]") {
  TinyHf q;
  TinyHf x;
  x.arch = "mixtral", x.layers = 2, x.head_dim = 4;
  const ImportCase cases[] = {
      {q, "model_type", "\"llama\"", "model_type = \"llama\": mop imports"},
      {q, "architectures", "[\"Qwen3MoeForSequenceClassification\"]",
       "architectures = [\"Qwen3MoeForSequenceClassification\"]"},
      {q, "hidden_act", "\"gelu\"", "hidden_act = \"gelu\": mop's experts are SwiGLU"},
      {q, "attention_bias", "true",
       "attention_bias = true: mop's attention projections have no biases"},
      {q, "use_sliding_window", "true", "use_sliding_window = true"},
      {q, "rope_parameters", "{\"rope_type\": \"yarn\", \"rope_theta\": 10000.0, \"factor\": 4.0}",
       "rope_parameters = {\"rope_type\":\"yarn\""},
      {q, "rope_scaling", "{\"type\": \"linear\", \"factor\": 2.0}",
       "rope_scaling = {\"type\":\"linear\""},
      {q, "decoder_sparse_step", "2",
       "decoder_sparse_step = 2: mop's dense layers can only be the first N layers"},
      {q, "mlp_only_layers", "[1]",
       "mlp_only_layers = [1]: mop's dense layers can only be the first N layers"},
      {q, "mlp_only_layers", "[0, 1, 2]", "mlp_only_layers = [0,1,2]: every layer is dense"},
      {q, "quantization_config", "{\"quant_method\": \"fp8\"}", "quantization_config = "},
      {q, "vocab_size", "", "missing field 'vocab_size'"},
      {q, "num_key_value_heads", "3",
       "the model does not fit mop's configuration: model.num_kv_heads: 3"},
      {x, "sliding_window", "64", "sliding_window = 64: mop's attention is full causal attention"},
      {x, "rope_parameters", "{\"rope_type\": \"dynamic\", \"rope_theta\": 10000.0}",
       "rope_parameters = "},
  };
  for (const ImportCase& c : cases) {
    const std::string msg = check_import_error(c);
    CHECK(msg.find("config.json") != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }
  // A window no position can reach is no window: accepted, with a note.
  test::TempDir tmp;
  Json cfg = tiny_config(x);
  cfg["sliding_window"] = 4096;
  write_tiny_hf(tmp.path / "hf", x, cfg, tiny_tensors(x));
  HfImportResult r = import_hf(tmp / "hf", tmp / "ckpt");
  REQUIRE(r.imported.notes.size() == 1);
  CHECK(r.imported.notes[0].find("sliding_window 4096") != std::string::npos);
}

TEST_CASE("hf: config.json sizes outside mop's ranges are refused by their own name and value",
          "[cpu][hf]") {
  // Checked as each field is read, before anything (the per-layer vectors of mlp_only_layers) is
  // sized by it: a trillion layers is one line, not an allocation or a length_error.
  TinyHf q;
  TinyHf x;
  x.arch = "mixtral", x.layers = 2, x.head_dim = 4;
  const ImportCase cases[] = {
      {q, "num_hidden_layers", "1000000000000",
       "config.json: num_hidden_layers = 1000000000000 is out of range: it becomes mop's "
       "model.num_layers, which takes 1 to 4096"},
      {q, "num_hidden_layers", "-1", "num_hidden_layers = -1 is out of range"},
      {q, "num_experts", "-1", "num_experts = -1 is out of range: it becomes mop's moe.num_experts"},
      {x, "num_local_experts", "-1", "num_local_experts = -1 is out of range"},
      {x, "num_local_experts", "1000000", "num_local_experts = 1000000 is out of range"},
      {q, "vocab_size", "9999999999", "vocab_size = 9999999999 is out of range"},
      {q, "hidden_size", "0", "hidden_size = 0 is out of range"},
      {q, "num_attention_heads", "100000", "num_attention_heads = 100000 is out of range"},
      {q, "num_key_value_heads", "-2", "num_key_value_heads = -2 is out of range"},
      {q, "head_dim", "4096", "head_dim = 4096 is out of range"},
      {q, "num_experts_per_tok", "0", "num_experts_per_tok = 0 is out of range"},
      {q, "moe_intermediate_size", "-5", "moe_intermediate_size = -5 is out of range"},
      {q, "intermediate_size", "-5", "intermediate_size = -5 is out of range"},
      {x, "intermediate_size", "99999999", "intermediate_size = 99999999 is out of range"},
      {q, "rms_norm_eps", "5.0", "rms_norm_eps = 5 is out of range"},
      {q, "rope_parameters", "{\"rope_type\": \"default\", \"rope_theta\": 0.5}",
       "rope_parameters.rope_theta = 0.5 is out of range: it becomes mop's model.rope_theta"},
      // Checks across fields name the config.json fields behind mop's keys.
      {q, "num_key_value_heads", "3", "model.num_kv_heads is num_key_value_heads)"},
      {q, "num_experts_per_tok", "4", "moe.top_k is num_experts_per_tok"},
  };
  for (const ImportCase& c : cases) check_import_error(c);
  // Entries of mlp_only_layers past the last layer name no layer: ignored, a long list in one pass.
  std::string many = "[1000";
  for (int i = 1; i < 200000; ++i) many += ", " + std::to_string(1000 + i);
  CHECK(import_error_with(q, "mlp_only_layers", many + "]").empty());
}

TEST_CASE("hf: missing, misshapen, extra and non-float tensors are named", "[cpu][hf]") {
  TinyHf q;
  const std::string up = "model.layers.1.mlp.experts.2.up_proj.weight";
  auto without = [&](const std::string& name) {
    std::vector<NamedTensor> t = tiny_tensors(q);
    std::erase_if(t, [&](const NamedTensor& x) { return x.name == name; });
    return t;
  };
  CHECK(import_error_with_tensors(q, without(up)).find("no tensor '" + up + "'") !=
        std::string::npos);
  std::vector<NamedTensor> t = tiny_tensors(q);
  for (auto& x : t)
    if (x.name == up) x.shape = {4, 10};
  std::string msg = import_error_with_tensors(q, t);
  CHECK(msg.find("tensor '" + up + "' has shape [4,10]; config.json implies [5,8]") !=
        std::string::npos);
  t = tiny_tensors(q);
  t.push_back({"model.layers.0.self_attn.q_proj.bias", {12}, std::vector<float>(12, 0.5f)});
  msg = import_error_with_tensors(q, t);
  CHECK(msg.find(
            "tensor 'model.layers.0.self_attn.q_proj.bias' is not part of a Qwen3MoeForCausalLM") !=
        std::string::npos);
  // The LM head of a tied model is the embedding: accepted and ignored.
  TinyHf tied = q;
  tied.tied = true;
  t = tiny_tensors(tied);
  t.push_back({"lm_head.weight",
               {tied.vocab, tied.hidden},
               std::vector<float>(size_t(tied.vocab * tied.hidden), 0.25f)});
  CHECK(import_error_with_tensors(tied, t).empty());
  // Experts in neither layout: the per-expert names are asked for.
  test::TempDir tmp;
  write_tiny_hf(
      tmp.path / "hf", q,
      [&] {
        Json c = tiny_config(q);
        c["model_type"] = "mixtral";
        c["architectures"] = Json(Json::Array{Json("MixtralForCausalLM")});
        c["intermediate_size"] = q.ffn;
        return c;
      }(),
      tiny_tensors(q));
  msg = test::user_error_of([&] { import_hf(tmp / "hf", tmp / "ckpt"); });
  CHECK(msg.find("no tensor 'model.layers.0.block_sparse_moe.gate.weight'") != std::string::npos);
}

TEST_CASE("hf: directory problems are named", "[cpu][hf]") {
  test::TempDir tmp;
  CHECK_USER_ERROR(import_hf(tmp / "nowhere", tmp / "ckpt"), "nowhere: not a directory");
  fs::create_directories(tmp.path / "empty");
  CHECK_USER_ERROR(import_hf(tmp / "empty", tmp / "ckpt"), "no config.json");
  TinyHf q;
  write_text_file(tmp.path / "empty" / "config.json", tiny_config(q).dump(2));
  CHECK_USER_ERROR(import_hf(tmp / "empty", tmp / "ckpt"), "no *.safetensors files");
  q.shards = 2;
  write_tiny_hf(tmp.path / "sharded", q);
  fs::remove(tmp.path / "sharded" / "model-00002-of-00002.safetensors");
  CHECK_USER_ERROR(import_hf(tmp / "sharded", tmp / "ckpt"),
                   "weight_map names model-00002-of-00002.safetensors, which is not in");
  // A weight_map entry is a file name in the directory, never a path out of it.
  write_tiny_hf(tmp.path / "escape", q);
  const fs::path index = tmp.path / "escape" / "model.safetensors.index.json";
  Json j = read_json_file(index);
  for (auto& [name, file] : j["weight_map"].as_object())
    file = Json("../escape/model-00001-of-00002.safetensors");
  write_text_file(index, j.dump(2));
  CHECK_USER_ERROR(import_hf(tmp / "escape", tmp / "ckpt"),
                   "': ../escape/model-00001-of-00002.safetensors is not a file name (a file "
                   "of the directory itself)");
  q.shards = 1;
  write_tiny_hf(tmp.path / "good", q);
  import_hf(tmp / "good", tmp / "ckpt");
  CHECK_USER_ERROR(import_hf(tmp / "good", tmp / "ckpt"), "already holds checkpoints");
  // Export: into a directory with a model, as an architecture that cannot express the model.
  HfExportOptions o;
  export_hf(tmp / "ckpt", tmp / "out", o);
  CHECK_USER_ERROR(export_hf(tmp / "ckpt", tmp / "out", o), "already holds a model");
  // Another model's tokenizer files alone: refused too (they would mix with this one's).
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"}) {
    INFO(name);
    fs::create_directories(tmp.path / "tok");
    write_text_file(tmp.path / "tok" / name, "{}");
    CHECK_USER_ERROR(export_hf(tmp / "ckpt", tmp / "tok", o), std::string("already holds a model (") + name);
    CHECK_FALSE(fs::exists(tmp.path / "tok" / "config.json"));
    fs::remove_all(tmp.path / "tok");
  }
  o.arch = HfArch::Mixtral;
  CHECK_USER_ERROR(export_hf(tmp / "ckpt", tmp / "out2", o),
                   "model.qk_norm: true: MixtralForCausalLM has no q/k norm");
  CHECK_USER_ERROR(export_hf(tmp / "nothing", tmp / "out3", o), "no checkpoint found there");
  CHECK_FALSE(fs::exists(tmp.path / "out2" / "config.json"));
}

TEST_CASE("hf: byte sizes and token files", "[cpu][hf]") {
  CHECK(parse_byte_size("5GB", "--max-shard-size") == 5'000'000'000ull);
  CHECK(parse_byte_size("500MB", "--max-shard-size") == 500'000'000ull);
  CHECK(parse_byte_size("2GiB", "--max-shard-size") == 2ull << 30);
  CHECK(parse_byte_size("1234", "--max-shard-size") == 1234);
  CHECK_USER_ERROR(parse_byte_size("5XB", "--max-shard-size"),
                   "--max-shard-size: '5XB' is not a size");
  CHECK_USER_ERROR(parse_byte_size("-1", "--max-shard-size"), "is not a size");

  test::TempDir tmp;
  write_text_file(tmp.path / "t.txt", "1 2 3\n\n4 5\r\n");
  auto seqs = read_token_file(tmp / "t.txt", 0);
  REQUIRE(seqs.size() == 2);
  CHECK(seqs[0] == std::vector<int32_t>{1, 2, 3});
  CHECK(seqs[1] == std::vector<int32_t>{4, 5});
  const int32_t bin[6] = {7, 0, 300, 2, 1, 65536};
  write_text_file(tmp.path / "t.bin", std::string(reinterpret_cast<const char*>(bin), sizeof bin));
  seqs = read_token_file(tmp / "t.bin", 3);
  REQUIRE(seqs.size() == 2);
  CHECK(seqs[1] == std::vector<int32_t>{2, 1, 65536});
  CHECK(read_token_file(tmp / "t.bin", 0).size() == 1);
  CHECK_USER_ERROR(read_token_file(tmp / "t.bin", 4),
                   "6 tokens do not split into sequences of --seq-len 4");
  write_text_file(tmp.path / "odd.bin", std::string("\x01\x00\x00\x00\x02", 5));
  CHECK_USER_ERROR(read_token_file(tmp / "odd.bin", 0),
                   "5 bytes is not a whole number of int32 token ids");
  write_text_file(tmp.path / "bad.txt", "1 2 --3\n");
  CHECK_USER_ERROR(read_token_file(tmp / "bad.txt", 0), "line 1: '--3' is not a token id");
  write_text_file(tmp.path / "empty.txt", "");
  CHECK_USER_ERROR(read_token_file(tmp / "empty.txt", 0), "empty file");
  CHECK_USER_ERROR(read_token_file(tmp / "missing.txt", 0), "missing.txt: not found");

  TinyHf q;
  write_tiny_hf(tmp.path / "hf", q);
  import_hf(tmp / "hf", tmp / "ckpt");
  CHECK_USER_ERROR(
      score_sequences(tmp / "ckpt", {{1, 2, 40}}, "cpu", false),
      "token 40 at position 2 of sequence 1 is outside the vocabulary (vocab_size 40)");
  CHECK_USER_ERROR(score_sequences(tmp / "ckpt", {{1, 2}}, "tpu", false), "--device: 'tpu'");
}
