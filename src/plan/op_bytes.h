// Bytes a memory-bound op reads and writes, one formula per op family: the time model prices ops
// with them and `mop calibrate` turns measured times into bandwidths with them, so the two count
// the same bytes. c: bytes per compute element; 4 per acc (fp32) element.
#pragma once

namespace mop::op_bytes {

// RMSNorm over rows × cols: x read, y written (forward); dy and x read, dx written (backward).
inline double norm(double rows, double cols, double c, bool backward) {
  return rows * cols * c * (backward ? 3 : 2) + rows * 4;
}
inline double rope(double tokens, double width, double c) { return 2 * tokens * width * c; }
// SwiGLU of rows × F: gu [2F] read, h [F] written; backward dh, gu read and dgu [2F] written.
inline double swiglu(double rows, double f, double c, bool backward) { return rows * f * c * (backward ? 5 : 3); }
// A row gather of rows × width (permute, Ulysses' and the dispatcher's gathers).
inline double gather(double rows, double width, double c) { return 2 * rows * width * c; }
// Router softmax/top-k over tokens × experts (fp32 logits and probabilities) into top-k pairs.
inline double router(double tokens, double experts, double k) { return tokens * experts * 8 + tokens * k * 8; }
// Embedding lookup of tokens × hidden (forward), and the scatter-add of the gradient (fp32).
inline double embedding(double tokens, double hidden, double c, bool backward) {
  return backward ? tokens * hidden * (c + 4) + tokens * 8 : tokens * hidden * c + tokens * 4;
}
// AdamW with the cast: master, m, v read and written, the gradient read, the weights written.
inline double adamw(double params, double grad_bytes, double c) { return params * (24 + grad_bytes + c); }
inline double copy(double elems, double c) { return 2 * elems * c; }

}  // namespace mop::op_bytes
