// dtype dispatch shared by the CPU and CUDA kernels: a float-like dtype to its C++ storage type
// (float, c10::Half, c10::BFloat16; host code, usable from .cpp and .cu), and the (param, grad,
// model-copy) type combinations of the fused optimizers (csrc/optim.h).
#pragma once

#include <ATen/ATen.h>

#include <type_traits>
#include <vector>

namespace lamp {

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

template <typename F>
inline void dispatch_half(at::ScalarType dtype, const char* op, F&& f) {
  if (dtype == at::kHalf) return f(c10::Half{});
  if (dtype == at::kBFloat16) return f(c10::BFloat16{});
  TORCH_CHECK_TYPE(false, op, ": model copies must be float16 or bfloat16, got ", dtype);
}

// Calls f(P{}, M{}, std::bool_constant<copy>{}): P the param/state type, M the model-copy type
// (== P and unused when there are no copies; params are fp32 masters otherwise).
template <typename F>
inline void dispatch_param_copy(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& copies,
                                const char* op, F&& f) {
  if (!copies.empty()) {
    dispatch_half(copies[0].scalar_type(), op, [&](auto m) { f(float{}, m, std::true_type{}); });
  } else {
    dispatch_float_like(params[0].scalar_type(), op, [&](auto p) { f(p, p, std::false_type{}); });
  }
}

// Calls f(P{}, G{}, M{}, std::bool_constant<copy>{}): as dispatch_param_copy, G the grad type.
template <typename F>
inline void dispatch_types(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                           const std::vector<at::Tensor>& copies, const char* op, F&& f) {
  dispatch_param_copy(params, copies, op, [&](auto p, auto m, auto copy) {
    dispatch_float_like(grads[0].scalar_type(), op, [&](auto g) { f(p, g, m, copy); });
  });
}

}  // namespace lamp
