// Declarations of the kernels behind lightning_amp._C (compiled-core part). The entry
// points in bindings.cpp check arguments and pick the device; these functions assume
// checked arguments (2-D contiguous operands, matching devices, supported dtypes).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace lamp {
namespace cpu {

// main_grad[m, n] += g[k, m]^T @ x[k, n]; main_grad float32 (beta = 1, no product temporary)
// or float16/bfloat16 (fp32 product tile added and rounded once per element).
void wgrad_gemm_accum(const at::Tensor& x, const at::Tensor& g, at::Tensor& main_grad);

// Which CPU GEMM serves operands of dtype now: "mkl" (cblas_gemm_bf16bf16f32 / f16f16f32)
// or "aten" (fp32 upcast of K-blocks of the operands, then addmm_; always for fp32).
std::string wgrad_cpu_gemm_backend(at::ScalarType dtype);
// Whether MKL's 16-bit GEMM for dtype was found in the process at all.
bool wgrad_cpu_has_mkl_gemm(at::ScalarType dtype);

// Test / benchmark hooks: cap on the rows (K) handed to one BLAS call (0 = automatic: the
// largest K that keeps every operand below 2^31 elements), and the 16-bit GEMM policy:
// "auto" (MKL when the CPU has AMX for the dtype), "mkl" (whenever found) or "aten".
void set_wgrad_k_chunk(int64_t rows);
int64_t wgrad_k_chunk();
void set_wgrad_cpu_gemm_policy(const std::string& policy);

at::Tensor multi_tensor_scale(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale,
                              at::Tensor& found_inf);

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors);

}  // namespace cpu

#ifdef WITH_CUDA
namespace cuda {

void wgrad_gemm_accum(const at::Tensor& x, const at::Tensor& g, at::Tensor& main_grad);

at::Tensor multi_tensor_scale(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale,
                              at::Tensor& found_inf);

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors);

}  // namespace cuda
#endif

}  // namespace lamp
