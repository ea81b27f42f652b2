// CPU multi-tensor L2 norm: the global norm of a list of tensors and each tensor's norm in
// one parallel pass. Squares are accumulated in fp32 within a chunk (vector lanes), chunk
// partial sums are combined in fp64; results are fp32. inf/nan propagate into the norms.
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu/multi_tensor_apply.h"
#include "cpu/vec_util.h"
#include "kernels.h"

namespace lamp {
namespace cpu {
namespace {

template <typename T>
double sum_squares(const T* p, int64_t n) {
  constexpr int64_t W = VecF::size();
  VecF acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const VecF a = load_f32(p + i);
    const VecF b = load_f32(p + i + W);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  for (; i + W <= n; i += W) {
    const VecF a = load_f32(p + i);
    acc0 = at::vec::fmadd(a, a, acc0);
  }
  float lanes[W];
  (acc0 + acc1).store(lanes);
  double total = 0.0;
  for (int64_t j = 0; j < W; ++j) total += lanes[j];
  for (; i < n; ++i) {
    const float x = static_cast<float>(p[i]);
    total += static_cast<double>(x * x);
  }
  return total;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors) {
  const int64_t count = static_cast<int64_t>(tensors.size());
  const std::vector<Chunk> chunks = make_chunks(numels_of(tensors));
  std::vector<double> partial(chunks.size(), 0.0);
  for_each_chunk(chunks, [&](int64_t ci, const Chunk& c) {
    const at::Tensor& t = tensors[c.tensor];
    dispatch_float_like(t.scalar_type(), "multi_tensor_l2norm", [&](auto tag) {
      using T = decltype(tag);
      partial[ci] = sum_squares<T>(t.const_data_ptr<T>() + c.begin, c.end - c.begin);
    });
  });
  std::vector<double> per(count, 0.0);
  for (size_t ci = 0; ci < chunks.size(); ++ci) per[chunks[ci].tensor] += partial[ci];
  at::Tensor each = at::empty({count}, at::TensorOptions().dtype(at::kFloat));
  float* e = each.data_ptr<float>();
  double total = 0.0;
  for (int64_t t = 0; t < count; ++t) {
    total += per[t];
    e[t] = static_cast<float>(std::sqrt(per[t]));
  }
  at::Tensor norm = at::full({}, static_cast<float>(std::sqrt(total)), at::TensorOptions().dtype(at::kFloat));
  return {norm, each};
}

}  // namespace cpu
}  // namespace lamp
