// Checked entry points of the fused optimizer kernels: every list length, dtype, device,
// shape and contiguity is verified with a message naming the op, the list and the index
// (apex checks none of these), then the call is dispatched by device.
#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "optim.h"

namespace lamp {
namespace {

using NamedList = std::pair<const char*, const TensorList*>;

std::string at_index(const char* name, size_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

void check_flag(const char* op, const char* name, const OptTensor& t, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->device() == device, op, ": ", name, " is on ", t->device(), " but the params are on ", device);
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat && t->numel() == 1, op, ": ", name,
                   " must be a one-element float32 tensor, got shape ", dims(t->sizes()), " ", t->scalar_type());
}

// Checks the lists shared by every optimizer and returns the params' device (`grads` null: a pass
// that reads no grads).
at::Device check_lists(const char* op, const TensorList& params, const TensorList* grads,
                       const std::vector<NamedList>& state, const TensorList* steps, const TensorList& copies,
                       const OptTensor& grad_scale, const OptTensor& found_inf) {
  const size_t n = params.size();
  auto check_len = [&](const char* name, const TensorList& l) {
    TORCH_CHECK_VALUE(l.size() == n, op, ": ", name, " has ", num(l.size()), " tensors but params has ", num(n),
                      "; all lists must have equal length");
  };
  if (grads != nullptr) check_len("grads", *grads);
  for (const auto& s : state) check_len(s.first, *s.second);
  if (steps != nullptr) check_len("steps", *steps);
  TORCH_CHECK_VALUE(copies.empty() || copies.size() == n, op, ": model_copies has ", num(copies.size()),
                    " tensors but params has ", num(n), " (give none or one per param)");
  LAMP_CHECK_NOT_EMPTY(op, "params", params);
  LAMP_CHECK_KERNEL_DEVICE(op, "params[0]", params[0]);
  const at::Device device = params[0].device();
  const at::ScalarType pdtype = params[0].scalar_type();
  const at::ScalarType gdtype = grads != nullptr ? (*grads)[0].scalar_type() : pdtype;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const std::string pn = at_index("params", i);
    TORCH_CHECK_VALUE(p.device() == device, op, ": ", pn, " is on ", p.device(), " but params[0] is on ", device);
    LAMP_CHECK_FLOAT_LIKE(op, pn, p);
    TORCH_CHECK_TYPE(p.scalar_type() == pdtype, op, ": params must share one dtype, ", pn, " is ", p.scalar_type(),
                     " but params[0] is ", pdtype);
    LAMP_CHECK_CONTIGUOUS(op, pn, p);
    auto check_like = [&](const std::string& name, const at::Tensor& t) {
      LAMP_CHECK_DENSE(op, name, t);
      TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but ", pn, " is on ", device);
      TORCH_CHECK_VALUE(t.sizes() == p.sizes(), op, ": ", name, " shape ", dims(t.sizes()), " != ", pn,
                        " shape ", dims(p.sizes()));
      LAMP_CHECK_CONTIGUOUS(op, name, t);
    };
    if (grads != nullptr) {
      const std::string gn = at_index("grads", i);
      const at::Tensor& g = (*grads)[i];
      TORCH_CHECK_VALUE(g.device() == device, op, ": ", gn, " is on ", g.device(), " but ", pn, " is on ", device);
      LAMP_CHECK_FLOAT_LIKE(op, gn, g);
      TORCH_CHECK_TYPE(g.scalar_type() == gdtype, op, ": grads must share one dtype, ", gn, " is ", g.scalar_type(),
                       " but grads[0] is ", gdtype);
      check_like(gn, g);
    }
    for (const auto& s : state) {
      const std::string sn = at_index(s.first, i);
      const at::Tensor& t = (*s.second)[i];
      TORCH_CHECK_VALUE(t.device() == device, op, ": ", sn, " is on ", t.device(), " but ", pn, " is on ", device);
      TORCH_CHECK_TYPE(t.scalar_type() == pdtype, op, ": ", sn, " must have its param's dtype ", pdtype, ", got ",
                       t.scalar_type());
      check_like(sn, t);
    }
    if (steps != nullptr) {
      const at::Tensor& s = (*steps)[i];
      TORCH_CHECK_VALUE(s.device() == device, op, ": ", at_index("steps", i), " is on ", s.device(), " but ", pn,
                        " is on ", device);
      TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat && s.numel() == 1, op, ": ", at_index("steps", i),
                       " must be a one-element float32 tensor, got shape ", dims(s.sizes()), " ", s.scalar_type());
    }
    if (!copies.empty()) {
      const std::string cn = at_index("model_copies", i);
      TORCH_CHECK_VALUE(copies[i].device() == device, op, ": ", cn, " is on ", copies[i].device(), " but ", pn,
                        " is on ", device);
      LAMP_CHECK_DENSE(op, cn, copies[i]);
      TORCH_CHECK_TYPE(pdtype == at::kFloat, op, ": with model_copies the params are fp32 masters, got ", pdtype);
      TORCH_CHECK_TYPE(is_half_like(copies[i].scalar_type()), op, ": ", cn, " must be float16 or bfloat16, got ",
                       copies[i].scalar_type());
      TORCH_CHECK_TYPE(copies[i].scalar_type() == copies[0].scalar_type(), op,
                       ": model_copies must share one dtype");
      check_like(cn, copies[i]);
    }
  }
  check_flag(op, "grad_scale", grad_scale, device);
  check_flag(op, "found_inf", found_inf, device);
  return device;
}

