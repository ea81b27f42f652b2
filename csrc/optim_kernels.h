// Declarations of the fused-optimizer device kernels, included by csrc/optim.h inside namespace
// lamp::cpu and (WITH_CUDA) lamp::cuda: both back ends implement the same functions. Included
// twice on purpose (no #pragma once); include csrc/optim.h, not this file.
// `max_exp_avg_sqs` / `momentum_buffers` / `model_copies` may be empty.
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
at::Tensor lamb_moments(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                        const TensorList& exp_avg_sqs, const TensorList& steps, const LambHyper& h,
                        const at::Tensor& global_grad_norm, const OptTensor& grad_scale, const OptTensor& found_inf);
void lamb_apply(const TensorList& params, const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                const TensorList& steps, const TensorList& model_copies, const LambHyper& h,
                const at::Tensor& sq_norms, const OptTensor& found_inf);
