// How this process was started: under an MPI launcher (mpirun/mpiexec, srun with PMI/PMIx) or as a
// plain process. A plain process runs as a single rank without initialising MPI.
#pragma once

namespace mop {

bool launched_by_mpi();

}  // namespace mop
