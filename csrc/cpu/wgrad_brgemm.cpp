// The "onednn" path of the CPU weight-gradient GEMM: c[m, n] += g[k, m]^T @ x[k, n] with bf16 / fp16
// operands through oneDNN's batch-reduce GEMM micro-kernel, which torch exports as
// at::native::cpublas::brgemm (ATen/native/CPUBlas.h; the same signatures in torch 2.11 and 2.13).
// The micro-kernel multiplies 16-bit A [M, K] by 16-bit B and adds the fp32 products into C
// (add_C: beta = 1) on AMX tiles or AVX-512 BF16/FP16 units, whichever oneDNN's effective ISA allows
// (ONEDNN_MAX_CPU_ISA caps it). Which layout of B it expects depends on that ISA and the dtype: VNNI
// pairs [K/2, N, 2] (bf16 everywhere, fp16 on AMX-FP16) or plain rows [K, N] (fp16 on AVX512-FP16);
// the probe finds out which. g is [k, m], i.e. A^T, so for each step of k_rows token rows A is packed
// into a workspace by 32 x 32 block transposes, and B into contiguous column blocks, in pairs where
// pairs are wanted (an odd step is then padded with one zero row). The packing is plain C++ on the
// 16-bit patterns, so every build has this path and torch's micro-kernel decides at run time.
// The multiply runs over (B panel, 32-row block of A, 64-column block) items in that order, so the
// items one thread takes in a row reuse a B panel of about 512 KiB from its cache. The packing walks
// g and x in page-friendly order (see pack_a_block): walking narrow column blocks down all rows
// spent most of a call on TLB misses on the AMX Xeon.
#include "checks.h"
#include "cpu/wgrad_paths.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>

