// CUDA weight-gradient GEMM with accumulation, as apex's fused_weight_gradient_dense:
// main_grad[out, in] += grad_output[k, out]^T @ input[k, in] with one cublasGemmEx call
// (beta = 1, CUBLAS_COMPUTE_32F) on torch's cuBLAS handle and current stream.
//
// cuBLAS is column-major: the row-major main_grad [out, in] is the column-major matrix
// C' [in, out] = input'[in, k] * grad_output'[k, out], i.e. op(A) = N on input (lda = in) and
// op(B) = T on grad_output (ldb = out), ldc = in.
//
// C is fp32 for wgrad_gemm_accum_fp32. For a 16-bit main_grad, cuBLAS takes C in the
// operands' 16-bit type (fp32 compute, one rounding); fp32 operands into a 16-bit main_grad
// go through an fp32 copy of main_grad instead. K (tokens) is split into calls that keep
// every operand slice below 2^31 elements (cuBLAS takes int sizes).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "checks.h"
#include "kernels.h"

namespace at {
namespace cuda {
// Declared in ATen/cuda/CUDAContextLight.h (libtorch_cuda); repeated here so this file needs
// only cuBLAS's own header: the handle is bound to the current stream and device.
cublasHandle_t getCurrentCUDABlasHandle(bool setup);
}  // namespace cuda
}  // namespace at

namespace lamp {
namespace cuda {
namespace {

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return CUDA_R_32F;
    case at::kHalf:
      return CUDA_R_16F;
    case at::kBFloat16:
      return CUDA_R_16BF;
    default:
      TORCH_CHECK_TYPE(false, "wgrad_gemm_accum: unsupported dtype ", t);
  }
}

#define LAMP_CUBLAS_CHECK(expr)                                                                   \
  do {                                                                                            \
    const cublasStatus_t status_ = (expr);                                                        \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "wgrad_gemm_accum: ", #expr, " failed: ",      \
                cublasGetStatusString(status_), " (", static_cast<int>(status_), ")");            \
  } while (0)

// c[out, in] (row-major, dtype c.scalar_type()) += g[k, out]^T @ x[k, in], beta = 1.
void gemm_accum(const at::Tensor& x, const at::Tensor& g, at::Tensor& c) {
  const int64_t k = x.size(0), n_in = x.size(1), n_out = g.size(1);
  if (k == 0 || n_in == 0 || n_out == 0) return;
  const char* op = "wgrad_gemm_accum";
  LAMP_CHECK_FITS_INT32(op, "in features", n_in);
  LAMP_CHECK_FITS_INT32(op, "out features", n_out);
  const int64_t step = std::max<int64_t>(
      1, std::min<int64_t>(std::numeric_limits<int32_t>::max() / std::max(n_in, n_out), std::numeric_limits<int32_t>::max()));
  const cudaDataType_t ab_type = cuda_type(x.scalar_type());
  const cudaDataType_t c_type = cuda_type(c.scalar_type());
  const float alpha = 1.f, beta = 1.f;
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle(true);
  for (int64_t k0 = 0; k0 < k; k0 += step) {
    const int64_t kk = std::min(step, k - k0);
    const char* xp = static_cast<const char*>(x.data_ptr()) + k0 * n_in * x.element_size();
    const char* gp = static_cast<const char*>(g.data_ptr()) + k0 * n_out * g.element_size();
    LAMP_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(n_in), static_cast<int>(n_out),
                                   static_cast<int>(kk), &alpha, xp, ab_type, static_cast<int>(n_in), gp, ab_type,
                                   static_cast<int>(n_out), &beta, c.data_ptr(), c_type, static_cast<int>(n_in),
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

}  // namespace

void wgrad_gemm_accum(const at::Tensor& x, const at::Tensor& g, at::Tensor& main_grad) {
  const c10::cuda::CUDAGuard guard(main_grad.device());
  const bool direct = main_grad.scalar_type() == at::kFloat || main_grad.scalar_type() == x.scalar_type();
  if (direct) {
    gemm_accum(x, g, main_grad);
    return;
  }
  at::Tensor acc = main_grad.to(at::kFloat);  // fp32 operands into a 16-bit main_grad
  gemm_accum(x, g, acc);
  main_grad.copy_(acc);
}

}  // namespace cuda
}  // namespace lamp
