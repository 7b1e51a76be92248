// Golden values from transformers (tests/hf/golden, written by scripts/hf_make_golden.py): a tiny
// Qwen3MoeForCausalLM (fp32, dense layer 0, tied head, no top-k renormalisation) and a tiny
// MixtralForCausalLM (bf16) saved by save_pretrained, with transformers' fp32 logits and loss on
// two sequences. mop imports them, scores on the CPU in fp32 and must agree; exporting the import
// must give back the files transformers wrote, byte for byte.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "catch.h"
#include "ckpt/json.h"
#include "cli/hf_interop.h"
#include "cli/score.h"
#include "core/small_file.h"
#include "test_util.h"

using namespace mop;
namespace fs = std::filesystem;

namespace {

// Both sides compute in fp32 with different summation orders (hidden 16, head_dim 8 or 4); the
// largest logit is ~3.3 and the measured difference 4.3e-6 (Qwen3) / 1.3e-6 (Mixtral), so 1e-4
// leaves 20× for other compilers and vector widths while a wrong weight or routing choice
// (differences ≥ 1e-2) fails.
constexpr double kLogitAbsTol = 1e-4;
// The mean cross-entropy over 25 targets: measured relative difference 2e-8.
constexpr double kLossRelTol = 1e-5;

const fs::path kGolden = fs::path(MOP_SOURCE_DIR) / "tests" / "hf" / "golden";

}  // namespace

TEST_CASE("hf: golden transformers logits and loss (Qwen3-MoE fp32, Mixtral bf16)", "[cpu][hf]") {
  for (const char* arch : {"qwen3_moe", "mixtral"}) {
    INFO(arch);
    const fs::path dir = kGolden / arch;
    Json expected = read_json_file(dir / "expected.json");
    test::TempDir tmp;
    HfImportResult imp = import_hf(dir.string(), tmp / "ckpt");
    CHECK(hf_arch_name(imp.imported.arch) == arch);
    auto seqs = read_token_file((kGolden / "tokens.txt").string(), 0);
    ScoreResult r = score_sequences(tmp / "ckpt", seqs, "cpu", true);
    REQUIRE(r.tokens == expected.at("tokens").as_int64());
    REQUIRE(r.predicted == expected.at("predicted").as_int64());
    REQUIRE(r.vocab == expected.at("vocab").as_int64());
    const double loss = expected.at("loss").as_double();
    INFO("mop loss " << r.mean_ce() << ", transformers " << loss);
    CHECK(std::fabs(r.mean_ce() - loss) <= kLossRelTol * loss);

    std::string bytes = read_small_file(dir / expected.at("logits").as_string(), "", kTextFileCap);
    REQUIRE(bytes.size() == r.logits.size() * sizeof(float));
    std::vector<float> want(r.logits.size());
    std::memcpy(want.data(), bytes.data(), bytes.size());
    double max_err = 0;
    size_t worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      double e = std::fabs(double(r.logits[i]) - double(want[i]));
      if (e > max_err) max_err = e, worst = i;
    }
    INFO("max |logit difference| " << max_err << " at token " << worst / size_t(r.vocab) << ", id "
                                   << worst % size_t(r.vocab));
    CHECK(max_err <= kLogitAbsTol);

    // Export as transformers saved it (fp32 / bf16, per-expert): the same file, byte for byte.
    HfExportOptions o;
    o.dtype = std::string(arch) == "mixtral" ? DType::BF16 : DType::F32;
    export_hf(tmp / "ckpt", tmp / "out", o);
    CHECK(read_small_file(tmp.path / "out" / "model.safetensors", "", kTextFileCap) ==
          read_small_file(dir / "model.safetensors", "", kTextFileCap));
  }
}
