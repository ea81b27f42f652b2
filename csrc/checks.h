// Argument checks shared by every kernel entry point of lightning_amp._C.
// Each macro raises a c10::Error (Python: RuntimeError / TypeError / ValueError via TORCH_CHECK_*)
// whose message names the op, the argument and what was expected.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

namespace lamp {

inline bool is_float_like(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline bool is_half_like(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Integers and shapes in messages are text made here (std::to_string: no stream, no locale), never
// values streamed by c10::str into its std::ostringstream. On the H200 image (the extension compiled
// by its /opt/gcc g++, run against the libstdc++ Python loads) every bad-input message that streamed
// an integer or a shape killed the process (SIGSEGV) while every message of strings, dtypes and
// devices raised: 28 CUDA cases at f667cf8 (benchmarks/gpu/f667cf8). The mechanism (most likely a
// libstdc++ newer at compile time than at run time) was not confirmed there; text made without a
// stream avoids that path either way. tests/ops/test_csrc_messages.py keeps every message so.
template <typename Int, typename = std::enable_if_t<std::is_integral_v<Int>>>
std::string num(Int v) {
  return std::to_string(v);
}

// "[2, 3]", as torch prints a shape.
inline std::string dims(at::IntArrayRef d) {
  std::string out = "[";
  for (size_t i = 0; i < d.size(); ++i) out += (i ? ", " : "") + std::to_string(d[i]);
  return out + "]";
}

// Whether this build has kernels for tensors on d: CPU always, CUDA when built WITH_CUDA.
inline bool has_kernels_for(const at::Device& d) {
#ifdef WITH_CUDA
  return d.is_cpu() || d.is_cuda();
#else
  return d.is_cpu();
#endif
}

#ifdef WITH_CUDA
constexpr const char* kKernelDevices = "cpu and cuda";
#else
constexpr const char* kKernelDevices = "cpu only (built without CUDA)";
#endif

}  // namespace lamp

// A dense (strided) tensor: sparse and other layouts have no data pointer the kernels can walk.
#define LAMP_CHECK_DENSE(op, name, t)                                                                    \
  TORCH_CHECK_TYPE((t).layout() == at::kStrided, op, ": ", name, " must be a dense (strided) tensor, got layout ", \
                   (t).layout())

// A dense tensor whose dtype is float32 / float16 / bfloat16 (complex dtypes are refused here too).
#define LAMP_CHECK_FLOAT_LIKE(op, name, t)                                                               \
  LAMP_CHECK_DENSE(op, name, t);                                                                         \
  TORCH_CHECK_TYPE(::lamp::is_float_like((t).scalar_type()), op, ": ", name,                              \
                   " must be float32, float16 or bfloat16, got ", (t).scalar_type())

// Checked first, before any data pointer, stream or kernel is touched (meta tensors have no data).
#define LAMP_CHECK_KERNEL_DEVICE(op, name, t)                                                           \
  TORCH_CHECK_VALUE(::lamp::has_kernels_for((t).device()), op, ": ", name, " is on ", (t).device(),     \
                    ", but this build has kernels for ", ::lamp::kKernelDevices)

#define LAMP_CHECK_NOT_EMPTY(op, name, list)                                                             \
  TORCH_CHECK_VALUE(!(list).empty(), op, ": ", name, " is empty (give at least one tensor)")

#define LAMP_CHECK_DTYPE(op, name, t, dtype)                                                             \
  TORCH_CHECK_TYPE((t).scalar_type() == (dtype), op, ": ", name, " must be ", (dtype), ", got ",          \
                   (t).scalar_type())

#define LAMP_CHECK_SAME_DEVICE(op, name_a, a, name_b, b)                                                 \
  TORCH_CHECK_VALUE((a).device() == (b).device(), op, ": ", name_a, " is on ", (a).device(), " but ", name_b, \
                    " is on ", (b).device(), " (all tensors must share one device)")

#define LAMP_CHECK_CONTIGUOUS(op, name, t)                                                               \
  TORCH_CHECK_VALUE((t).is_contiguous(), op, ": ", name, " must be contiguous (got strides ",             \
                    ::lamp::dims((t).strides()), ")")

// A size handed to a 32-bit-int BLAS interface (MKL LP64, cuBLAS int) must fit.
#define LAMP_CHECK_FITS_INT32(op, what, v)                                                               \
  TORCH_CHECK_VALUE((v) <= static_cast<int64_t>(std::numeric_limits<int32_t>::max()), op, ": ", what,    \
                    " = ", ::lamp::num(v), " exceeds the 32-bit BLAS limit 2^31-1")
