// CPU multi-tensor scale: dst[i] = src[i] * scale for a list of tensors in one parallel
// pass, noting which sources hold inf/nan. fp32 math; src and dst dtypes may differ
// (e.g. bf16 grads into fp32 master grads) and dst may alias src. And the same inf/nan check
// alone, reading the tensors only (the check before a step whose kernel unscales).
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/multi_tensor_apply.h"
#include "cpu/vec_util.h"
#include "kernels.h"

namespace lamp {
namespace cpu {
namespace {

// Scales src[0, n) into dst and returns true when any source value is inf or nan.
// The check adds x * 0 to an accumulator: that is 0 for finite x and nan otherwise.
template <typename S, typename D>
bool scale_range(const S* src, D* dst, int64_t n, float scale) {
  constexpr int64_t W = VecF::size();
  const VecF vscale(scale), zero(0.f);
  VecF acc(0.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const VecF x = load_f32(src + i);
    acc = at::vec::fmadd(x, zero, acc);
    store_f32(dst + i, x * vscale);
  }
  float tail = 0.f;
  for (; i < n; ++i) {
    const float x = static_cast<float>(src[i]);
    tail += x * 0.f;
    dst[i] = static_cast<D>(x * scale);
  }
  float lanes[W];
  acc.store(lanes);
  for (int64_t j = 0; j < W; ++j) tail += lanes[j];
  return !std::isfinite(tail);
}

// Whether any of src[0, n) is inf or nan, reading only (two accumulators, the same x * 0 test).
template <typename S>
bool nonfinite_range(const S* src, int64_t n) {
  constexpr int64_t W = VecF::size();
  const VecF zero(0.f);
  VecF acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    acc0 = at::vec::fmadd(load_f32(src + i), zero, acc0);
    acc1 = at::vec::fmadd(load_f32(src + i + W), zero, acc1);
  }
  float tail = 0.f;
  for (; i < n; ++i) tail += static_cast<float>(src[i]) * 0.f;
  float lanes[W];
  (acc0 + acc1).store(lanes);
  for (int64_t j = 0; j < W; ++j) tail += lanes[j];
  return !std::isfinite(tail);
}

}  // namespace

void multi_tensor_check_finite(const std::vector<at::Tensor>& tensors, at::Tensor& found_inf) {
  const std::vector<Chunk> chunks = make_chunks(numels_of(tensors));
  std::vector<uint8_t> chunk_bad(chunks.size(), 0);
  for_each_chunk(chunks, [&](int64_t ci, const Chunk& c) {
    const at::Tensor& t = tensors[c.tensor];
    dispatch_float_like(t.scalar_type(), "multi_tensor_check_finite", [&](auto tag) {
      using S = decltype(tag);
      chunk_bad[ci] = nonfinite_range<S>(t.const_data_ptr<S>() + c.begin, c.end - c.begin) ? 1 : 0;
    });
  });
  for (uint8_t bad : chunk_bad) {
    if (bad) {
      found_inf.fill_(1.f);  // never cleared here, as multi_tensor_scale
      return;
    }
  }
}

at::Tensor multi_tensor_scale(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale,
                              at::Tensor& found_inf) {
  const int64_t count = static_cast<int64_t>(src.size());
  const std::vector<Chunk> chunks = make_chunks(numels_of(src));
  std::vector<uint8_t> chunk_bad(chunks.size(), 0);
  const float s = static_cast<float>(scale);
  for_each_chunk(chunks, [&](int64_t ci, const Chunk& c) {
    const at::Tensor& a = src[c.tensor];
    const at::Tensor& b = dst[c.tensor];
    dispatch_float_like(a.scalar_type(), "multi_tensor_scale", [&](auto s_tag) {
      using S = decltype(s_tag);
      dispatch_float_like(b.scalar_type(), "multi_tensor_scale", [&](auto d_tag) {
        using D = decltype(d_tag);
        const S* in = a.const_data_ptr<S>() + c.begin;
        D* out = b.data_ptr<D>() + c.begin;
        chunk_bad[ci] = scale_range<S, D>(in, out, c.end - c.begin, s) ? 1 : 0;
      });
    });
  });
  at::Tensor flags = at::zeros({count}, at::TensorOptions().dtype(at::kFloat));
  float* f = flags.data_ptr<float>();
  bool any = false;
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    if (chunk_bad[ci]) {
      f[chunks[ci].tensor] = 1.f;
      any = true;
    }
  }
  if (any) found_inf.fill_(1.f);  // never cleared here: flags of several calls accumulate
  return flags;
}

}  // namespace cpu
}  // namespace lamp
