// CPU weight-gradient GEMM with accumulation: main_grad[m, n] += g[k, m]^T @ x[k, n].
//
// fp32 operands: at::addmm_ on main_grad (BLAS sgemm with beta = 1, no temporary).
// bf16 / fp16 operands, two paths with identical numerics (16-bit -> fp32 is exact, products
// and sums in fp32, accumulated straight into main_grad with beta = 1):
// * "mkl": MKL's cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32 read the 16-bit operands
//   directly. They are looked up at runtime (dlsym) in the already loaded libtorch_cpu, so the
//   extension still loads against a torch built without MKL.
// * "aten": blocks of K (tokens) rows of both operands are upcast to fp32 (temporaries of a
//   few MiB, never the full product) and accumulated with addmm_ (sgemm, beta = 1).
// "auto" (default) takes "mkl" when the CPU has the matching AMX tile unit (AMX-BF16 /
// AMX-FP16); without AMX, MKL's 16-bit GEMM took 1.12-1.69x the time of the "aten" path on
// three transformer shapes (benchmarks/bench_wgrad.py, 2026-11-22, Intel Xeon with AVX-512-BF16
// and no AMX; table in benchmarks/RESULTS.md), so "aten" is used there.
//
// MKL's LP64 interface takes 32-bit ints: m, n and the leading dimensions must fit, and the
// K (token) dimension is split into chunks that keep every operand slice below 2^31 elements.
#include <ATen/ATen.h>
#include <dlfcn.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

#include "checks.h"
#include "kernels.h"