namespace lamp {
namespace cpu {
namespace wgrad {
namespace {

constexpr int64_t kMBlock = 32;               // rows of C (and of A) per micro-kernel call
constexpr int64_t kNBlock = 64;               // columns of C (and of B) per micro-kernel call
constexpr int64_t kPanelElems = int64_t{1} << 18;  // 16-bit elements of one B panel (512 KiB)
constexpr int64_t kABand = 256;               // rows of A (columns of g) per packing work item
constexpr int64_t kBBand = 64;                // rows of x (even) per packing work item

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up_even(int64_t v) { return (v + 1) / 2 * 2; }

struct Probe {
  std::once_flag once;
  bool ok = false;
  bool vnni = true;  // B in VNNI pairs (else plain rows)
  std::string reason;
};

// Rows [k0, k0 + kk) of g, columns [i0, i0 + mm), transposed into rows i0.. of the [m, kp] A
// workspace in 32 x 32 tiles, 256 rows of g at a time: a tile's rows of g lie a page or more apart,
// so walking a narrow column block down all kk rows would cost a TLB miss per row; a 256 x 256
// square keeps its 512 pages (256 read, 256 written) in the TLB. A pad column kk (kp = kk + 1) is
// zeroed: it meets B's zero pad row (0 * 0, never 0 * nan).
void pack_a_block(const uint16_t* g, int64_t lda, int64_t k0, int64_t kk, int64_t kp, int64_t i0, int64_t mm,
                  uint16_t* a) {
  constexpr int64_t kTile = 32, kSquare = 256;
  uint16_t* dst = a + i0 * kp;
  for (int64_t kb = 0; kb < kk; kb += kSquare) {
    const int64_t kb_end = std::min(kk, kb + kSquare);
    for (int64_t is = 0; is < mm; is += kTile) {
      const int64_t ir = std::min(kTile, mm - is);
      for (int64_t ks = kb; ks < kb_end; ks += kTile) {
        const int64_t kr = std::min(kTile, kb_end - ks);
        const uint16_t* src = g + (k0 + ks) * lda + i0 + is;
        for (int64_t i = 0; i < ir; ++i) {
          uint16_t* d = dst + (is + i) * kp + ks;
          for (int64_t q = 0; q < kr; ++q) d[q] = src[q * lda + i];
        }
      }
    }
  }
  if (kp != kk) {
    for (int64_t i = 0; i < mm; ++i) dst[i * kp + kk] = 0;  // +0.0 in bf16 and in fp16
  }
}

// Rows [q0, q1) (q0 even) of the step's rows [k0, k0 + kk) of x, all n columns, into the step's B
// workspace, the block of columns [j0, j0 + nn) at b + j0 * kp: as VNNI pairs [kp / 2, nn, 2] (a
// missing last row of an odd kk is zero) or as plain rows [kp, nn]. A band of rows is read once, row
// by row, across all columns; each block is then contiguous for the micro-kernel (read in place, a
// narrow block of x would cost a TLB miss per row or two).
void pack_b_rows(const uint16_t* x, int64_t ldb, int64_t k0, int64_t kk, int64_t kp, int64_t n, int64_t q0,
                 int64_t q1, int64_t n_block, bool pairs, uint16_t* b) {
  if (!pairs) {
    for (int64_t q = q0; q < q1; ++q) {
      const uint16_t* r = x + (k0 + q) * ldb;
      for (int64_t j0 = 0; j0 < n; j0 += n_block) {
        const int64_t nn = std::min(n_block, n - j0);
        std::memcpy(b + j0 * kp + q * nn, r + j0, nn * sizeof(uint16_t));
      }
    }
    return;
  }
  for (int64_t q = q0; q < q1; q += 2) {
    const uint16_t* r0 = x + (k0 + q) * ldb;
    const uint16_t* r1 = q + 1 < kk ? r0 + ldb : nullptr;
    for (int64_t j0 = 0; j0 < n; j0 += n_block) {
      const int64_t nn = std::min(n_block, n - j0);
      uint16_t* d = b + j0 * kp + q * nn;
      if (r1 != nullptr) {
        for (int64_t j = 0; j < nn; ++j) {
          d[2 * j] = r0[j0 + j];
          d[2 * j + 1] = r1[j0 + j];
        }
      } else {
        for (int64_t j = 0; j < nn; ++j) {
          d[2 * j] = r0[j0 + j];
          d[2 * j + 1] = 0;
        }
      }
    }
  }
}

// The packing workspace, kept between calls (a fresh one of tens of MiB would take a page fault per
// 4 KiB written). One caller at a time uses it; a concurrent caller packs into its own.
struct Workspace {
  std::mutex mu;
  at::Tensor buf;  // uint16 patterns, grown to the largest call's (m + n) x rows so far
};

Workspace& workspace() {
  static Workspace ws;
  return ws;
}

// T: at::BFloat16 or at::Half; g and x point at its 16-bit patterns.
template <typename T>
void tn_accum(const uint16_t* g, int64_t lda, const uint16_t* x, int64_t ldb, float* c, int64_t ldc, int64_t k,
              int64_t m, int64_t n, int64_t k_rows, bool vnni) {
  const int64_t kc = vnni ? round_up_even(std::min(k_rows, k)) : std::min(k_rows, k);
  const int64_t panel = std::max<int64_t>(1, kPanelElems / (kc * kNBlock));  // N blocks per B panel
  const int64_t need = (m + n) * kc;
  Workspace& shared = workspace();
  std::unique_lock<std::mutex> lock(shared.mu, std::try_to_lock);
  at::Tensor own;
  at::Tensor& buf = lock.owns_lock() ? shared.buf : own;
  if (!buf.defined() || buf.numel() < need) {
    buf = at::Tensor();  // drop the old one first
    buf = at::empty({need}, at::TensorOptions().dtype(at::kShort).device(at::kCPU));
  }
  uint16_t* a = reinterpret_cast<uint16_t*>(buf.data_ptr());
  uint16_t* b = a + m * kc;
  const int64_t m_blocks = ceil_div(m, kMBlock), n_blocks = ceil_div(n, kNBlock);
  const int64_t panels = ceil_div(n_blocks, panel);
  for (int64_t k0 = 0; k0 < k; k0 += kc) {
    const int64_t kk = std::min(kc, k - k0), kp = vnni ? round_up_even(kk) : kk;
    at::parallel_for(0, ceil_div(m, kABand), 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        pack_a_block(g, lda, k0, kk, kp, w * kABand, std::min(kABand, m - w * kABand), a);
      }
    });
    at::parallel_for(0, ceil_div(kk, kBBand), 1, [&](int64_t begin, int64_t end) {
      pack_b_rows(x, ldb, k0, kk, kp, n, begin * kBBand, std::min(kk, end * kBBand), kNBlock, vnni, b);
    });
    at::parallel_for(0, panels * m_blocks * panel, 1, [&](int64_t begin, int64_t end) {
      bool used = false;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t jb = (t / (m_blocks * panel)) * panel + t % panel;
        if (jb >= n_blocks) continue;  // the last panel may be narrower
        const int64_t i0 = (t / panel) % m_blocks * kMBlock, j0 = jb * kNBlock;
        const int64_t mm = std::min(kMBlock, m - i0), nn = std::min(kNBlock, n - j0);
        // is_vnni = true asks for oneDNN's micro-kernel (false takes torch's reference GEMM).
        const T* a_blk = reinterpret_cast<const T*>(a + i0 * kp);
        const T* b_blk = reinterpret_cast<const T*>(b + j0 * kp);
        at::native::cpublas::brgemm(mm, nn, kp, kp, nn, ldc, /*add_C=*/true, a_blk, b_blk,
                                    c + i0 * ldc + j0, /*is_vnni=*/true);
        used = true;
      }
      if (used) at::native::cpublas::brgemm_release(/*is_vnni=*/true);  // hand back AMX tile state
    });
  }
}

// A 3 x 40 x 6 product of small integers (exact in 16 bits and in fp32) added into C = 1, with B in
// VNNI pairs and then in plain rows: the micro-kernel must accept dtype and give exactly that sum
// for one of the layouts.
template <typename T>
void probe_dtype(Probe& p) {
  constexpr int64_t M = 3, N = 40, K = 6;
  T a[M * K], bp[K * N], bv[K * N];
  float c[M * N];
  for (int64_t i = 0; i < M * K; ++i) a[i] = T(static_cast<float>(i % 5 - 2));
  for (int64_t i = 0; i < K * N; ++i) bp[i] = T(static_cast<float>(i % 7 - 3));
  static_assert(sizeof(T) == sizeof(uint16_t), "16-bit dtypes only");
  uint16_t bits[K * N], pairs[K * N];
  std::memcpy(bits, bp, sizeof(bits));
  pack_b_rows(bits, N, 0, K, K, N, 0, K, N, /*pairs=*/true, pairs);
  std::memcpy(bv, pairs, sizeof(pairs));
  for (bool vnni : {true, false}) {
    std::fill(c, c + M * N, 1.f);
    try {
      at::native::cpublas::brgemm(M, N, K, K, N, N, /*add_C=*/true, a, vnni ? bv : bp, c, /*is_vnni=*/true);
      at::native::cpublas::brgemm_release(/*is_vnni=*/true);
    } catch (const c10::Error& e) {
      p.reason = std::string("torch's oneDNN micro-kernel (at::native::cpublas::brgemm) refused it on this CPU: ") +
                 e.what_without_backtrace();
      return;
    } catch (const std::exception& e) {
      p.reason = std::string("torch's oneDNN micro-kernel (at::native::cpublas::brgemm) refused it on this CPU: ") +
                 e.what();
      return;
    }
    bool exact = true;
    for (int64_t i = 0; i < M && exact; ++i) {
      for (int64_t j = 0; j < N && exact; ++j) {
        float want = 1.f;
        for (int64_t q = 0; q < K; ++q) want += static_cast<float>(a[i * K + q]) * static_cast<float>(bp[q * N + j]);
        exact = c[i * N + j] == want;
      }
    }
    if (exact) {
      p.ok = true;
      p.vnni = vnni;
      return;
    }
  }
  p.reason = "torch's oneDNN micro-kernel gave a wrong product in the probe with B in VNNI pairs and in plain rows";
}

Probe& probe_for(at::ScalarType dtype) {
  static Probe bf16, f16;
  Probe& p = dtype == at::kHalf ? f16 : bf16;
  std::call_once(p.once, [&] {
    if (dtype == at::kHalf) {
      probe_dtype<at::Half>(p);
    } else {
      probe_dtype<at::BFloat16>(p);
    }
  });
  return p;
}

}  // namespace

