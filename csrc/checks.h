// Argument checks shared by every kernel entry point of lightning_amp._C.
// Each macro raises a c10::Error (Python: RuntimeError / TypeError / ValueError via TORCH_CHECK_*)
// whose message names the op, the argument and what was expected.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <string>

namespace lamp {

inline bool is_float_like(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline bool is_half_like(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

}  // namespace lamp

// dtype must be float32 / float16 / bfloat16.
#define LAMP_CHECK_FLOAT_LIKE(op, name, t)                                                               \
  TORCH_CHECK_TYPE(::lamp::is_float_like((t).scalar_type()), op, ": ", name,                              \
                   " must be float32, float16 or bfloat16, got ", (t).scalar_type())

#define LAMP_CHECK_DTYPE(op, name, t, dtype)                                                             \
  TORCH_CHECK_TYPE((t).scalar_type() == (dtype), op, ": ", name, " must be ", (dtype), ", got ",          \
                   (t).scalar_type())

#define LAMP_CHECK_SAME_DEVICE(op, name_a, a, name_b, b)                                                 \
  TORCH_CHECK_VALUE((a).device() == (b).device(), op, ": ", name_a, " (", (a).device(), ") and ", name_b, \
                    " (", (b).device(), ") must be on the same device")

#define LAMP_CHECK_CONTIGUOUS(op, name, t)                                                               \
  TORCH_CHECK_VALUE((t).is_contiguous(), op, ": ", name, " must be contiguous (got strides ",             \
                    (t).strides(), ")")

#define LAMP_CHECK_DEVICE_TYPE(op, name, t, kind)                                                        \
  TORCH_CHECK_VALUE((t).device().type() == (kind), op, ": ", name, " must be on a ", (kind),              \
                    " device, got ", (t).device())

// A size handed to a 32-bit-int BLAS interface (MKL LP64, cuBLAS int) must fit.
#define LAMP_CHECK_FITS_INT32(op, what, v)                                                               \
  TORCH_CHECK_VALUE((v) <= static_cast<int64_t>(std::numeric_limits<int32_t>::max()), op, ": ", what,    \
                    " = ", (v), " exceeds the 32-bit BLAS limit 2^31-1")
