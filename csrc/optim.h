// Fused optimizer kernels of lightning_amp._C (fused-optimizers part).
//
// Entry points (optim_entry.cpp) check every argument and dispatch by device to the kernels
// below, which assume checked arguments: equal-length lists, one device, contiguous tensors,
// params of one float-like dtype, grads of one float-like dtype, state tensors in the params'
// dtype, steps = one-element fp32 tensors, model_copies empty or 16-bit copies of fp32 params.
//
// Shared semantics: all math is fp32; grads are divided by *grad_scale when given, and the
// unscaled grad (rounded to the grad's dtype) is written back in the same pass, as torch's fused
// optimizers do (no grad_scale: grads are only read); when *found_inf != 0 nothing is written at
// all (params, state, steps, copies, grads); otherwise each step counter is incremented and its
// new value drives the bias corrections. SGD's update uses the momentum as stored (rounded to the
// buffer's dtype), as torch.optim.SGD.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace lamp {

using TensorList = std::vector<at::Tensor>;
using OptTensor = std::optional<at::Tensor>;

struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool adam_w_mode, bias_correction;
};

struct SgdHyper {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, first_run;
};

struct AdadeltaHyper {
  double lr, rho, eps, weight_decay;
};

struct LambHyper {
  double lr, beta1, beta2, eps, weight_decay, max_grad_norm;
  bool bias_correction, grad_averaging, adam_w_mode, use_nvlamb;
};

// Python-facing checked entry points (bound in bindings.cpp).
void multi_tensor_adam(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                       const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, const TensorList& steps,
                       const TensorList& model_copies, double lr, double beta1, double beta2, double eps,
                       double weight_decay, bool adam_w_mode, bool bias_correction, const OptTensor& grad_scale,
                       const OptTensor& found_inf);
void multi_tensor_sgd(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
                      const TensorList& model_copies, double lr, double momentum, double dampening,
                      double weight_decay, bool nesterov, bool first_run, const OptTensor& grad_scale,
                      const OptTensor& found_inf);
void multi_tensor_adadelta(const TensorList& params, const TensorList& grads, const TensorList& square_avgs,
                           const TensorList& acc_deltas, const TensorList& steps, const TensorList& model_copies,
                           double lr, double rho, double eps, double weight_decay, const OptTensor& grad_scale,
                           const OptTensor& found_inf);
void multi_tensor_lamb(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                       const TensorList& exp_avg_sqs, const TensorList& steps, const TensorList& model_copies,
                       double lr, double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
                       bool grad_averaging, bool adam_w_mode, const at::Tensor& global_grad_norm,
                       double max_grad_norm, bool use_nvlamb, const OptTensor& grad_scale, const OptTensor& found_inf);
// LAMB in two calls, for params whose norms are summed across ranks in between (sharded params):
// multi_tensor_lamb_moments updates the moments and returns the fp64 [n, 2] squared norms
// (||p||^2, ||update||^2) of each (local) tensor; multi_tensor_lamb_apply applies the update with
// the trust ratios from `sq_norms` (the same tensor, summed over the shards) and advances the steps.
// The pair equals one multi_tensor_lamb call when `sq_norms` is passed on unchanged.
at::Tensor multi_tensor_lamb_moments(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                                     const TensorList& exp_avg_sqs, const TensorList& steps, double beta1,
                                     double beta2, double eps, double weight_decay, bool bias_correction,
                                     bool grad_averaging, bool adam_w_mode, const at::Tensor& global_grad_norm,
                                     double max_grad_norm, const OptTensor& grad_scale, const OptTensor& found_inf);
void multi_tensor_lamb_apply(const TensorList& params, const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                             const TensorList& steps, const TensorList& model_copies, double lr, double beta1,
                             double beta2, double eps, double weight_decay, bool bias_correction, bool adam_w_mode,
                             bool use_nvlamb, const at::Tensor& sq_norms, const OptTensor& found_inf);

// Device kernels (declared once, csrc/optim_kernels.h).
namespace cpu {
#include "optim_kernels.h"
}  // namespace cpu

#ifdef WITH_CUDA
namespace cuda {
#include "optim_kernels.h"
}  // namespace cuda
#endif

}  // namespace lamp
