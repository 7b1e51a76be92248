// Test entry point: MPI is initialised when the binary runs under mpirun (for [mpi] tests);
// "[gpu]" runs without a CUDA device exit with 77, which ctest reports as skipped.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#ifndef MOP_CATCH3
#define CATCH_CONFIG_RUNNER
#endif
#include "catch.h"
#include "test_util.h"

int main(int argc, char** argv) {
  bool gpu_only = false, mpi_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "[gpu]") gpu_only = true;
    if (a == "[mpi]") mpi_only = true;
  }
  if (gpu_only && !mop::test::gpu_available()) {
    std::printf("SKIPPED: no CUDA device here; [gpu] tests run on a GPU machine\n");
    return 77;
  }
  bool use_mpi = mop::test::launched_by_mpi();
  if (mpi_only && !use_mpi) {
    std::printf("SKIPPED: [mpi] tests run under mpirun -np N\n");
    return 77;
  }
  if (use_mpi) MPI_Init(&argc, &argv);
  int rank = 0;
  if (use_mpi) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  Catch::Session session;
  int rc = session.applyCommandLine(argc, argv);
  if (rc == 0) rc = session.run();
  if (use_mpi) {
    // Any failing rank fails the job.
    int worst = 0;
    MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    rc = worst;
    MPI_Finalize();
  }
  return rc;
}