const char* brgemm_unusable_reason(at::ScalarType dtype) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return "only bfloat16 and float16 operands";
  Probe& p = probe_for(dtype);
  if (!p.ok) return p.reason.c_str();
  if (!at::globalContext().userEnabledMkldnn()) return "oneDNN is disabled (torch.backends.mkldnn.enabled = False)";
  return "";
}

bool brgemm_usable(at::ScalarType dtype) { return brgemm_unusable_reason(dtype)[0] == '\0'; }

bool brgemm_accepted_by_cpu(at::ScalarType dtype) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && probe_for(dtype).ok;
}

void brgemm_tn_accum(const at::Tensor& g, const at::Tensor& x, at::Tensor& c, int64_t k_rows) {
  const char* why = brgemm_unusable_reason(g.scalar_type());
  TORCH_CHECK(why[0] == '\0', "wgrad_gemm_accum: the oneDNN CPU GEMM path is not usable for ", g.scalar_type(),
              ": ", why);
  TORCH_CHECK(k_rows > 0, "wgrad_gemm_accum: k_rows must be > 0, got ", num(k_rows));
  const int64_t k = g.size(0), m = g.size(1), n = x.size(1);
  if (k == 0 || m == 0 || n == 0) return;
  const auto* gp = static_cast<const uint16_t*>(g.const_data_ptr());
  const auto* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  if (g.scalar_type() == at::kHalf) {
    tn_accum<at::Half>(gp, g.stride(0), xp, x.stride(0), c.data_ptr<float>(), c.stride(0), k, m, n, k_rows,
                       probe_for(at::kHalf).vnni);
  } else {
    tn_accum<at::BFloat16>(gp, g.stride(0), xp, x.stride(0), c.data_ptr<float>(), c.stride(0), k, m, n, k_rows,
                           probe_for(at::kBFloat16).vnni);
  }
}

}  // namespace wgrad
}  // namespace cpu
}  // namespace lamp
