// CPU weight-gradient GEMM with accumulation: main_grad[m, n] += g[k, m]^T @ x[k, n].
//
// fp32 operands: at::addmm_ on main_grad (BLAS sgemm with beta = 1, no temporary).
// bf16 / fp16 operands, three paths with the same numerics (16-bit products are exact in fp32, they
// are summed in fp32 and accumulated straight into main_grad with beta = 1; only the order of the
// fp32 sums differs):
// * "onednn": oneDNN's batch-reduce GEMM micro-kernel inside torch (csrc/cpu/wgrad_brgemm.cpp), on
//   AMX tiles or AVX-512 BF16/FP16 units.
// * "mkl": MKL's cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32, read the 16-bit operands directly.
//   They are looked up at runtime (dlsym) in the already loaded libtorch_cpu, so the extension still
//   loads against a torch built without MKL.
// * "aten": blocks of K (tokens) rows of both operands are upcast to fp32 (temporaries of a few MiB,
//   never the full product) and accumulated with addmm_ (sgemm, beta = 1).
// The paths sum in different orders, so the path decides the last bits of main_grad: a run, its
// resumed copy and every rank of a job must take the same one, and the fastest differs by 3-4x from one
// CPU to the next (MKL's 16-bit GEMM is slow off Intel; oneDNN's micro-kernel needs AMX or AVX512-BF16).
// "auto" (the default) therefore takes the machine's measured choice (set_wgrad_cpu_gemm_choice, per
// dtype: lightning_amp/ops/_wgrad_choice.py measures once per machine with the calibration below and
// caches the answer beside the build, under a file lock) while that path is usable, and else a rule:
// where torch's oneDNN micro-kernel accepts the dtype on this CPU (AMX; the probe in wgrad_brgemm.cpp,
// which also sees ONEDNN_MAX_CPU_ISA), the first usable of MKL, oneDNN, the fp32 upcast; elsewhere the
// fp32 upcast. "fastest" times each usable path once per process on one kCalK x kCalM x kCalN product (a
// warm-up, then the fastest of kCalRounds interleaved rounds) and keeps the fastest for that dtype: the
// machine's measurement is that one, made by one process; two processes under "fastest" may choose
// differently. A policy naming a path ("onednn", "mkl", "aten") uses that path, or raises where it is not
// usable; ops sets the policy from LIGHTNING_AMP_WGRAD_CPU_GEMM.
//
// MKL's LP64 interface takes 32-bit ints: m, n and the leading dimensions must fit, and the
// K (token) dimension is split into chunks that keep every operand slice below 2^31 elements.
#include <ATen/ATen.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "cpu/wgrad_paths.h"
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

enum class Path : int { kAten = 0, kMkl = 1, kOnednn = 2 };
constexpr std::array<Path, 3> kPaths = {Path::kOnednn, Path::kMkl, Path::kAten};
constexpr int kAuto = -1;
constexpr int kFastest = -2;

const char* path_name(Path p) {
  switch (p) {
    case Path::kMkl:
      return "mkl";
    case Path::kOnednn:
      return "onednn";
    default:
      return "aten";
  }
}

// Why path p cannot serve 16-bit dtype now ("" when it can).
std::string unusable_reason(Path p, at::ScalarType dtype) {
  if (p == Path::kMkl && mkl_gemm_for(dtype) == nullptr) {
    return std::string("this torch exports no MKL ") +
           (dtype == at::kHalf ? "cblas_gemm_f16f16f32" : "cblas_gemm_bf16bf16f32");
  }
  if (p == Path::kOnednn) return wgrad::brgemm_unusable_reason(dtype);
  return "";
}

std::atomic<int64_t> g_k_chunk{0};
std::atomic<int> g_policy{kAuto};
constexpr int kNoChoice = -1;
// The machine's measured choice per 16-bit dtype (index 0 bf16, 1 fp16), set from the cache file
// beside the build (lightning_amp/ops/_wgrad_choice.py); kNoChoice: the rule decides.
std::array<std::atomic<int>, 2> g_machine_choice{kNoChoice, kNoChoice};

