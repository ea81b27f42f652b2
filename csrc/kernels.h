// Declarations of the kernels behind lightning_amp._C (compiled-core part). The entry
// points in bindings.cpp check arguments and pick the device; these functions assume
// checked arguments (2-D contiguous operands, matching devices, supported dtypes).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace lamp {
namespace cpu {

// main_grad[m, n] += g[k, m]^T @ x[k, n]; main_grad float32 (beta = 1, no product temporary)
// or float16/bfloat16 (fp32 product tile added and rounded once per element).
void wgrad_gemm_accum(const at::Tensor& x, const at::Tensor& g, at::Tensor& main_grad);

// Which CPU GEMM serves operands of dtype now: "onednn", "mkl" or "aten" (csrc/cpu/wgrad_gemm.cpp
// says what each is; float32 always "aten"). Under the "fastest" policy this runs the one-time
// measurement of the 16-bit paths if it has not run yet.
std::string wgrad_cpu_gemm_backend(at::ScalarType dtype);
// Each path with the reason it cannot serve dtype now ("" = usable).
std::vector<std::pair<std::string, std::string>> wgrad_cpu_gemm_paths(at::ScalarType dtype);
// The "fastest" measurement for a 16-bit dtype (made now if not yet): the paths usable at the time,
// fastest first, with the seconds of their fastest round.
std::vector<std::pair<std::string, double>> wgrad_cpu_gemm_calibration(at::ScalarType dtype);

// Test / benchmark hooks: cap on the rows (K) handed to one GEMM call (0 = automatic: the
// largest K that keeps every operand below 2^31 elements for MKL, the default step of the other
// paths), and the 16-bit GEMM policy: "auto" (the machine's measured choice where set, else a rule of the
// CPU: the same path in every process),
// "fastest" (the fastest path measured once per process and dtype) or a path ("onednn", "mkl", "aten"),
// which then must be usable.
void set_wgrad_k_chunk(int64_t rows);
int64_t wgrad_k_chunk();
void set_wgrad_cpu_gemm_policy(const std::string& policy);
// The machine's measured path for 16-bit dtype, taken by "auto" while it is usable ("" clears it: the
// rule decides); lightning_amp.ops reads it from the cache beside the build.
void set_wgrad_cpu_gemm_choice(at::ScalarType dtype, const std::string& path);
std::string wgrad_cpu_gemm_choice(at::ScalarType dtype);

at::Tensor multi_tensor_scale(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale,
                              at::Tensor& found_inf);

// found_inf set to 1 when any element of tensors is inf or nan; the tensors are only read.
void multi_tensor_check_finite(const std::vector<at::Tensor>& tensors, at::Tensor& found_inf);

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors);

}  // namespace cpu

#ifdef WITH_CUDA
namespace cuda {

void wgrad_gemm_accum(const at::Tensor& x, const at::Tensor& g, at::Tensor& main_grad);

at::Tensor multi_tensor_scale(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale,
                              at::Tensor& found_inf);

void multi_tensor_check_finite(const std::vector<at::Tensor>& tensors, at::Tensor& found_inf);

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors);

}  // namespace cuda
#endif

}  // namespace lamp
