// A byte-level corpus that every rank of MPI_COMM_WORLD sees at the same path (the trainers'
// configs must agree): rank 0 writes it into a scratch directory, which lives as long as the
// returned object.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "train/train_test_util.h"

namespace mop::test {

struct SharedCorpus {
  std::unique_ptr<TempDir> dir;  // rank 0 only
  std::string root;              // the directory; the shard is root + "/corpus"
};

inline SharedCorpus shared_corpus(size_t bytes) {
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  SharedCorpus c;
  std::string root(512, '\0');
  if (me == 0) {
    c.dir = std::make_unique<TempDir>();
    prepare_corpus(*c.dir, bytes);
    root = c.dir->path.string();
    root.resize(512, '\0');
  }
  MPI_Bcast(root.data(), 512, MPI_CHAR, 0, MPI_COMM_WORLD);
  c.root = root.c_str();
  return c;
}

}  // namespace mop::test