std::atomic<int>& machine_choice(at::ScalarType dtype) { return g_machine_choice[dtype == at::kHalf ? 1 : 0]; }

// Rows of K upcast at a time on the "aten" path: ~4M fp32 elements of workspace, but at least
// 2048 rows so each sgemm's K stays large against its read-modify-write of main_grad.
int64_t upcast_rows(int64_t m, int64_t n) {
  return std::max<int64_t>(2048, (int64_t{1} << 22) / std::max<int64_t>(m + n, 1));
}

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Rows of K per MKL call: every operand slice stays below 2^31 elements (and at most cap, if > 0).
int64_t k_rows_per_call(int64_t lda, int64_t ldb, int64_t cap) {
  int64_t rows = std::max<int64_t>(1, kInt32Max / std::max<int64_t>({lda, ldb, 1}));
  rows = std::min(rows, kInt32Max);
  return cap > 0 ? std::min(rows, cap) : rows;
}

// Rows of K per "onednn" step: as many as keep the packed operands ((m + n) x rows 16-bit elements)
// within 32 MiB, between 1024 and 4096 (longer steps read and write main_grad fewer times; 4096 was
// a few per cent faster than 1024 on the transformer shapes of benchmarks/bench_wgrad.py with oneDNN
// capped at AVX512_CORE_BF16, within the noise of a shared machine).
int64_t onednn_rows(int64_t m, int64_t n) {
  return std::clamp<int64_t>((int64_t{1} << 24) / std::max<int64_t>(m + n, 1), 1024, 4096);
}

// The measurement behind "fastest": one product of this size per path and round.
constexpr int64_t kCalK = 2048, kCalM = 1024, kCalN = 1024;
constexpr int kCalRounds = 3;

void mkl_tn_accum(Gemm16Fn mkl, const at::Tensor& g, const at::Tensor& x, at::Tensor& c, int64_t cap) {
  const int64_t k = g.size(0), m = g.size(1), n = x.size(1);
  const int64_t lda = g.stride(0), ldb = x.stride(0), ldc = c.stride(0);
  const char* op = "wgrad_gemm_accum";
  LAMP_CHECK_FITS_INT32(op, "out features", m);
  LAMP_CHECK_FITS_INT32(op, "in features", n);
  LAMP_CHECK_FITS_INT32(op, "leading dimension of grad_output", lda);
  LAMP_CHECK_FITS_INT32(op, "leading dimension of input", ldb);
  LAMP_CHECK_FITS_INT32(op, "leading dimension of main_grad", ldc);
  const int64_t step = k_rows_per_call(lda, ldb, cap);
  for (int64_t k0 = 0; k0 < k; k0 += step) {
    const int64_t kk = std::min(step, k - k0);
    mkl(kCblasRowMajor, kCblasTrans, kCblasNoTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(kk),
        1.0f, reinterpret_cast<const uint16_t*>(g.const_data_ptr()) + k0 * lda, static_cast<int>(lda),
        reinterpret_cast<const uint16_t*>(x.const_data_ptr()) + k0 * ldb, static_cast<int>(ldb), 1.0f,
        c.data_ptr<float>(), static_cast<int>(ldc));
  }
}

// The fp32 workspace of the "aten" path, kept between calls (fresh temporaries of tens of MiB per
// call would take a page fault per 4 KiB written). One caller at a time uses it; a concurrent
// caller allocates its own.
struct UpcastWorkspace {
  std::mutex mu;
  at::Tensor buf;  // fp32, grown to the largest call's (m + n) x rows so far
};

