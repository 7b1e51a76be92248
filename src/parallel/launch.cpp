// Launcher detection from the environment the launchers set for each rank.
#include "parallel/launch.h"

#include <cstdlib>

namespace mop {

bool launched_by_mpi() {
  // Open MPI's mpirun, Hydra/PMI (MPICH, Intel MPI, srun --mpi=pmi2), PMIx (srun --mpi=pmix).
  const char* vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK"};
  for (const char* v : vars)
    if (std::getenv(v)) return true;
  return false;
}

}  // namespace mop
