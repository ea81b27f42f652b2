// Helpers shared by the CUDA fused-optimizer kernels (csrc/cuda/optim_*.cu), on top of the
// compiled core's multi_tensor_apply.cuh (and csrc/dispatch.h's dtype dispatch): the per-tensor
// step values and the found_inf-guarded step increment. See csrc/optim.h for the
// semantics (fp32 math; grads divided by *grad_scale; *found_inf != 0 => nothing written).
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#include "cuda/multi_tensor_apply.cuh"
#include "optim.h"

namespace lamp {
namespace cuda {
namespace optim {

template <typename T>
__device__ __forceinline__ float to_f32(T x) {
  return static_cast<float>(x);
}

template <typename T>
__device__ __forceinline__ T from_f32(float x) {
  return static_cast<T>(x);
}

__device__ __forceinline__ bool skip_step(const float* found_inf) { return found_inf != nullptr && *found_inf != 0.f; }

__device__ __forceinline__ float scale_of(const float* grad_scale) { return grad_scale != nullptr ? *grad_scale : 1.f; }

// gv[k] /= scale for the K grads at g + i, written back unscaled (rounded to G) when a grad_scale
// was given, as torch's fused kernels leave them.
template <int K, typename G>
__device__ __forceinline__ void unscale_grads(float (&gv)[K], G* g, int64_t i, float scale, const float* grad_scale) {
#pragma unroll
  for (int k = 0; k < K; ++k) gv[k] = gv[k] / scale;
  if (grad_scale != nullptr) store_f32(g, i, gv);
}

// Per-tensor current step values gathered into one fp32 device vector (index = aux[t]).
inline at::Tensor step_values(const TensorList& steps) { return at::stack(steps).reshape({-1}).contiguous(); }

// steps += 1, unless found_inf != 0 (no host synchronisation).
inline void advance_steps(const TensorList& steps, const OptTensor& found_inf) {
  if (steps.empty()) return;
  if (found_inf.has_value()) {
    at::_foreach_add_(steps, found_inf->reshape({}).eq(0).to(at::kFloat));
  } else {
    at::_foreach_add_(steps, at::Scalar(1.0));
  }
}

inline std::vector<int64_t> positions(size_t count) {
  std::vector<int64_t> aux(count);
  for (size_t i = 0; i < count; ++i) aux[i] = static_cast<int64_t>(i);
  return aux;
}

inline const float* ptr_or_null(const OptTensor& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

}  // namespace optim
}  // namespace cuda
}  // namespace lamp