// fp32 operands as they are; 16-bit ones upcast a block of K rows at a time into the workspace.
void aten_tn_accum(const at::Tensor& g, const at::Tensor& x, at::Tensor& c, int64_t cap) {
  const int64_t k = g.size(0), m = g.size(1), n = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    c.addmm_(g.t(), x);  // beta = 1, alpha = 1: sgemm straight into c
    return;
  }
  int64_t step = std::min(k, upcast_rows(m, n));
  if (cap > 0) step = std::min(step, cap);
  static UpcastWorkspace shared;
  std::unique_lock<std::mutex> lock(shared.mu, std::try_to_lock);
  at::Tensor own;
  at::Tensor& buf = lock.owns_lock() ? shared.buf : own;
  if (!buf.defined() || buf.numel() < (m + n) * step) {
    buf = at::Tensor();  // drop the old one first
    buf = at::empty({(m + n) * step}, at::TensorOptions().dtype(at::kFloat));
  }
  for (int64_t k0 = 0; k0 < k; k0 += step) {
    const int64_t kk = std::min(step, k - k0);
    at::Tensor gk = buf.narrow(0, 0, kk * m).view({kk, m});
    at::Tensor xk = buf.narrow(0, kk * m, kk * n).view({kk, n});
    gk.copy_(g.narrow(0, k0, kk));  // exact: every 16-bit value is an fp32 value
    xk.copy_(x.narrow(0, k0, kk));
    c.addmm_(gk.t(), xk);
  }
}

// c[m, n] (fp32, row stride c.stride(0), unit column stride) += g[k, m]^T @ x[k, n] through path p.
// g and x have unit column stride; g may be a column slice of a wider matrix. cap > 0: at most cap
// rows of K per GEMM call (the test hook set_wgrad_k_chunk; the measurement passes 0).
void run_path(Path p, const at::Tensor& g, const at::Tensor& x, at::Tensor& c, int64_t cap) {
  if (g.size(0) == 0 || g.size(1) == 0 || x.size(1) == 0) return;
  if (p == Path::kMkl) {
    mkl_tn_accum(mkl_gemm_for(x.scalar_type()), g, x, c, cap);
  } else if (p == Path::kOnednn) {
    const int64_t rows = onednn_rows(g.size(1), x.size(1));
    wgrad::brgemm_tn_accum(g, x, c, cap > 0 ? std::min(cap, rows) : rows);
  } else {
    aten_tn_accum(g, x, c, cap);
  }
}

struct Calibration {
  std::once_flag once;
  std::vector<std::pair<Path, double>> ranked;  // usable paths at the time, fastest first
};

// The measurement of "fastest" for 16-bit dtype, made once per process. Operands hold small integers
// (no random-number generator is touched), the products go into a scratch fp32 matrix.
const std::vector<std::pair<Path, double>>& calibration(at::ScalarType dtype) {
  static Calibration bf16, f16;
  Calibration& cal = dtype == at::kHalf ? f16 : bf16;
  std::call_once(cal.once, [&] {
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    const at::Tensor g = (at::arange(kCalK * kCalM, opts).remainder(17) - 8).reshape({kCalK, kCalM}).to(dtype);
    const at::Tensor x = (at::arange(kCalK * kCalN, opts).remainder(13) - 6).reshape({kCalK, kCalN}).to(dtype);
    at::Tensor c = at::zeros({kCalM, kCalN}, opts);
    std::vector<Path> usable;
    for (Path p : kPaths) {
      if (unusable_reason(p, dtype).empty()) usable.push_back(p);
    }
    std::vector<double> best(usable.size(), std::numeric_limits<double>::infinity());
    for (int round = -1; round < kCalRounds; ++round) {  // round -1: warm-up (kernel generation, first touch)
      for (size_t i = 0; i < usable.size(); ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        run_path(usable[i], g, x, c, /*cap=*/0);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (round >= 0) best[i] = std::min(best[i], s);
      }
    }
    for (size_t i = 0; i < usable.size(); ++i) cal.ranked.emplace_back(usable[i], best[i]);
    std::stable_sort(cal.ranked.begin(), cal.ranked.end(),
                     [](const auto& a, const auto& b) { return a.second < b.second; });
  });
  return cal.ranked;
}

