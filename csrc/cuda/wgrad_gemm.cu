// CUDA weight-gradient GEMM with accumulation, as apex's fused_weight_gradient_dense:
// main_grad[out, in] += grad_output[k, out]^T @ input[k, in] with one cublasGemmEx call
// (beta = 1, CUBLAS_COMPUTE_32F) on torch's cuBLAS handle and current stream.
//
// cuBLAS is column-major: the row-major main_grad [out, in] is the column-major matrix
// C' [in, out] = input'[in, k] * grad_output'[k, out], i.e. op(A) = N on input (lda = in) and
// op(B) = T on grad_output (ldb = out), ldc = in.
//
// C is always fp32 (CUBLAS_COMPUTE_32F, beta = 1). wgrad_gemm_accum_fp32 accumulates straight
// into main_grad. A 16-bit main_grad is rounded exactly once per element: row tiles of it are
// upcast into an fp32 workspace (exact), the GEMM accumulates into the workspace, and the sum
// is rounded back once. Letting cuBLAS write a 16-bit C instead is not "rounded once": with
// split-K it rounds partial sums into C (seen on an H100: 184.0 where fp64 says 183.69).
// K (tokens) is split into calls that keep every operand slice below 2^31 elements (cuBLAS
// takes int sizes).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "checks.h"
#include "kernels.h"

namespace lamp {
namespace cuda {
namespace {

cudaDataType_t cuda_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return CUDA_R_32F;
    case at::kHalf:
      return CUDA_R_16F;
    case at::kBFloat16:
      return CUDA_R_16BF;
    default:
      TORCH_CHECK_TYPE(false, "wgrad_gemm_accum: unsupported dtype ", dtype);
  }
}

#define LAMP_CUBLAS_CHECK(expr)                                                                   \
  do {                                                                                            \
    const cublasStatus_t status_ = (expr);                                                        \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "wgrad_gemm_accum: ", #expr, " failed: ",      \
                cublasGetStatusString(status_), " (", ::lamp::num(static_cast<int>(status_)), ")");\
  } while (0)

// c[r0 + r, :] (row-major fp32, row stride n_in) += g[k, r0 + r]^T @ x[k, :] for r < rows: the
// output rows [r0, r0 + rows) of main_grad, i.e. a column block of cuBLAS's column-major C'.
void gemm_accum_rows(const at::Tensor& x, const at::Tensor& g, int64_t r0, int64_t rows, float* c) {
  const int64_t k = x.size(0), n_in = x.size(1), n_out = g.size(1);
  if (k == 0 || n_in == 0 || rows == 0) return;
  const char* op = "wgrad_gemm_accum";
  LAMP_CHECK_FITS_INT32(op, "in features", n_in);
  LAMP_CHECK_FITS_INT32(op, "out features", n_out);
  const int64_t step = std::max<int64_t>(1, std::numeric_limits<int32_t>::max() / std::max(n_in, n_out));
  const cudaDataType_t ab_type = cuda_type(x.scalar_type());
  const float alpha = 1.f, beta = 1.f;
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  for (int64_t k0 = 0; k0 < k; k0 += step) {
    const int64_t kk = std::min(step, k - k0);
    const char* xp = static_cast<const char*>(x.data_ptr()) + k0 * n_in * x.element_size();
    const char* gp = static_cast<const char*>(g.data_ptr()) + (k0 * n_out + r0) * g.element_size();
    LAMP_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(n_in), static_cast<int>(rows),
                                   static_cast<int>(kk), &alpha, xp, ab_type, static_cast<int>(n_in), gp, ab_type,
                                   static_cast<int>(n_out), &beta, c, CUDA_R_32F, static_cast<int>(n_in),
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

// Elements of the fp32 workspace used to accumulate into a 16-bit main_grad (64 MiB).
constexpr int64_t kHalfMainTileElems = int64_t{1} << 24;

}  // namespace

void wgrad_gemm_accum(const at::Tensor& x, const at::Tensor& g, at::Tensor& main_grad) {
  const c10::cuda::CUDAGuard guard(main_grad.device());
  const int64_t out = main_grad.size(0), in = main_grad.size(1);
  if (main_grad.scalar_type() == at::kFloat) {
    gemm_accum_rows(x, g, 0, out, main_grad.data_ptr<float>());
    return;
  }
  if (out == 0 || in == 0) return;
  const int64_t rows = std::max<int64_t>(1, std::min(out, kHalfMainTileElems / std::max<int64_t>(in, 1)));
  for (int64_t r0 = 0; r0 < out; r0 += rows) {
    const int64_t rr = std::min(rows, out - r0);
    at::Tensor dst = main_grad.narrow(0, r0, rr);
    at::Tensor tile = dst.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    gemm_accum_rows(x, g, r0, rr, tile.data_ptr<float>());
    dst.copy_(tile);  // the one rounding
  }
}

}  // namespace cuda
}  // namespace lamp
