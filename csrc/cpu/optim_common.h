// Helpers shared by the CPU fused-optimizer kernels (csrc/cpu/optim_*.cpp): partial-vector
// load/store for chunk tails and the found_inf / grad_scale / step-counter conventions of
// csrc/optim.h (the (param, grad, model-copy) dtype dispatch is csrc/dispatch.h's).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu/multi_tensor_apply.h"
#include "cpu/vec_util.h"
#include "optim.h"

namespace lamp {
namespace cpu {
namespace optim {

constexpr int64_t W = VecF::size();

// Loads k <= W elements as fp32 lanes (missing lanes are 0).
template <typename T>
inline VecF load_n(const T* p, int64_t k) {
  if (k == W) return load_f32(p);
  float buf[W] = {};
  for (int64_t j = 0; j < k; ++j) buf[j] = static_cast<float>(p[j]);
  return VecF::loadu(buf);
}

// Stores the first k <= W lanes rounded to T (round-to-nearest-even, as torch's casts).
template <typename T>
inline void store_n(T* p, const VecF& v, int64_t k) {
  if (k == W) return store_f32(p, v);
  float buf[W];
  v.store(buf);
  for (int64_t j = 0; j < k; ++j) p[j] = static_cast<T>(buf[j]);
}

// The value store_n(p, v, k) just wrote, read back as fp32: rounded in registers for a whole
// vector, loaded from p for a tail (the same values, without a load waiting on a store).
template <typename T>
inline VecF as_stored(const T* p, const VecF& v, int64_t k) {
  return k == W ? round_to<T>(v) : load_n(p, k);
}

inline bool skip_step(const OptTensor& found_inf) {
  return found_inf.has_value() && found_inf->data_ptr<float>()[0] != 0.f;
}

inline float scale_of(const OptTensor& grad_scale) {
  return grad_scale.has_value() ? grad_scale->data_ptr<float>()[0] : 1.f;
}

// The step number this update performs for tensor t (its counter + 1).
inline double next_step(const TensorList& steps, int64_t t) {
  return static_cast<double>(steps[t].data_ptr<float>()[0]) + 1.0;
}

inline void advance_steps(const TensorList& steps) {
  for (const auto& s : steps) s.data_ptr<float>()[0] += 1.f;
}

// Runs fn(chunk_index, chunk) over all chunks: in parallel (at::parallel_for) when there is
// enough work, inline otherwise (waking a thread team costs more than updating a few
// thousand elements, and a lot more on a loaded machine).
template <typename F>
inline void run_chunks(const std::vector<Chunk>& chunks, const F& fn) {
  constexpr int64_t kSerialElements = 4 * kChunkSize;
  int64_t total = 0;
  for (const Chunk& c : chunks) total += c.end - c.begin;
  if (total <= kSerialElements || chunks.size() < 2) {
    for (size_t i = 0; i < chunks.size(); ++i) fn(static_cast<int64_t>(i), chunks[i]);
  } else {
    for_each_chunk(chunks, fn);
  }
}

template <typename T>
inline T* ptr(const at::Tensor& t, int64_t begin) {
  return t.data_ptr<T>() + begin;
}

template <typename T>
inline const T* cptr(const at::Tensor& t, int64_t begin) {
  return t.const_data_ptr<T>() + begin;
}

}  // namespace optim
}  // namespace cpu
}  // namespace lamp