// The path that serves 16-bit dtype now: the policy's; under "auto" the rule's (the file's header), under
// "fastest" the fastest measured path; either way one that is still usable (oneDNN can be switched off).
Path chosen_path(at::ScalarType dtype) {
  const int policy = g_policy.load();
  if (policy == kFastest) {
    for (const auto& entry : calibration(dtype)) {
      if (unusable_reason(entry.first, dtype).empty()) return entry.first;
    }
    return Path::kAten;
  }
  if (policy == kAuto) {
    const int choice = machine_choice(dtype).load();
    if (choice != kNoChoice && unusable_reason(static_cast<Path>(choice), dtype).empty()) {
      return static_cast<Path>(choice);
    }
    if (wgrad::brgemm_accepted_by_cpu(dtype)) {
      for (Path p : {Path::kMkl, Path::kOnednn}) {
        if (unusable_reason(p, dtype).empty()) return p;
      }
    }
    return Path::kAten;
  }
  const Path p = static_cast<Path>(policy);
  const std::string why = unusable_reason(p, dtype);
  TORCH_CHECK(why.empty(), "wgrad_gemm_accum: the CPU GEMM path '", path_name(p), "' was asked for (",
              "LIGHTNING_AMP_WGRAD_CPU_GEMM or set_wgrad_cpu_gemm_policy) but cannot serve ", dtype, " here: ", why);
  return p;
}

void gemm_tn_accum(const at::Tensor& g, const at::Tensor& x, at::Tensor& c) {
  const at::ScalarType dtype = x.scalar_type();
  run_path(dtype == at::kFloat ? Path::kAten : chosen_path(dtype), g, x, c, g_k_chunk.load());
}

// Elements of the fp32 tile used to accumulate into a 16-bit main_grad (16 MiB).
constexpr int64_t kHalfMainTileElems = int64_t{1} << 22;

}  // namespace

void set_wgrad_k_chunk(int64_t rows) {
  TORCH_CHECK_VALUE(rows >= 0, "set_wgrad_k_chunk: rows must be >= 0 (0 = automatic), got ", num(rows));
  g_k_chunk.store(rows);
}

int64_t wgrad_k_chunk() { return g_k_chunk.load(); }

void set_wgrad_cpu_gemm_policy(const std::string& policy) {
  if (policy == "auto" || policy == "fastest") {
    g_policy.store(policy == "auto" ? kAuto : kFastest);
    return;
  }
  for (Path p : kPaths) {
    if (policy == path_name(p)) {
      g_policy.store(static_cast<int>(p));
      return;
    }
  }
  TORCH_CHECK_VALUE(false, "set_wgrad_cpu_gemm_policy: policy must be 'auto', 'fastest', 'onednn', 'mkl' or 'aten', got '",
                    policy, "'");
}

void set_wgrad_cpu_gemm_choice(at::ScalarType dtype, const std::string& path) {
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kHalf,
                    "set_wgrad_cpu_gemm_choice: only bfloat16 and float16 operands have a choice");
  if (path.empty()) {
    machine_choice(dtype).store(kNoChoice);
    return;
  }
  for (Path p : kPaths) {
    if (path == path_name(p)) {
      machine_choice(dtype).store(static_cast<int>(p));
      return;
    }
  }
  TORCH_CHECK_VALUE(false, "set_wgrad_cpu_gemm_choice: path must be 'onednn', 'mkl', 'aten' or '' (none), got '",
                    path, "'");
}

std::string wgrad_cpu_gemm_choice(at::ScalarType dtype) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return "";
  const int choice = machine_choice(dtype).load();
  return choice == kNoChoice ? "" : path_name(static_cast<Path>(choice));
}

std::string wgrad_cpu_gemm_backend(at::ScalarType dtype) {
  if (dtype == at::kFloat) return "aten";
  return path_name(chosen_path(dtype));
}

std::vector<std::pair<std::string, std::string>> wgrad_cpu_gemm_paths(at::ScalarType dtype) {
  std::vector<std::pair<std::string, std::string>> out;
  for (Path p : kPaths) {
    if (dtype == at::kFloat && p != Path::kAten) {
      out.emplace_back(path_name(p), "float32 operands always take the fp32 GEMM");
    } else {
      out.emplace_back(path_name(p), unusable_reason(p, dtype));
    }
  }
  return out;
}

std::vector<std::pair<std::string, double>> wgrad_cpu_gemm_calibration(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype != at::kFloat, "wgrad_cpu_gemm_calibration: float32 operands are not measured");
  std::vector<std::pair<std::string, double>> out;
  for (const auto& entry : calibration(dtype)) out.emplace_back(path_name(entry.first), entry.second);
  return out;
}

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
