// How this process was started: under an MPI launcher (mpirun/mpiexec, srun with PMI/PMIx) or as a
// plain process. A plain process runs as a single rank without initialising MPI.
#pragma once

#include <string>

namespace mop {

bool launched_by_mpi();

// The Slurm job this process runs in ("" outside Slurm): SLURM_JOB_ID.
std::string slurm_job_id();
// `scontrol requeue <job>`: the job ends and waits in the queue to start again. Returns "" on
// success, else why not (scontrol's exit status).
std::string requeue_slurm_job(const std::string& job_id);

}  // namespace mop
