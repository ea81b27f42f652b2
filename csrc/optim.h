// Fused optimizer kernels of lightning_amp._C (fused-optimizers part).
//
// Entry points (optim_entry.cpp) check every argument and dispatch by device to the kernels
// below, which assume checked arguments: equal-length lists, one device, contiguous tensors,
// params of one float-like dtype, grads of one float-like dtype, state tensors in the params'
// dtype, steps = one-element fp32 tensors, model_copies empty or 16-bit copies of fp32 params.
//
// Shared semantics: all math is fp32; grads are divided by *grad_scale when given; when
// *found_inf != 0 nothing is written at all (params, state, steps, copies); otherwise each
// step counter is incremented and its new value drives the bias corrections.
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

// Device kernels. `max_exp_avg_sqs` / `momentum_buffers` / `model_copies` may be empty.
namespace cpu {
void fused_adam(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, const TensorList& steps,
                const TensorList& model_copies, const AdamHyper& h, const OptTensor& grad_scale,
                const OptTensor& found_inf);
void fused_sgd(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
               const TensorList& model_copies, const SgdHyper& h, const OptTensor& grad_scale,
               const OptTensor& found_inf);
void fused_adadelta(const TensorList& params, const TensorList& grads, const TensorList& square_avgs,
                    const TensorList& acc_deltas, const TensorList& steps, const TensorList& model_copies,
                    const AdadeltaHyper& h, const OptTensor& grad_scale, const OptTensor& found_inf);
void fused_lamb(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& steps, const TensorList& model_copies,
                const LambHyper& h, const at::Tensor& global_grad_norm, const OptTensor& grad_scale,
                const OptTensor& found_inf);
}  // namespace cpu

#ifdef WITH_CUDA
namespace cuda {
void fused_adam(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, const TensorList& steps,
                const TensorList& model_copies, const AdamHyper& h, const OptTensor& grad_scale,
                const OptTensor& found_inf);
void fused_sgd(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
               const TensorList& model_copies, const SgdHyper& h, const OptTensor& grad_scale,
               const OptTensor& found_inf);
void fused_adadelta(const TensorList& params, const TensorList& grads, const TensorList& square_avgs,
                    const TensorList& acc_deltas, const TensorList& steps, const TensorList& model_copies,
                    const AdadeltaHyper& h, const OptTensor& grad_scale, const OptTensor& found_inf);
void fused_lamb(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& steps, const TensorList& model_copies,
                const LambHyper& h, const at::Tensor& global_grad_norm, const OptTensor& grad_scale,
                const OptTensor& found_inf);
}  // namespace cuda
#endif

}  // namespace lamp