void check_sq_norms(const char* op, const at::Tensor& sq_norms, size_t n, const at::Device& device) {
  LAMP_CHECK_DENSE(op, "sq_norms", sq_norms);
  TORCH_CHECK_VALUE(sq_norms.device() == device, op, ": sq_norms is on ", sq_norms.device(), " but the params are on ",
                    device);
  LAMP_CHECK_DTYPE(op, "sq_norms", sq_norms, at::kDouble);
  TORCH_CHECK_VALUE(sq_norms.dim() == 2 && sq_norms.size(0) == static_cast<int64_t>(n) && sq_norms.size(1) == 2, op,
                    ": sq_norms must have shape [len(params), 2] = ", dims({static_cast<int64_t>(n), 2}), ", got ",
                    dims(sq_norms.sizes()));
}

}  // namespace

void multi_tensor_adam(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                       const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, const TensorList& steps,
                       const TensorList& model_copies, double lr, double beta1, double beta2, double eps,
                       double weight_decay, bool adam_w_mode, bool bias_correction, const OptTensor& grad_scale,
                       const OptTensor& found_inf) {
  std::vector<NamedList> state = {{"exp_avgs", &exp_avgs}, {"exp_avg_sqs", &exp_avg_sqs}};
  if (!max_exp_avg_sqs.empty()) state.push_back({"max_exp_avg_sqs", &max_exp_avg_sqs});
  const at::Device device =
      check_lists("multi_tensor_adam", params, &grads, state, &steps, model_copies, grad_scale, found_inf);
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, adam_w_mode,
                    bias_correction};
  if (device.is_cpu()) return cpu::fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                                              model_copies, h, grad_scale, found_inf);
#ifdef WITH_CUDA
  cuda::fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, model_copies, h, grad_scale,
                   found_inf);
#endif
}

void multi_tensor_sgd(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
                      const TensorList& model_copies, double lr, double momentum, double dampening,
                      double weight_decay, bool nesterov, bool first_run, const OptTensor& grad_scale,
                      const OptTensor& found_inf) {
  std::vector<NamedList> state;
  if (momentum != 0.0) {
    TORCH_CHECK_VALUE(!momentum_buffers.empty() || params.empty(),
                      "multi_tensor_sgd: momentum_buffers are required when momentum != 0");
    state.push_back({"momentum_buffers", &momentum_buffers});
  }
  const at::Device device =
      check_lists("multi_tensor_sgd", params, &grads, state, nullptr, model_copies, grad_scale, found_inf);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, first_run};
  if (device.is_cpu()) return cpu::fused_sgd(params, grads, momentum_buffers, model_copies, h, grad_scale, found_inf);
#ifdef WITH_CUDA
  cuda::fused_sgd(params, grads, momentum_buffers, model_copies, h, grad_scale, found_inf);
#endif
}

