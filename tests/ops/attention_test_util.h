// The attention tests' cases on the CPU reference (attention_test.cpp, attention_merge_test.cpp):
// a shape and its q, k, v, out and lse tensors filled from a seed.
#pragma once

#include "ops/ops_test_util.h"

namespace mop::test::attn {

struct AttnCase {
  int batch;
  int64_t seq, num_q_heads, num_kv_heads, head_dim;
  int64_t tokens() const { return batch * seq; }
};

struct AttnTensors {
  HostTensor q, k, v, out, lse;
  AttnTensors(DType dt, const AttnCase& c, uint64_t seed, bool bf16_exact)
      : q(dt, {c.tokens(), c.num_q_heads, c.head_dim}),
        k(dt, {c.tokens(), c.num_kv_heads, c.head_dim}),
        v(dt, {c.tokens(), c.num_kv_heads, c.head_dim}),
        out(dt, {c.tokens(), c.num_q_heads, c.head_dim}),
        lse(acc_dtype(dt), {c.batch, c.num_q_heads, c.seq}) {
    for (HostTensor* t : {&q, &k, &v}) {
      if (bf16_exact)
        fill_uniform(*t, seed++, -2, 2);
      else
        fill_random(*t, seed++, -2, 2);
    }
  }
};

}  // namespace mop::test::attn
