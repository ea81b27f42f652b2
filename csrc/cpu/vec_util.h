// Small helpers over ATen's at::vec::Vectorized for the CPU kernels: load any of
// float/Half/BFloat16 as a Vectorized<float> of fp32 lanes, store fp32 lanes back rounded to
// the storage type (round-to-nearest-even, as torch's casts). One fp32 vector holds VecF::size()
// elements of any storage type. The dtype dispatch is csrc/dispatch.h's. The 16-bit conversions
// are written here for the AVX512 and AVX2 builds (csrc/cpu's ISA is fixed at build time,
// lightning_amp/ops/_build.py's cpu_vector_flags) and fall back to at::vec's elsewhere.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#include "dispatch.h"  // dispatch_float_like

namespace lamp {
namespace cpu {

using VecF = at::vec::Vectorized<float>;

// The 16-bit storage of one VecF, rounded to nearest even; NaN becomes 0xffff (a NaN), as at::vec's
// conversions. One vector at a time with integer shifts (at::vec's convert_from_float converts two
// vectors and masks the store: twice the work for one), so a CPU without AVX512-BF16 pays a few
// integer ops per 16 values.
#if defined(CPU_CAPABILITY_AVX512)
using Vec16Bits = __m256i;  // 16 x 16 bits

inline Vec16Bits bf16_bits(const VecF& v) {
  const __m512 x = v;
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), rounded);
  return _mm512_cvtepi32_epi16(rounded);  // every lane <= 0xffff: truncation is exact
}

inline Vec16Bits half_bits(const VecF& v) {
  return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

inline VecF f32_of_bf16(const Vec16Bits& b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

inline VecF f32_of_half(const Vec16Bits& b) { return _mm512_cvtph_ps(b); }

inline Vec16Bits load_bits(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline void store_bits(void* p, const Vec16Bits& b) { _mm256_storeu_si256(static_cast<__m256i*>(p), b); }
#define LAMP_VEC16_BITS 1
#elif defined(CPU_CAPABILITY_AVX2)
using Vec16Bits = __m128i;  // 8 x 16 bits

inline Vec16Bits bf16_bits(const VecF& v) {
  const __m256 x = v;
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0xffff), nan);
  // packus interleaves the two 128-bit halves: lanes 0-3 and 4-7 of `rounded` end in 64-bit words 0 and 2
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xd8);
  return _mm256_castsi256_si128(packed);
}

inline Vec16Bits half_bits(const VecF& v) {
  return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

inline VecF f32_of_bf16(const Vec16Bits& b) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

inline VecF f32_of_half(const Vec16Bits& b) { return _mm256_cvtph_ps(b); }

inline Vec16Bits load_bits(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline void store_bits(void* p, const Vec16Bits& b) { _mm_storeu_si128(static_cast<__m128i*>(p), b); }
#define LAMP_VEC16_BITS 1
#endif

template <typename T>
inline VecF load_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return VecF::loadu(p);
  } else {
#ifdef LAMP_VEC16_BITS
    if constexpr (std::is_same_v<T, c10::BFloat16>) return f32_of_bf16(load_bits(p));
    if constexpr (std::is_same_v<T, c10::Half>) return f32_of_half(load_bits(p));
#endif
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
#ifdef LAMP_VEC16_BITS
    if constexpr (std::is_same_v<T, c10::BFloat16>) return store_bits(p, bf16_bits(v));
    if constexpr (std::is_same_v<T, c10::Half>) return store_bits(p, half_bits(v));
#endif
    at::vec::convert_from_float<T>(v, v).store(p, VecF::size());
  }
}

// v rounded to T and back (the value a store_f32 then load_f32 would give), without the memory
// round trip; identity for float.
template <typename T>
inline VecF round_to(const VecF& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
#ifdef LAMP_VEC16_BITS
    if constexpr (std::is_same_v<T, c10::BFloat16>) return f32_of_bf16(bf16_bits(v));
    if constexpr (std::is_same_v<T, c10::Half>) return f32_of_half(half_bits(v));
#endif
    T buf[VecF::size()];
    store_f32(buf, v);
    return load_f32(buf);
  }
}

}  // namespace cpu
}  // namespace lamp
