// Launcher detection from the environment the launchers set for each rank.
#include "parallel/launch.h"

#include <sys/wait.h>

#include <cctype>
#include <cstdlib>

namespace mop {

bool launched_by_mpi() {
  // Open MPI's mpirun, Hydra/PMI (MPICH, Intel MPI, srun --mpi=pmi2), PMIx (srun --mpi=pmix).
  const char* vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK"};
  for (const char* v : vars)
    if (std::getenv(v)) return true;
  return false;
}

std::string slurm_job_id() {
  const char* id = std::getenv("SLURM_JOB_ID");
  return id ? id : "";
}

std::string requeue_slurm_job(const std::string& job_id) {
  for (char c : job_id)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_')
      return "SLURM_JOB_ID '" + job_id + "' is not a job id";
  const std::string cmd = "scontrol requeue " + job_id + " 2>&1";
  const int status = std::system(cmd.c_str());
  if (status == 0) return "";
  if (status == -1) return "cannot run scontrol";
  return "`scontrol requeue " + job_id + "` exited with " +
         std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

}  // namespace mop
