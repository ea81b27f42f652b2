/* Compile-check stand-in for cuBLAS's <cublas_v2.h>, used ONLY by .ci/nvcc-check when the
 * CUDA toolkit on the machine ships nvcc without the cuBLAS headers (as on the GPU-less CI
 * machines). It declares exactly the subset of the cuBLAS v2 API that csrc/cuda/ uses, with
 * the signatures and enum values of cuBLAS 12/13, so type errors in our calls still surface.
 * Real builds (setup.py) always use the toolkit's header; never add this directory there. */
#ifndef LAMP_CUBLAS_V2_STUB_H_
#define LAMP_CUBLAS_V2_STUB_H_

#include <cuda_runtime_api.h>
#include <library_types.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16
} cublasStatus_t;

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;

typedef enum {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_16F_PEDANTIC = 65,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_PEDANTIC = 69,
  CUBLAS_COMPUTE_64F = 70,
  CUBLAS_COMPUTE_64F_PEDANTIC = 71,
  CUBLAS_COMPUTE_32I = 72,
  CUBLAS_COMPUTE_32I_PEDANTIC = 73,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77
} cublasComputeType_t;

typedef enum { CUBLAS_GEMM_DEFAULT = -1, CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99 } cublasGemmAlgo_t;

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;

const char* cublasGetStatusString(cublasStatus_t status);

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo);

#ifdef __cplusplus
}
#endif

#endif /* LAMP_CUBLAS_V2_STUB_H_ */
