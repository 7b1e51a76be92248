// The CUTLASS side of kernels/grouped_gemm_sm90.cuh, shared by its two translation units
// (grouped_gemm_sm90.cu: fwd and bwd_data; grouped_gemm_sm90_wgrad.cu: bwd_weight, which the build
// compiles in parallel): the kernel type for an op and a tile configuration, the layout of one
// call's argument arrays, and the launch. Include only from those .cu files (CUTLASS headers).
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <cute/tensor.hpp>

#include <type_traits>
#include <vector>

#include "kernels/grouped_gemm_sm90.cuh"
#include "runtime/cuda_check.h"

namespace mop::kernels::sm90 {

using cute::_1;
using cute::_128;
using cute::_2;
using cute::_256;
using cute::_64;
using cute::Shape;

// (M, N, K) of one group in CUTLASS's terms: D[M,N] = A[M,K] · B[K,N].
using GroupShape = Shape<int, int, int>;
using ProblemShape = cutlass::gemm::GroupProblemShape<GroupShape>;
using Bf16 = cutlass::bfloat16_t;

// A tile configuration: CTA tile (M, N, K), cluster, the warp-specialized schedule (cooperative:
// two consumer warpgroups share one tile; pingpong: each owns a tile and one's epilogue overlaps
// the other's mainloop), and the epilogue's subtile (CUTLASS's choice, or (M, N) to keep more of C
// in flight).
template <class Tile_, class Cluster_, bool kPingpong,
          class EpilogueTile_ = cutlass::epilogue::collective::EpilogueTileAuto>
struct TileConfig {
  using Tile = Tile_;
  using Cluster = Cluster_;
  using EpilogueTile = EpilogueTile_;
  using KernelSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

// How each op of GroupedGemmSm90Op maps onto D = A·B (RowMajor A is K-contiguous, ColumnMajor
// A M-contiguous; ColumnMajor B is K-contiguous, RowMajor B N-contiguous):
//   Fwd        M = rows, N = n, K = k:  A = x_e RowMajor,     B = w_e [n,k] ColumnMajor
//   BwdData    M = rows, N = k, K = n:  A = dy_e RowMajor,    B = w_e [n,k] RowMajor
//   BwdWeight  M = n, N = k, K = rows:  A = dy_eᵀ ColumnMajor, B = x_e RowMajor, C = D (beta 1)
//   BwdWeightWrite                      the same without C (beta 0: dw is not read)
template <GroupedGemmSm90Op kOp>
struct OpTraits;
template <>
struct OpTraits<GroupedGemmSm90Op::Fwd> {
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using ElementC = void;  // no source: beta = 0
  using ElementD = Bf16;
};
template <>
struct OpTraits<GroupedGemmSm90Op::BwdData> {
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::RowMajor;
  using ElementC = void;
  using ElementD = Bf16;
};
template <>
struct OpTraits<GroupedGemmSm90Op::BwdWeight> {
  using LayoutA = cutlass::layout::ColumnMajor;
  using LayoutB = cutlass::layout::RowMajor;
  using ElementC = float;  // dw_e += …: read and written in place
  using ElementD = float;
};
template <>
struct OpTraits<GroupedGemmSm90Op::BwdWeightWrite> : OpTraits<GroupedGemmSm90Op::BwdWeight> {
  using ElementC = void;  // dw_e = …: half the fp32 traffic
};

template <GroupedGemmSm90Op kOp, class Config>
struct GroupedGemm {
  using T = OpTraits<kOp>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16 / sizeof(Bf16);
  static constexpr int kAlignD = 16 / sizeof(typename T::ElementD);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
      typename Config::Cluster, typename Config::EpilogueTile, float, float, typename T::ElementC,
      LayoutD*, kAlignD, typename T::ElementD, LayoutD*, kAlignD, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<typename T::ElementD, float,
                                                   typename T::ElementC, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, typename T::LayoutA*, kAlignAB,
      Bf16, typename T::LayoutB*, kAlignAB, float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<int(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// One call's argument arrays, each num_experts long and 16-byte aligned, in one block (a single
// host-to-device copy): problem shapes | A | B | C | D pointers | A | B | C | D strides. Every
// stride type here holds one int64 leading dimension (the other modes are static), 8 bytes.
struct ArgsLayout {
  size_t shapes, a, b, c, d, stride_a, stride_b, stride_c, stride_d, total;
  explicit ArgsLayout(int64_t num) {
    size_t at = 0;
    auto take = [&](size_t bytes) {
      const size_t start = at;
      at = (at + bytes + 15) / 16 * 16;
      return start;
    };
    const size_t g = size_t(num);
    shapes = take(g * sizeof(GroupShape));
    a = take(g * sizeof(void*));
    b = take(g * sizeof(void*));
    c = take(g * sizeof(void*));
    d = take(g * sizeof(void*));
    stride_a = take(g * sizeof(int64_t));
    stride_b = take(g * sizeof(int64_t));
    stride_c = take(g * sizeof(int64_t));
    stride_d = take(g * sizeof(int64_t));
    total = at;
  }
};

// A stride of one dynamic leading dimension ld: mode 0 or 1, whichever is not the static 1.
template <class Stride>
Stride leading_stride(int64_t ld) {
  static_assert(sizeof(Stride) == sizeof(int64_t), "one int64 leading dimension expected");
  Stride s{};
  if constexpr (cute::is_static_v<std::remove_cvref_t<decltype(cute::get<0>(s))>>)
    cute::get<1>(s) = ld;
  else
    cute::get<0>(s) = ld;
  return s;
}

struct Launch {
  const GroupedGemmSm90Expert* experts;
  int64_t num_experts, n, k;
  void* host_args;
  void* dev_args;
  void* workspace;
  size_t workspace_bytes;
  cudaStream_t stream;
};

inline cutlass::KernelHardwareInfo hardware_info(int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  MOP_CUDA_CHECK(cudaDeviceGetAttribute(&hw.sm_count, cudaDevAttrMultiProcessorCount, device));
  return hw;
}

inline int current_device() {
  int device = 0;
  MOP_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// The kernel's arguments point only at the device copy of the arrays. The host problem shapes are
// left out: CUTLASS would use them just to size a smaller grid (one CTA per SM is launched
// instead, and CTAs without tiles exit) and to check alignment (grouped_gemm_sm90 checks it).
// So the arguments depend on a call only through the number of experts and the buffers.
template <GroupedGemmSm90Op kOp, class Config>
typename GroupedGemm<kOp, Config>::Gemm::Arguments arguments(
    const ArgsLayout& at, int64_t num, char* dev, const cutlass::KernelHardwareInfo& hw) {
  using G = GroupedGemm<kOp, Config>;
  using K = typename G::Kernel;
  using ElementC = typename G::T::ElementC;
  using ElementD = typename G::T::ElementD;
  typename G::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {int(num), reinterpret_cast<GroupShape*>(dev + at.shapes), nullptr},
      {reinterpret_cast<const Bf16**>(dev + at.a),
       reinterpret_cast<typename K::InternalStrideA*>(dev + at.stride_a),
       reinterpret_cast<const Bf16**>(dev + at.b),
       reinterpret_cast<typename K::InternalStrideB*>(dev + at.stride_b)},
      {{},
       std::is_void_v<ElementC> ? nullptr : reinterpret_cast<const ElementC**>(dev + at.c),
       reinterpret_cast<typename K::InternalStrideC*>(dev + at.stride_c),
       reinterpret_cast<ElementD**>(dev + at.d),
       reinterpret_cast<typename K::InternalStrideD*>(dev + at.stride_d)},
      hw};
  args.epilogue.thread.alpha = 1;
  args.epilogue.thread.beta = std::is_void_v<ElementC> ? 0 : 1;
  return args;
}

// Packs l's experts into the argument block, copies it to the device and launches.
template <GroupedGemmSm90Op kOp, class Config>
void run(const Launch& l) {
  using G = GroupedGemm<kOp, Config>;
  using K = typename G::Kernel;
  const ArgsLayout at(l.num_experts);
  char* host = static_cast<char*>(l.host_args);
  char* dev = static_cast<char*>(l.dev_args);
  auto* shapes = reinterpret_cast<GroupShape*>(host + at.shapes);
  auto** a = reinterpret_cast<const void**>(host + at.a);
  auto** b = reinterpret_cast<const void**>(host + at.b);
  auto** c = reinterpret_cast<const void**>(host + at.c);
  auto** d = reinterpret_cast<void**>(host + at.d);
  auto* stride_a = reinterpret_cast<typename K::InternalStrideA*>(host + at.stride_a);
  auto* stride_b = reinterpret_cast<typename K::InternalStrideB*>(host + at.stride_b);
  auto* stride_c = reinterpret_cast<typename K::InternalStrideC*>(host + at.stride_c);
  auto* stride_d = reinterpret_cast<typename K::InternalStrideD*>(host + at.stride_d);
  const int n = int(l.n), k = int(l.k);
  for (int64_t e = 0; e < l.num_experts; ++e) {
    const GroupedGemmSm90Expert& x = l.experts[e];
    const int rows = int(x.rows);
    // Leading dimensions: A's, B's, then D's (= C's) row length, per the table above.
    int64_t lda = k, ldb = k, ldd = n;
    if constexpr (kOp == GroupedGemmSm90Op::Fwd) {
      shapes[e] = GroupShape{rows, n, k};
    } else if constexpr (kOp == GroupedGemmSm90Op::BwdData) {
      shapes[e] = GroupShape{rows, k, n};
      lda = n, ldd = k;
    } else {
      shapes[e] = GroupShape{n, k, rows};
      lda = n, ldd = k;
    }
    a[e] = x.a;
    b[e] = x.b;
    c[e] = x.d;
    d[e] = x.d;
    stride_a[e] = leading_stride<typename K::InternalStrideA>(lda);
    stride_b[e] = leading_stride<typename K::InternalStrideB>(ldb);
    stride_c[e] = leading_stride<typename K::InternalStrideC>(ldd);
    stride_d[e] = leading_stride<typename K::InternalStrideD>(ldd);
  }
  MOP_CUDA_CHECK(cudaMemcpyAsync(dev, host, at.total, cudaMemcpyHostToDevice, l.stream));
  // Kernel parameters (placeholder TMA descriptors, which the kernel rewrites per group, and the
  // scheduler's) are made once per (device, number of experts, buffers) and reused: making them
  // costs several driver calls per launch.
  struct Cached {
    int device = -1;
    int64_t num_experts = 0;
    void* dev_args = nullptr;
    void* workspace = nullptr;
    typename G::Gemm::Params params;
  };
  thread_local Cached cache;
  const int device = current_device();
  if (cache.device != device || cache.num_experts != l.num_experts || cache.dev_args != dev ||
      cache.workspace != l.workspace) {
    const auto args = arguments<kOp, Config>(at, l.num_experts, dev, hardware_info(device));
    typename G::Gemm gemm;
    MOP_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess,
              "grouped_gemm_sm90: CUTLASS cannot implement the problem (n=", n, " k=", k, ")");
    MOP_CHECK(G::Gemm::get_workspace_size(args) <= l.workspace_bytes,
              "grouped_gemm_sm90: workspace of ", l.workspace_bytes, " bytes, needs ",
              G::Gemm::get_workspace_size(args));
    MOP_CHECK(gemm.initialize(args, l.workspace, l.stream) == cutlass::Status::kSuccess,
              "grouped_gemm_sm90: initialize failed");
    cache = {device, l.num_experts, dev, l.workspace, gemm.params()};
  }
  MOP_CHECK(G::Gemm::run(cache.params, l.stream) == cutlass::Status::kSuccess,
            "grouped_gemm_sm90: launch failed");
  MOP_CUDA_CHECK_LAUNCH();
}

// Workspace of a configuration on this device (it depends on the SM count only).
template <GroupedGemmSm90Op kOp, class Config>
size_t workspace_bytes() {
  const ArgsLayout at(1);
  std::vector<char> block(at.total);  // never read: the size depends on no argument array
  return GroupedGemm<kOp, Config>::Gemm::get_workspace_size(
      arguments<kOp, Config>(at, 1, block.data(), hardware_info(current_device())));
}

// The bwd_weight translation unit's entry points.
int bwd_weight_num_configs();
const char* bwd_weight_config_name(int config);
void run_bwd_weight(const Launch& l, int config, bool accumulate);
size_t bwd_weight_workspace_bytes();

}  // namespace mop::kernels::sm90
