// import-hf → export-hf gives back every tensor byte for byte (names, dtypes, shapes, bytes) for
// both architectures, both expert layouts, bf16 and fp32, one file or shards; the checkpoint holds
// each Hugging Face tensor under the right name of ours (Mixtral's w1/w3/w2, slices of fused
// experts), zero Adam moments, and loads through the trainer's load_checkpoint.
#include <filesystem>

#include "catch.h"
#include "ckpt/manifest.h"
#include "cli/hf_interop.h"
#include "hf/hf_test_util.h"
#include "ops/ops.h"
#include "optim/optimizer.h"
#include "test_util.h"
#include "train/checkpointing.h"

using namespace mop;
using namespace mop::hf_test;
namespace fs = std::filesystem;

namespace {

void check_same_tensors(const fs::path& expected_dir, const fs::path& actual_dir) {
  auto want = read_all_tensors(expected_dir), got = read_all_tensors(actual_dir);
  CHECK(want.size() == got.size());
  for (const auto& [name, t] : want) {
    INFO("tensor " << name);
    auto it = got.find(name);
    REQUIRE(it != got.end());
    CHECK(it->second.dtype == t.dtype);
    CHECK(it->second.shape == t.shape);
    CHECK(it->second.bytes == t.bytes);
  }
}

}  // namespace

