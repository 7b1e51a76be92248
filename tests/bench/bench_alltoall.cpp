// All-to-all benchmark on GPU ranks (`mpirun -np N mop_bench alltoall`; one rank without mpirun): the expert
// exchange of q3moe-8l's message sizes (T tokens × top-8 rows of 2048 bf16, 128 experts spread
// evenly; dispatch, a copy standing in for the experts, combine, in one chunk on the compute
// stream) against two of NCCL's own all-to-alls of the same bytes. Validated first (payloads
// encode the source rank and expert), then timed with CUDA events; bandwidth as nccl-tests
// defines it for all-to-all, per exchange: algBw = bytes a rank sends / time, busBw = algBw ·
// (N−1)/N.
#ifdef MOP_HAVE_CUDA

#include <cuda_runtime.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>

#include "bench.h"
#include "runtime/cuda_check.h"
#include "gpu/gpu_test_util.h"
#include "runtime/nccl_comm.h"
#include "parallel/expert_dispatch.h"
#include "parallel/mpi_comm.h"

using namespace mop;

MOP_BENCH("alltoall expert exchange vs NCCL all-to-all") {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {  // a singleton outside mpirun; finalized at exit
    MPI_Init(nullptr, nullptr);
    std::atexit([] { MPI_Finalize(); });
  }
  int R, me, gpus = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MOP_CUDA_CHECK(cudaGetDeviceCount(&gpus));
  MOP_CUDA_CHECK(cudaSetDevice(me % gpus));
  CudaOps ops;
  auto host = make_mpi_comm(MPI_COMM_WORLD);
  auto data = make_nccl_comm(*host, ops.stream());
  const int E = 128, K = 8, H = 2048;
  for (int T : {4096, 16384}) {
    const int64_t rows_out = int64_t(T) * K, max_in = rows_out * R;
    std::vector<int32_t> counts(E, int32_t(rows_out / E));
    ExpertDispatcher disp(*data, *host, ops, E, max_in);
    disp.plan(counts.data());
    // Row j of expert e on rank s holds (s·7 + e) mod 128 in every column (exact in bf16).
    test::HostTensor in(DType::BF16, {rows_out, H});
    for (int64_t r = 0; r < rows_out; ++r) {
      int e = int(r / (rows_out / E));
      for (int c = 0; c < H; ++c) in.set(r * H + c, double((me * 7 + e) % 128));
    }
    test::DeviceTensor din = test::upload(in), dback(DType::BF16, {rows_out, H});
    test::DeviceTensor dx(DType::BF16, {max_in, H}), dy(DType::BF16, {max_in, H}), scratch(DType::BF16, {max_in, H});
    Tensor x = dx.t.rows(0, disp.rows_in()), y = dy.t.rows(0, disp.rows_in());
    auto exchange = [&] {
      disp.run(din.t, dback.t, x, y, scratch.t, [&](const ExpertDispatcher::Chunk& k) {
        ops.copy(y.rows(k.row0, k.row0 + k.rows), x.rows(k.row0, k.row0 + k.rows));
      });
    };
    exchange();
    test::HostTensor got = test::download(x), back = test::download(dback.t);
    int64_t wrong = 0, q = 0;
    for (int el = 0; el < E / R; ++el)
      for (int s = 0; s < R; ++s)
        for (int64_t j = 0; j < rows_out / E; ++j, ++q)
          wrong += got.get(q * H + (q % H)) != double((s * 7 + me * (E / R) + el) % 128);
    MOP_CHECK(wrong == 0, "alltoall: ", wrong, " rows arrived wrong");
    int64_t back_wrong = 0;
    for (int64_t i = 0; i < rows_out * H; i += 97) back_wrong += back.get(i) != in.get(i);
    MOP_CHECK(back_wrong == 0, "alltoall: ", back_wrong, " elements came back wrong");
    // Timing.
    cudaEvent_t a, b;
    MOP_CUDA_CHECK(cudaEventCreate(&a));
    MOP_CUDA_CHECK(cudaEventCreate(&b));
    auto time = [&](auto&& fn) {
      for (int i = 0; i < 3; ++i) fn();
      MPI_Barrier(MPI_COMM_WORLD);
      MOP_CUDA_CHECK(cudaEventRecord(a, ops.cuda_stream()));
      const int iters = 20;
      for (int i = 0; i < iters; ++i) fn();
      MOP_CUDA_CHECK(cudaEventRecord(b, ops.cuda_stream()));
      MOP_CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      MOP_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      return double(ms) / iters;
    };
    const double bytes = double(rows_out) * H * 2;  // what each rank sends (its own share included)
    // Per direction, less the stand-in experts' copy.
    double t_disp = (time(exchange) - time([&] { ops.copy(y, x); })) / 2;
    std::vector<int64_t> even(size_t(R), rows_out / R);
    double t_nccl = time([&] {
      data->all_to_all_v(scratch.t.rows(0, rows_out), even, din.t, even);
      data->all_to_all_v(dback.t, even, scratch.t.rows(0, rows_out), even);
    }) / 2;
    if (me == 0)
      for (auto [name, ms] : {std::pair{"expert exchange (all-to-all + gather)", t_disp},
                              std::pair{"NCCL all-to-all, same bytes", t_nccl}}) {
        double alg = bytes / (ms * 1e-3) / 1e9;
        std::printf("all-to-all N=%d T=%d (%.0f MB per rank) %-38s %8.3f ms  algBw %7.1f GB/s  busBw %7.1f GB/s\n",
                    R, T, bytes / 1e6, name, ms, alg, alg * (R - 1) / R);
      }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
}

#endif  // MOP_HAVE_CUDA
