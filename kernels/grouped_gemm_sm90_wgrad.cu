// Hopper grouped weight gradient dw_e += dy_eᵀ · x_e (kernels/grouped_gemm_sm90.cuh, BwdWeight):
// fp32 C read and D written in place, K = the expert's rows (small and variable), so each tile's
// mainloop is short and its epilogue streams 2 × 4 bytes per output element: at 256 rows per
// expert the op is bound by HBM traffic on dw, not by the tensor cores.
#include <algorithm>

#include "kernels/grouped_gemm_sm90_impl.cuh"

namespace mop::kernels::sm90 {
namespace {

// Cooperative runs a tile's epilogue after its mainloop; pingpong overlaps one warpgroup's
// epilogue (the fp32 read-modify-write of dw, the bulk of the time) with the other's mainloop, and
// a 64x64 epilogue subtile (CUTLASS picks 64x32) keeps more of C in flight per SM. Measured on the
// H200 (kernels/README.md), pingpong is the default: +1–7% over cooperative, except 3% slower on
// the down projection at 1024 rows per expert. Tried and dropped: pingpong with a 64x128 subtile
// (1–6% below 64x64); in an earlier lease, cooperative 256x128x64 (2–12% below) and pingpong with
// CUTLASS's subtile (up to 16% below at 256 rows).
using Pingpong128x128Epi64x64 =
    TileConfig<Shape<_128, _128, _64>, Shape<_1, _1, _1>, true, Shape<_64, _64>>;
using Coop128x256 = TileConfig<Shape<_128, _256, _64>, Shape<_1, _1, _1>, false>;

constexpr const char* kConfigNames[] = {"pingpong 128x128x64 epilogue 64x64",
                                        "cooperative 128x256x64 cluster 1x1"};
constexpr int kDefaultConfig = 0;
constexpr GroupedGemmSm90Op kAdd = GroupedGemmSm90Op::BwdWeight;
constexpr GroupedGemmSm90Op kWrite = GroupedGemmSm90Op::BwdWeightWrite;

template <GroupedGemmSm90Op kOp>
void run_config(const Launch& l, int config) {
  switch (config < 0 ? kDefaultConfig : config) {
    case 0:
      return run<kOp, Pingpong128x128Epi64x64>(l);
    case 1:
      return run<kOp, Coop128x256>(l);
  }
  MOP_UNREACHABLE("grouped_gemm_sm90: bwd_weight config ", config);
}

}  // namespace

int bwd_weight_num_configs() {
  return int(sizeof(kConfigNames) / sizeof(kConfigNames[0]));
}

const char* bwd_weight_config_name(int config) {
  return kConfigNames[config];
}

void run_bwd_weight(const Launch& l, int config, bool accumulate) {
  return accumulate ? run_config<kAdd>(l, config) : run_config<kWrite>(l, config);
}

size_t bwd_weight_workspace_bytes() {
  return std::max(
      {workspace_bytes<kAdd, Pingpong128x128Epi64x64>(), workspace_bytes<kAdd, Coop128x256>(),
       workspace_bytes<kWrite, Pingpong128x128Epi64x64>(), workspace_bytes<kWrite, Coop128x256>()});
}

}  // namespace mop::kernels::sm90