TEST_CASE("hf: import then export gives back every tensor byte for byte", "[cpu][hf]") {
  struct Variant {
    const char* what;
    TinyHf m;
    uint64_t shard_bytes;
    bool sharded_out;
  };
  TinyHf q;  // Qwen3-MoE, per-expert, fp32, one file
  TinyHf q_bf16_sharded = q;
  q_bf16_sharded.dtype = DType::BF16, q_bf16_sharded.shards = 3, q_bf16_sharded.first_dense = 1;
  TinyHf q_fused = q;
  q_fused.fused = true, q_fused.tied = true;
  TinyHf x;
  x.arch = "mixtral", x.layers = 2, x.head_dim = 4, x.tied = true;
  TinyHf x_fused_bf16 = x;
  x_fused_bf16.fused = true, x_fused_bf16.dtype = DType::BF16, x_fused_bf16.tied = false,
  x_fused_bf16.shards = 2;
  const Variant variants[] = {
      {"qwen3_moe per-expert fp32", q, 5'000'000'000, false},
      {"qwen3_moe per-expert bf16, 3 shards, dense layer 0", q_bf16_sharded, 2000, true},
      {"qwen3_moe fused fp32 tied", q_fused, 5'000'000'000, false},
      {"mixtral per-expert fp32 tied", x, 5'000'000'000, false},
      {"mixtral fused bf16, 2 shards", x_fused_bf16, 1000, true},
  };
  for (const Variant& v : variants) {
    INFO(v.what);
    test::TempDir tmp;
    write_tiny_hf(tmp.path / "hf", v.m);
    HfImportResult imp = import_hf(tmp / "hf", tmp / "ckpt");
    CHECK(imp.layout == (v.m.fused ? HfLayout::Fused : HfLayout::PerExpert));
    CHECK(imp.checkpoint_dir == (tmp.path / "ckpt" / "step_0").string());
    HfExportOptions o;
    o.layout = imp.layout;
    o.dtype = v.m.dtype;
    o.max_shard_bytes = v.shard_bytes;
    HfExportResult exp = export_hf(tmp / "ckpt", tmp / "out", o);
    CHECK(exp.arch == (v.m.arch == "mixtral" ? HfArch::Mixtral : HfArch::Qwen3Moe));
    CHECK((exp.shards.num_shards > 1) == v.sharded_out);
    CHECK(fs::exists(tmp.path / "out" / "model.safetensors.index.json") == v.sharded_out);
    check_same_tensors(tmp.path / "hf", tmp.path / "out");
    // The exported config.json maps back to the same model.
    HfImportedConfig again =
        hf_config_to_mop(read_json_file(tmp.path / "out" / "config.json"), "out/config.json");
    CHECK(again.arch == imp.imported.arch);
    // router_aux_loss_coef 0.001 with top-2 is mop's 0.002 (hf_config.cpp), and back.
    CHECK(imp.imported.config.moe.aux_loss_coef == 0.002);
    CHECK(read_json_file(tmp.path / "out" / "config.json").at("router_aux_loss_coef").as_double() ==
          0.001);
    CHECK(hf_config_yaml_fragment(again.config, "") ==
          hf_config_yaml_fragment(imp.imported.config, ""));
    // The context length comes back as it went in (not a default of 32768).
    CHECK(read_json_file(tmp.path / "out" / "config.json").at("max_position_embeddings").as_int64() ==
          read_json_file(tmp.path / "hf" / "config.json").at("max_position_embeddings").as_int64());
  }
}

TEST_CASE("hf: the checkpoint holds each Hugging Face tensor under our name, zero moments, step 0",
          "[cpu][hf]") {
  // tiny_tensors keys every value by the Qwen3-MoE per-expert name, whatever the layout writes:
  // the checkpoint (which uses exactly those names) must hold those values.
  TinyHf x;
  x.arch = "mixtral", x.layers = 2, x.head_dim = 4, x.dtype = DType::BF16;
  TinyHf q;
  q.fused = true, q.first_dense = 1, q.tied = true;
  for (const TinyHf& m : {x, q}) {
    INFO(m.arch << (m.fused ? " fused" : " per-expert"));
    test::TempDir tmp;
    write_tiny_hf(tmp.path / "hf", m);
    HfImportResult imp = import_hf(tmp / "hf", tmp / "ckpt");
    SafetensorsFile model(fs::path(imp.checkpoint_dir) / "model.safetensors");
    ModelLayout layout = ModelLayout::build(ModelDims::from(imp.imported.config));
    CHECK(model.tensors().size() == layout.hf_views().size());
    for (const auto& [name, t] : model.tensors()) {
      INFO(name);
      REQUIRE(t.dtype == DType::F32);
      std::vector<float> want = tensor_values(m.seed, name, t.numel());
      CHECK(std::memcmp(t.data, want.data(), t.bytes) == 0);
    }
    SafetensorsFile moments(fs::path(imp.checkpoint_dir) / "optimizer.safetensors");
    CHECK(moments.tensors().size() == 2 * model.tensors().size());
    for (const auto& [name, t] : moments.tensors()) {
      INFO(name);
      const float* p = static_cast<const float*>(t.data);
      CHECK(std::all_of(p, p + t.numel(), [](float f) { return f == 0.0f; }));
    }
    Manifest man = verify_checkpoint(imp.checkpoint_dir);
    CHECK(man.step == 0);
    CHECK(man.state.at("consumed_samples").as_int64() == 0);
    CHECK(man.state.at("optimizer_updates").as_int64() == 0);
    CHECK(fs::exists(tmp.path / "ckpt" / "model.yaml"));
    // model.yaml is a valid config fragment with the imported model.
    Config from_yaml = load_config(tmp / "ckpt/model.yaml");
    CHECK(dump_config(from_yaml).find("num_experts: 3") != std::string::npos);
    CHECK(from_yaml.model.qk_norm == (m.arch == "qwen3_moe"));
    CHECK(from_yaml.moe.first_dense_layers == m.first_dense);
  }
}

TEST_CASE("hf: an imported checkpoint loads through the trainer's load_checkpoint", "[cpu][hf]") {
  TinyHf q;
  q.first_dense = 1;
  test::TempDir tmp;
  write_tiny_hf(tmp.path / "hf", q);
  // Weights in files of at most 2 KB (one tensor of layer 1's experts is 480 bytes): many files.
  HfImportResult imp = import_hf(tmp / "hf", tmp / "ckpt", 2000);
  int model_files = 0;
  for (const auto& e : fs::directory_iterator(imp.checkpoint_dir))
    model_files += e.path().filename().string().starts_with("model-");
  CHECK(model_files > 3);
  Config cfg = checkpoint_config(imp.checkpoint_dir);
  cfg.train.device = "cpu";
  ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  auto ops = make_cpu_ops();
  ParamStore params(layout, DType::F32, DType::F32, MemKind::Host);
  Optimizer optim(cfg.optim, params, *ops);
  TrainerState st = load_checkpoint(imp.checkpoint_dir, cfg, params, optim, /*optim_state=*/true);
  CHECK(st.step == 0);
  CHECK(st.consumed_samples == 0);
  CHECK(optim.updates() == 0);
  // An expert's up projection: rows F..2F of the fused [2F, H] block of expert 2, layer 2.
  const LayerParams& lp = layout.layers[2];
  Tensor w = params.weight(lp.experts_gate_up);
  std::vector<float> want =
      tensor_values(q.seed, "model.layers.2.mlp.experts.2.up_proj.weight", q.ffn * q.hidden);
  const float* got = w.ptr<float>() + (2 * 2 * q.ffn + q.ffn) * q.hidden;
  CHECK(std::memcmp(got, want.data(), want.size() * sizeof(float)) == 0);
}

TEST_CASE("hf: fused and per-expert checkpoints convert into each other", "[cpu][hf]") {
  for (const char* arch : {"qwen3_moe", "mixtral"}) {
    INFO(arch);
    TinyHf per;
    per.arch = arch, per.dtype = DType::BF16;
    if (per.arch == "mixtral") per.layers = 2, per.head_dim = 4;
    TinyHf fused = per;
    fused.fused = true;
    test::TempDir tmp;
    write_tiny_hf(tmp.path / "per", per);
    write_tiny_hf(tmp.path / "fused", fused);
    import_hf(tmp / "per", tmp / "ckpt_per");
    import_hf(tmp / "fused", tmp / "ckpt_fused");
    HfExportOptions o;
    o.dtype = DType::BF16;
    o.layout = HfLayout::PerExpert;
    export_hf(tmp / "ckpt_fused", tmp / "fused_as_per", o);
    o.layout = HfLayout::Fused;
    export_hf(tmp / "ckpt_per", tmp / "per_as_fused", o);
    check_same_tensors(tmp.path / "per", tmp.path / "fused_as_per");
    check_same_tensors(tmp.path / "fused", tmp.path / "per_as_fused");
  }
}
