// Small helpers over ATen's at::vec::Vectorized for the CPU kernels: load any of
// float/Half/BFloat16 as a Vectorized<float> of fp32 lanes, store fp32 lanes back rounded to
// the storage type (round-to-nearest-even, as torch's casts), and dispatch on a tensor's
// float-like dtype. One fp32 vector holds VecF::size() elements of any storage type.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

namespace lamp {
namespace cpu {

using VecF = at::vec::Vectorized<float>;

template <typename T>
inline VecF load_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return VecF::loadu(p);
  } else {
    VecF out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

template <typename T>
inline void store_f32(T* p, const VecF& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, VecF::size());
  }
}

// Calls f(T{}) with T the C++ storage type of `dtype` (float, c10::Half or c10::BFloat16).
template <typename F>
inline void dispatch_float_like(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    default:
      TORCH_CHECK_TYPE(false, op, ": unsupported dtype ", dtype, " (float32, float16 or bfloat16 expected)");
  }
}

}  // namespace cpu
}  // namespace lamp
