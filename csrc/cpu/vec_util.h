// Small helpers over ATen's at::vec::Vectorized for the CPU kernels: load any of
// float/Half/BFloat16 as a Vectorized<float> of fp32 lanes, store fp32 lanes back rounded to
// the storage type (round-to-nearest-even, as torch's casts). One fp32 vector holds VecF::size()
// elements of any storage type. The dtype dispatch is csrc/dispatch.h's.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#include "dispatch.h"  // dispatch_float_like

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

}  // namespace cpu
}  // namespace lamp
