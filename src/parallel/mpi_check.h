// MOP_MPI_CHECK(call): an MPI call whose failure code becomes a mop::Error naming the call and
// MPI's error string.
#pragma once

#include <mpi.h>

#include <string>

#include "core/error.h"

#define MOP_MPI_CHECK(call)                                           \
  do {                                                                \
    int mpi_rc_ = (call);                                             \
    if (mpi_rc_ != MPI_SUCCESS) {                                     \
      char msg_[MPI_MAX_ERROR_STRING];                                \
      int len_ = 0;                                                   \
      MPI_Error_string(mpi_rc_, msg_, &len_);                         \
      MOP_CHECK(false, #call, ": ", std::string(msg_, size_t(len_))); \
    }                                                                 \
  } while (0)