namespace lamp {
namespace cpu {
namespace {

// MKL's CBLAS enums (mkl_cblas.h) and the signature shared by both 16-bit GEMMs.
constexpr int kCblasRowMajor = 101;
constexpr int kCblasNoTrans = 111;
constexpr int kCblasTrans = 112;
using Gemm16Fn = void (*)(int layout, int transa, int transb, int m, int n, int k, float alpha, const uint16_t* a,
                          int lda, const uint16_t* b, int ldb, float beta, float* c, int ldc);

void* find_symbol(const char* name) {
  void* sym = dlsym(RTLD_DEFAULT, name);
  if (sym == nullptr) {
    // Python loads extensions RTLD_LOCAL, so libtorch_cpu may not be in the global scope.
    if (void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD)) sym = dlsym(lib, name);
  }
  return sym;
}

Gemm16Fn mkl_gemm_for(at::ScalarType dtype) {
  static const Gemm16Fn bf16 = reinterpret_cast<Gemm16Fn>(find_symbol("cblas_gemm_bf16bf16f32"));
  static const Gemm16Fn f16 = reinterpret_cast<Gemm16Fn>(find_symbol("cblas_gemm_f16f16f32"));
  if (dtype == at::kBFloat16) return bf16;
  if (dtype == at::kHalf) return f16;
  return nullptr;
}

// CPUID leaf 7: AMX-BF16 = EDX bit 22, AMX-TILE = EDX bit 24; sub-leaf 1: AMX-FP16 = EAX bit 21.
bool cpu_has_amx_for(at::ScalarType dtype) {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1u;
  if (dtype == at::kBFloat16) return tile && ((d >> 22) & 1u);
  if (dtype == at::kHalf) {
    const bool tile_ok = tile;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return tile_ok && ((a >> 21) & 1u);
  }
#else
  (void)dtype;
#endif
  return false;
}

enum class GemmPolicy : int { kAuto = 0, kMkl = 1, kAten = 2 };

std::atomic<int64_t> g_k_chunk{0};
std::atomic<int> g_policy{static_cast<int>(GemmPolicy::kAuto)};

// The MKL 16-bit GEMM to use for dtype under the current policy, or nullptr for "aten".
Gemm16Fn chosen_mkl_gemm(at::ScalarType dtype) {
  const auto policy = static_cast<GemmPolicy>(g_policy.load());
  if (policy == GemmPolicy::kAten) return nullptr;
  if (policy == GemmPolicy::kAuto) {
    static const bool amx_bf16 = cpu_has_amx_for(at::kBFloat16);
    static const bool amx_f16 = cpu_has_amx_for(at::kHalf);
    if (!(dtype == at::kBFloat16 ? amx_bf16 : dtype == at::kHalf ? amx_f16 : false)) return nullptr;
  }
  return mkl_gemm_for(dtype);
}

// Rows of K upcast at a time on the "aten" path: ~4M fp32 elements of temporaries, but at
// least 2048 rows so each sgemm's K stays large against its read-modify-write of main_grad.
int64_t upcast_rows(int64_t m, int64_t n) {
  return std::max<int64_t>(2048, (int64_t{1} << 22) / std::max<int64_t>(m + n, 1));
}

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Rows of K per BLAS call: every operand slice stays below 2^31 elements.
int64_t k_rows_per_call(int64_t lda, int64_t ldb) {
  int64_t rows = std::max<int64_t>(1, kInt32Max / std::max<int64_t>({lda, ldb, 1}));
  rows = std::min(rows, kInt32Max);
  const int64_t cap = g_k_chunk.load();
  return cap > 0 ? std::min(rows, cap) : rows;
}

// c[m, n] (fp32, row stride c.stride(0), unit column stride) += g[k, m]^T @ x[k, n].
// g and x have unit column stride; g may be a column slice of a wider matrix.
void gemm_tn_accum(const at::Tensor& g, const at::Tensor& x, at::Tensor& c) {
  const int64_t k = g.size(0), m = g.size(1), n = x.size(1);
  if (k == 0 || m == 0 || n == 0) return;
  const int64_t lda = g.stride(0), ldb = x.stride(0), ldc = c.stride(0);
  const char* op = "wgrad_gemm_accum";
  LAMP_CHECK_FITS_INT32(op, "out features", m);
  LAMP_CHECK_FITS_INT32(op, "in features", n);
  LAMP_CHECK_FITS_INT32(op, "leading dimension of grad_output", lda);
  LAMP_CHECK_FITS_INT32(op, "leading dimension of input", ldb);
  LAMP_CHECK_FITS_INT32(op, "leading dimension of main_grad", ldc);
  const at::ScalarType dtype = x.scalar_type();
  const Gemm16Fn mkl = dtype == at::kFloat ? nullptr : chosen_mkl_gemm(dtype);
  int64_t step = k_rows_per_call(lda, ldb);
  if (dtype != at::kFloat && mkl == nullptr) step = std::min(step, upcast_rows(m, n));
  for (int64_t k0 = 0; k0 < k; k0 += step) {
    const int64_t kk = std::min(step, k - k0);
    at::Tensor gk = g.narrow(0, k0, kk);
    at::Tensor xk = x.narrow(0, k0, kk);
    if (dtype == at::kFloat) {
      c.addmm_(gk.t(), xk);  // beta = 1, alpha = 1: sgemm straight into c
    } else if (mkl != nullptr) {
      mkl(kCblasRowMajor, kCblasTrans, kCblasNoTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(kk),
          1.0f, reinterpret_cast<const uint16_t*>(gk.data_ptr()), static_cast<int>(lda),
          reinterpret_cast<const uint16_t*>(xk.data_ptr()), static_cast<int>(ldb), 1.0f, c.data_ptr<float>(),
          static_cast<int>(ldc));
    } else {
      c.addmm_(gk.t().to(at::kFloat), xk.to(at::kFloat));
    }
  }
}

// Elements of the fp32 tile used to accumulate into a 16-bit main_grad (16 MiB).
constexpr int64_t kHalfMainTileElems = int64_t{1} << 22;

}  // namespace

void set_wgrad_k_chunk(int64_t rows) {
  TORCH_CHECK_VALUE(rows >= 0, "set_wgrad_k_chunk: rows must be >= 0 (0 = automatic), got ", rows);
  g_k_chunk.store(rows);
}

int64_t wgrad_k_chunk() { return g_k_chunk.load(); }

void set_wgrad_cpu_gemm_policy(const std::string& policy) {
  if (policy == "auto") {
    g_policy.store(static_cast<int>(GemmPolicy::kAuto));
  } else if (policy == "mkl") {
    g_policy.store(static_cast<int>(GemmPolicy::kMkl));
  } else if (policy == "aten") {
    g_policy.store(static_cast<int>(GemmPolicy::kAten));
  } else {
    TORCH_CHECK_VALUE(false, "set_wgrad_cpu_gemm_policy: policy must be 'auto', 'mkl' or 'aten', got '", policy, "'");
  }
}

std::string wgrad_cpu_gemm_backend(at::ScalarType dtype) {
  if (dtype == at::kFloat) return "aten";
  return chosen_mkl_gemm(dtype) != nullptr ? "mkl" : "aten";
}

bool wgrad_cpu_has_mkl_gemm(at::ScalarType dtype) { return mkl_gemm_for(dtype) != nullptr; }

void wgrad_gemm_accum(const at::Tensor& x, const at::Tensor& g, at::Tensor& main_grad) {
  if (main_grad.scalar_type() == at::kFloat) {
    gemm_tn_accum(g, x, main_grad);
    return;
  }
  // 16-bit main_grad: accumulate row tiles in fp32 (tile = current values upcast, GEMM with
  // beta = 1 into it), then round each element once back into main_grad.
  const int64_t out = main_grad.size(0), in = main_grad.size(1);
  if (out == 0 || in == 0) return;
  const int64_t rows = std::max<int64_t>(1, std::min(out, kHalfMainTileElems / std::max<int64_t>(in, 1)));
  for (int64_t r0 = 0; r0 < out; r0 += rows) {
    const int64_t rr = std::min(rows, out - r0);
    at::Tensor dst = main_grad.narrow(0, r0, rr);
    at::Tensor tile = dst.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    gemm_tn_accum(g.narrow(1, r0, rr), x, tile);
    dst.copy_(tile);
  }
}

}  // namespace cpu
}  // namespace lamp