void multi_tensor_adadelta(const TensorList& params, const TensorList& grads, const TensorList& square_avgs,
                           const TensorList& acc_deltas, const TensorList& steps, const TensorList& model_copies,
                           double lr, double rho, double eps, double weight_decay, const OptTensor& grad_scale,
                           const OptTensor& found_inf) {
  const std::vector<NamedList> state = {{"square_avgs", &square_avgs}, {"acc_deltas", &acc_deltas}};
  const at::Device device =
      check_lists("multi_tensor_adadelta", params, &grads, state, &steps, model_copies, grad_scale, found_inf);
  const AdadeltaHyper h{lr, rho, eps, weight_decay};
  if (device.is_cpu())
    return cpu::fused_adadelta(params, grads, square_avgs, acc_deltas, steps, model_copies, h, grad_scale, found_inf);
#ifdef WITH_CUDA
  cuda::fused_adadelta(params, grads, square_avgs, acc_deltas, steps, model_copies, h, grad_scale, found_inf);
#endif
}

void multi_tensor_lamb(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                       const TensorList& exp_avg_sqs, const TensorList& steps, const TensorList& model_copies,
                       double lr, double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
                       bool grad_averaging, bool adam_w_mode, const at::Tensor& global_grad_norm,
                       double max_grad_norm, bool use_nvlamb, const OptTensor& grad_scale, const OptTensor& found_inf) {
  const std::vector<NamedList> state = {{"exp_avgs", &exp_avgs}, {"exp_avg_sqs", &exp_avg_sqs}};
  const at::Device device =
      check_lists("multi_tensor_lamb", params, &grads, state, &steps, model_copies, grad_scale, found_inf);
  check_flag("multi_tensor_lamb", "global_grad_norm", global_grad_norm, device);
  const LambHyper h{lr, beta1, beta2, eps, weight_decay, max_grad_norm,
                    bias_correction, grad_averaging, adam_w_mode, use_nvlamb};
  if (device.is_cpu())
    return cpu::fused_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, model_copies, h, global_grad_norm, grad_scale,
                           found_inf);
#ifdef WITH_CUDA
  cuda::fused_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, model_copies, h, global_grad_norm, grad_scale,
                   found_inf);
#endif
}

at::Tensor multi_tensor_lamb_moments(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                                     const TensorList& exp_avg_sqs, const TensorList& steps, double beta1,
                                     double beta2, double eps, double weight_decay, bool bias_correction,
                                     bool grad_averaging, bool adam_w_mode, const at::Tensor& global_grad_norm,
                                     double max_grad_norm, const OptTensor& grad_scale, const OptTensor& found_inf) {
  const char* op = "multi_tensor_lamb_moments";
  const std::vector<NamedList> state = {{"exp_avgs", &exp_avgs}, {"exp_avg_sqs", &exp_avg_sqs}};
  const at::Device device = check_lists(op, params, &grads, state, &steps, {}, grad_scale, found_inf);
  check_flag(op, "global_grad_norm", global_grad_norm, device);
  const LambHyper h{0.0, beta1, beta2, eps, weight_decay, max_grad_norm,
                    bias_correction, grad_averaging, adam_w_mode, false};
#ifdef WITH_CUDA
  if (device.is_cuda())
    return cuda::lamb_moments(params, grads, exp_avgs, exp_avg_sqs, steps, h, global_grad_norm, grad_scale,
                              found_inf);
#endif
  return cpu::lamb_moments(params, grads, exp_avgs, exp_avg_sqs, steps, h, global_grad_norm, grad_scale, found_inf);
}

void multi_tensor_lamb_apply(const TensorList& params, const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                             const TensorList& steps, const TensorList& model_copies, double lr, double beta1,
                             double beta2, double eps, double weight_decay, bool bias_correction, bool adam_w_mode,
                             bool use_nvlamb, const at::Tensor& sq_norms, const OptTensor& found_inf) {
  const char* op = "multi_tensor_lamb_apply";
  const std::vector<NamedList> state = {{"exp_avgs", &exp_avgs}, {"exp_avg_sqs", &exp_avg_sqs}};
  const at::Device device = check_lists(op, params, nullptr, state, &steps, model_copies, std::nullopt, found_inf);
  check_sq_norms(op, sq_norms, params.size(), device);
  const LambHyper h{lr, beta1, beta2, eps, weight_decay, 0.0, bias_correction, false, adam_w_mode, use_nvlamb};
  if (device.is_cpu()) return cpu::lamb_apply(params, exp_avgs, exp_avg_sqs, steps, model_copies, h, sq_norms, found_inf);
#ifdef WITH_CUDA
  cuda::lamb_apply(params, exp_avgs, exp_avg_sqs, steps, model_copies, h, sq_norms, found_inf);
#endif
}

}  // namespace lamp
