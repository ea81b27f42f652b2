// The 16-bit GEMM paths of the CPU weight-gradient GEMM (csrc/cpu/wgrad_gemm.cpp chooses among
// them): each computes c[m, n] (fp32, row stride c.stride(0)) += g[k, m]^T @ x[k, n] with beta = 1,
// exact 16-bit products summed in fp32. g and x are 2-D with unit column stride (g may be a column
// slice of a wider matrix); c has unit column stride.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace lamp {
namespace cpu {
namespace wgrad {

// oneDNN's batch-reduce GEMM micro-kernel (csrc/cpu/wgrad_brgemm.cpp). Usable for dtype when torch's
// oneDNN micro-kernel accepts dtype on this CPU (probed once: a small product compared with its exact
// value) and oneDNN is enabled (torch.backends.mkldnn.enabled, read at every call).
bool brgemm_usable(at::ScalarType dtype);
// Whether torch's oneDNN micro-kernel accepts dtype on this CPU (the probe alone: a property of the CPU and
// of oneDNN's ISA cap, not of the torch.backends.mkldnn switch).
bool brgemm_accepted_by_cpu(at::ScalarType dtype);
// Why brgemm_usable(dtype) is false ("" when it is true).
const char* brgemm_unusable_reason(at::ScalarType dtype);
// k_rows: K rows packed and multiplied per step (> 0; rounded up to even inside).
void brgemm_tn_accum(const at::Tensor& g, const at::Tensor& x, at::Tensor& c, int64_t k_rows);

}  // namespace wgrad
}  // namespace cpu
}  // namespace lamp
