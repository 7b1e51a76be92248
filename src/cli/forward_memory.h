// The memory check of the commands that run the model forward outside training (generate, score):
// the length of their sequences comes from the user (a prompt, a line of text, a token file), so
// before anything is allocated the activations the model plans for it, with the command's other
// buffers, are held against the memory this process may use.
#pragma once

#include <cstddef>
#include <string>

#include "core/tensor.h"
#include "model/activations.h"
#include "model/model_spec.h"

namespace mop {

// UserError unless the activations of `options` (max_seq tokens) plus `other` bytes (logits, …)
// fit `device`'s memory: the host's within the process's own limits (cgroup, ulimit
// -v), a GPU's free memory. `what` names the sequence for the message ("--text: the longest
// line").
void check_forward_memory(const std::string& what, const ModelDims& dims, const ActivationOptions& options,
                          size_t other, Device device);

}  // namespace mop
