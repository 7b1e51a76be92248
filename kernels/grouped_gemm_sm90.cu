// Hopper grouped expert GEMMs (kernels/grouped_gemm_sm90.cuh): the entry points, and the forward
// and data-gradient kernel (bwd_weight's are in grouped_gemm_sm90_wgrad.cu, compiled in parallel).
// Tile configurations were chosen by measurement on the H200 at the q3moe-8l expert shapes
// (kernels/README.md): for fwd and bwd_data, cooperative 128x256x64 with a 2x1 cluster beat
// cooperative 256x128x64 (1x1) by 1–3% everywhere and pingpong 128x128x64 (2x1) by 2–6% at 256
// rows per expert (within ±2% at 1024), so it is the only one built.
#include <algorithm>

#include "kernels/grouped_gemm_sm90_impl.cuh"

namespace mop::kernels {
namespace sm90 {
namespace {

// Clustered along M: the two CTAs of a cluster take the same weight tile (B), which TMA
// multicasts, so each expert's weights are read from L2 once per pair of row tiles.
using Coop128x256Cluster2x1 = TileConfig<Shape<_128, _256, _64>, Shape<_2, _1, _1>, false>;

// fwd and bwd_data share the list (M = rows for both).
constexpr const char* kConfigNames[] = {"cooperative 128x256x64 cluster 2x1"};
constexpr int kNumConfigs = int(sizeof(kConfigNames) / sizeof(kConfigNames[0]));
constexpr int kDefaultConfig = 0;

template <GroupedGemmSm90Op kOp>
void run_config(const Launch& l, int config) {
  switch (config) {
    case 0:
      return run<kOp, Coop128x256Cluster2x1>(l);
  }
  MOP_UNREACHABLE("grouped_gemm_sm90: config ", config);
}

template <GroupedGemmSm90Op kOp>
size_t max_workspace_bytes() {
  return workspace_bytes<kOp, Coop128x256Cluster2x1>();
}

}  // namespace
}  // namespace sm90

size_t grouped_gemm_sm90_args_bytes(int64_t num_experts) {
  return sm90::ArgsLayout(num_experts).total;
}

size_t grouped_gemm_sm90_workspace_bytes() {
  return std::max({sm90::max_workspace_bytes<GroupedGemmSm90Op::Fwd>(),
                   sm90::max_workspace_bytes<GroupedGemmSm90Op::BwdData>(),
                   sm90::bwd_weight_workspace_bytes()});
}

namespace {
bool is_bwd_weight(GroupedGemmSm90Op op) {
  return op == GroupedGemmSm90Op::BwdWeight || op == GroupedGemmSm90Op::BwdWeightWrite;
}
}  // namespace

int grouped_gemm_sm90_num_configs(GroupedGemmSm90Op op) {
  return is_bwd_weight(op) ? sm90::bwd_weight_num_configs() : sm90::kNumConfigs;
}

const char* grouped_gemm_sm90_config_name(GroupedGemmSm90Op op, int config) {
  MOP_CHECK(config >= 0 && config < grouped_gemm_sm90_num_configs(op), "grouped_gemm_sm90: config ",
            config);
  return is_bwd_weight(op) ? sm90::bwd_weight_config_name(config) : sm90::kConfigNames[config];
}

void grouped_gemm_sm90(GroupedGemmSm90Op op, const GroupedGemmSm90Expert* experts,
                       int64_t num_experts, int64_t n, int64_t k, void* host_args, void* dev_args,
                       void* workspace, size_t workspace_bytes, int config, cudaStream_t stream) {
  MOP_CHECK(num_experts >= 1 && n >= 1 && k >= 1 && n % kGroupedGemmSm90Multiple == 0 &&
                k % kGroupedGemmSm90Multiple == 0 && n <= INT32_MAX && k <= INT32_MAX,
            "grouped_gemm_sm90: ", num_experts, " experts, n=", n, " k=", k);
  for (int64_t e = 0; e < num_experts; ++e) {
    const GroupedGemmSm90Expert& x = experts[e];
    MOP_CHECK(x.rows >= 1 && x.rows <= INT32_MAX, "grouped_gemm_sm90: expert ", e, " has ", x.rows,
              " rows");
    for (const void* p : {x.a, x.b, static_cast<const void*>(x.d)})
      MOP_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "grouped_gemm_sm90: a pointer of expert ",
                e, " is not 16-byte aligned");
  }
  const sm90::Launch l{experts,   num_experts,     n,     k, host_args, dev_args,
                       workspace, workspace_bytes, stream};
  const int c = config < 0 ? -1 : config;
  switch (op) {
    case GroupedGemmSm90Op::Fwd:
      return sm90::run_config<GroupedGemmSm90Op::Fwd>(l, c < 0 ? sm90::kDefaultConfig : c);
    case GroupedGemmSm90Op::BwdData:
      return sm90::run_config<GroupedGemmSm90Op::BwdData>(l, c < 0 ? sm90::kDefaultConfig : c);
    case GroupedGemmSm90Op::BwdWeight:
    case GroupedGemmSm90Op::BwdWeightWrite:
      return sm90::run_bwd_weight(l, c, op == GroupedGemmSm90Op::BwdWeight);
  }
}

}  // namespace mop::kernels
