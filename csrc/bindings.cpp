// lightning_amp._C: the one pybind11 module of the compiled core.
//
// Entry points here check every argument (dtype, device, shape, contiguity) with messages
// naming the op and the argument, then dispatch by device to the kernels declared in
// kernels.h (CPU always, CUDA when built WITH_CUDA). Python code reaches this module only
// through lightning_amp/ops.py.
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "kernels.h"
#include "o2_policy.h"

// ==== BEGIN fused-optimizer declarations (owned by the fused-optimizers helper) ====
// Declare the optimizer entry points defined in your own csrc/cpu/*.cpp / csrc/cuda/*.cu here.
#include "optim.h"  // checked entry points, defined in csrc/optim_entry.cpp
// ==== END fused-optimizer declarations ====

namespace lamp {
namespace {

// Flattens t[..., features] to a 2-D contiguous [rows, features] matrix.
at::Tensor as_rows(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}).contiguous(); }

void check_wgrad(const char* op, const at::Tensor& input, const at::Tensor& grad_output, const at::Tensor& main_grad) {
  LAMP_CHECK_KERNEL_DEVICE(op, "main_grad", main_grad);
  LAMP_CHECK_SAME_DEVICE(op, "input", input, "main_grad", main_grad);
  LAMP_CHECK_SAME_DEVICE(op, "grad_output", grad_output, "main_grad", main_grad);
  LAMP_CHECK_DENSE(op, "main_grad", main_grad);
  LAMP_CHECK_FLOAT_LIKE(op, "input", input);
  LAMP_CHECK_FLOAT_LIKE(op, "grad_output", grad_output);
  TORCH_CHECK_TYPE(input.scalar_type() == grad_output.scalar_type(), op, ": input (", input.scalar_type(),
                   ") and grad_output (", grad_output.scalar_type(), ") must share a dtype");
  TORCH_CHECK_VALUE(main_grad.dim() == 2, op, ": main_grad must be 2-D [out, in], got shape ", dims(main_grad.sizes()));
  TORCH_CHECK_VALUE(input.dim() >= 1 && grad_output.dim() >= 1, op, ": input and grad_output need at least 1 dim");
  TORCH_CHECK_VALUE(input.sizes().slice(0, input.dim() - 1) == grad_output.sizes().slice(0, grad_output.dim() - 1),
                    op, ": input [..., in] and grad_output [..., out] must share leading dims, got ", dims(input.sizes()),
                    " and ", dims(grad_output.sizes()));
  TORCH_CHECK_VALUE(main_grad.size(0) == grad_output.size(-1) && main_grad.size(1) == input.size(-1), op,
                    ": main_grad shape ", dims(main_grad.sizes()), " != [out, in] = ",
                    dims({grad_output.size(-1), input.size(-1)}));
  LAMP_CHECK_CONTIGUOUS(op, "main_grad", main_grad);
}

void wgrad_dispatch(const at::Tensor& input, const at::Tensor& grad_output, at::Tensor& main_grad) {
  const at::Tensor x = as_rows(input);
  const at::Tensor g = as_rows(grad_output);
  if (main_grad.is_cpu()) {
    cpu::wgrad_gemm_accum(x, g, main_grad);
    return;
  }
#ifdef WITH_CUDA
  if (main_grad.is_cuda()) {
    cuda::wgrad_gemm_accum(x, g, main_grad);
    return;
  }
#endif
  TORCH_CHECK_VALUE(false, "wgrad_gemm_accum: no kernel for device ", main_grad.device());  // unreachable: checked
}

void wgrad_gemm_accum_fp32(const at::Tensor& input, const at::Tensor& grad_output, at::Tensor& main_grad) {
  const char* op = "wgrad_gemm_accum_fp32";
  check_wgrad(op, input, grad_output, main_grad);
  LAMP_CHECK_DTYPE(op, "main_grad", main_grad, at::kFloat);
  wgrad_dispatch(input, grad_output, main_grad);
}

void wgrad_gemm_accum_fp16(const at::Tensor& input, const at::Tensor& grad_output, at::Tensor& main_grad) {
  const char* op = "wgrad_gemm_accum_fp16";
  check_wgrad(op, input, grad_output, main_grad);
  TORCH_CHECK_TYPE(is_half_like(main_grad.scalar_type()), op, ": main_grad must be float16 or bfloat16, got ",
                   main_grad.scalar_type());
  wgrad_dispatch(input, grad_output, main_grad);
}

// Common checks of a tensor list: all on `device` (checked to have kernels), float-like, contiguous.
void check_list(const char* op, const char* name, const std::vector<at::Tensor>& ts, const at::Device& device) {
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    const std::string what = std::string(name) + "[" + std::to_string(i) + "]";
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", what, " is on ", t.device(), " but the first tensor is on ",
                      device, " (all tensors must share one device)");
    LAMP_CHECK_FLOAT_LIKE(op, what, t);
    LAMP_CHECK_CONTIGUOUS(op, what, t);
  }
}

at::Tensor multi_tensor_scale(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale,
                              at::Tensor found_inf) {
  const char* op = "multi_tensor_scale";
  TORCH_CHECK_VALUE(src.size() == dst.size(), op, ": src and dst must have equal length, got ", num(src.size()), " and ",
                    num(dst.size()));
  LAMP_CHECK_NOT_EMPTY(op, "src", src);
  LAMP_CHECK_KERNEL_DEVICE(op, "src[0]", src[0]);
  const at::Device device = src[0].device();
  check_list(op, "src", src, device);
  check_list(op, "dst", dst, device);
  TORCH_CHECK_VALUE(found_inf.device() == device, op, ": found_inf is on ", found_inf.device(),
                    " but the tensors are on ", device);
  LAMP_CHECK_DTYPE(op, "found_inf", found_inf, at::kFloat);
  TORCH_CHECK_VALUE(found_inf.numel() == 1, op, ": found_inf must hold one element, got shape ", dims(found_inf.sizes()));
  for (size_t i = 0; i < src.size(); ++i) {
    TORCH_CHECK_VALUE(src[i].sizes() == dst[i].sizes(), op, ": src[", num(i), "] shape ", dims(src[i].sizes()),
                      " != dst[", num(i), "] shape ", dims(dst[i].sizes()));
  }
#ifdef WITH_CUDA
  if (device.is_cuda()) return cuda::multi_tensor_scale(src, dst, scale, found_inf);
#endif
  return cpu::multi_tensor_scale(src, dst, scale, found_inf);
}

void multi_tensor_check_finite(const std::vector<at::Tensor>& tensors, at::Tensor found_inf) {
  const char* op = "multi_tensor_check_finite";
  LAMP_CHECK_NOT_EMPTY(op, "tensors", tensors);
  LAMP_CHECK_KERNEL_DEVICE(op, "tensors[0]", tensors[0]);
  const at::Device device = tensors[0].device();
  check_list(op, "tensors", tensors, device);
  TORCH_CHECK_VALUE(found_inf.device() == device, op, ": found_inf is on ", found_inf.device(),
                    " but the tensors are on ", device);
  LAMP_CHECK_DTYPE(op, "found_inf", found_inf, at::kFloat);
  TORCH_CHECK_VALUE(found_inf.numel() == 1, op, ": found_inf must hold one element, got shape ", dims(found_inf.sizes()));
#ifdef WITH_CUDA
  if (device.is_cuda()) return cuda::multi_tensor_check_finite(tensors, found_inf);
#endif
  cpu::multi_tensor_check_finite(tensors, found_inf);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors, bool per_tensor) {
  (void)per_tensor;  // per-tensor norms come for free from the same pass; always returned
  const char* op = "multi_tensor_l2norm";
  LAMP_CHECK_NOT_EMPTY(op, "tensors", tensors);
  LAMP_CHECK_KERNEL_DEVICE(op, "tensors[0]", tensors[0]);
  const at::Device device = tensors[0].device();
  check_list(op, "tensors", tensors, device);
#ifdef WITH_CUDA
  if (device.is_cuda()) return cuda::multi_tensor_l2norm(tensors);
#endif
  return cpu::multi_tensor_l2norm(tensors);
}

}  // namespace
}  // namespace lamp

namespace {
at::ScalarType parse_wgrad_dtype(const std::string& name) {
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  TORCH_CHECK_VALUE(name == "float32", "dtype must be 'float32', 'float16' or 'bfloat16', got '", name, "'");
  return at::kFloat;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning-amp compiled core: fused wgrad GEMM, multi-tensor kernels, fused optimizers";
#ifdef WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif

  m.def("wgrad_gemm_accum_fp32", &lamp::wgrad_gemm_accum_fp32, "main_grad(fp32) += grad_output^T @ input",
        py::arg("input"), py::arg("grad_output"), py::arg("main_grad"));
  m.def("wgrad_gemm_accum_fp16", &lamp::wgrad_gemm_accum_fp16,
        "main_grad(fp16/bf16) += grad_output^T @ input, fp32 compute", py::arg("input"), py::arg("grad_output"),
        py::arg("main_grad"));
  m.def("multi_tensor_scale", &lamp::multi_tensor_scale,
        "dst[i] = src[i] * scale; sets found_inf to 1 on inf/nan in src; returns per-tensor flags (fp32 [n])",
        py::arg("src"), py::arg("dst"), py::arg("scale"), py::arg("found_inf"));
  m.def("multi_tensor_l2norm", &lamp::multi_tensor_l2norm, "(global L2 norm, per-tensor norms), fp32",
        py::arg("tensors"), py::arg("per_tensor") = false);
  m.def("multi_tensor_check_finite", &lamp::multi_tensor_check_finite,
        "sets found_inf to 1 if any tensor holds inf/nan; reads the tensors only", py::arg("tensors"),
        py::arg("found_inf"));

  // Introspection and test hooks (private).
  m.def("_wgrad_cpu_gemm_backend", [](const std::string& dtype) {
    return lamp::cpu::wgrad_cpu_gemm_backend(parse_wgrad_dtype(dtype));
  });
  m.def("_wgrad_cpu_gemm_paths", [](const std::string& dtype) {
    return lamp::cpu::wgrad_cpu_gemm_paths(parse_wgrad_dtype(dtype));
  });
  m.def("_wgrad_cpu_gemm_calibration", [](const std::string& dtype) {
    return lamp::cpu::wgrad_cpu_gemm_calibration(parse_wgrad_dtype(dtype));
  });
  m.def("_set_wgrad_cpu_gemm_policy", &lamp::cpu::set_wgrad_cpu_gemm_policy, py::arg("policy"));
  m.def("_set_wgrad_cpu_gemm_choice", [](const std::string& dtype, const std::string& path) {
    lamp::cpu::set_wgrad_cpu_gemm_choice(parse_wgrad_dtype(dtype), path);
  }, py::arg("dtype"), py::arg("path"));
  m.def("_wgrad_cpu_gemm_choice", [](const std::string& dtype) {
    return lamp::cpu::wgrad_cpu_gemm_choice(parse_wgrad_dtype(dtype));
  });
  m.def("_set_wgrad_k_chunk", &lamp::cpu::set_wgrad_k_chunk, py::arg("rows"));
  m.def("_wgrad_k_chunk", &lamp::cpu::wgrad_k_chunk);

  // O2's autocast policy (csrc/o2_policy.h). install() registers over torch's autocast kernels, which
  // warns once per process (routed to Python's warnings, where lightning_amp.ops filters it).
  m.def("o2_install", [](const std::string& mode) {
    HANDLE_TH_ERRORS
    lamp::o2::install(mode);
    END_HANDLE_TH_ERRORS_PYBIND
  }, py::arg("mode"));
  m.def("o2_uninstall", &lamp::o2::uninstall);
  m.def("o2_installs", &lamp::o2::installs);
  m.def("o2_enter_forward", &lamp::o2::enter_forward);
  m.def("o2_exit_forward", &lamp::o2::exit_forward);
  m.def("o2_active", &lamp::o2::active);
  m.def("o2_share_begin", &lamp::o2::share_begin);
  m.def("o2_share_join", &lamp::o2::share_join, py::arg("token"));
  m.def("o2_share_end", &lamp::o2::share_end);
  m.def("o2_table", &lamp::o2::table);
  // O2's stream forensics (amp/o2/stream_watch.py): `callback(op, operands)` is called once, the first time an
  // fp32 activation promotes a half one inside O2's forward; None disarms. A Python error it raises (a warning
  // turned into an error) propagates out of the op.
  m.def("o2_report_promotions", [](py::object callback) {
    static PyObject* current = nullptr;  // owned; replaced under the GIL; left alive at exit on purpose
    PyObject* previous = current;
    if (callback.is_none()) {
      current = nullptr;
      lamp::o2::set_promotion_reporter({});
    } else {
      current = callback.inc_ref().ptr();
      lamp::o2::set_promotion_reporter([](const std::string& op, const std::string& operands) {
        py::gil_scoped_acquire gil;
        if (current == nullptr) return;
        py::handle callback(current);
        callback(op, operands);
      });
    }
    Py_XDECREF(previous);
  }, py::arg("callback"));

  // ==== BEGIN fused-optimizer bindings (owned by the fused-optimizers helper) ====
  // Add the optimizer m.def(...) lines here.
  m.def("multi_tensor_adam", &lamp::multi_tensor_adam,
        "Adam/AdamW step over lists (in place; fp32 math; grad_scale divides grads; found_inf != 0 skips all)",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"),
        py::arg("steps"), py::arg("model_copies"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adam_w_mode"), py::arg("bias_correction"), py::arg("grad_scale"),
        py::arg("found_inf"));
  m.def("multi_tensor_sgd", &lamp::multi_tensor_sgd, "SGD step over lists (in place; torch.optim.SGD semantics)",
        py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"), py::arg("model_copies"), py::arg("lr"),
        py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"), py::arg("first_run"),
        py::arg("grad_scale"), py::arg("found_inf"));
  m.def("multi_tensor_adadelta", &lamp::multi_tensor_adadelta,
        "Adadelta step over lists (in place; torch.optim.Adadelta semantics)", py::arg("params"), py::arg("grads"),
        py::arg("square_avgs"), py::arg("acc_deltas"), py::arg("steps"), py::arg("model_copies"), py::arg("lr"),
        py::arg("rho"), py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"), py::arg("found_inf"));
  m.def("multi_tensor_lamb", &lamp::multi_tensor_lamb,
        "LAMB step over lists (in place; apex FusedLAMB semantics, global_grad_norm of the unscaled grads)",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("steps"),
        py::arg("model_copies"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("bias_correction"), py::arg("grad_averaging"), py::arg("adam_w_mode"),
        py::arg("global_grad_norm"), py::arg("max_grad_norm"), py::arg("use_nvlamb"), py::arg("grad_scale"),
        py::arg("found_inf"));
  m.def("multi_tensor_lamb_moments", &lamp::multi_tensor_lamb_moments,
        "LAMB pass 1 (moments); returns the fp64 [n, 2] squared norms (param, update) of each tensor",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("steps"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("bias_correction"),
        py::arg("grad_averaging"), py::arg("adam_w_mode"), py::arg("global_grad_norm"), py::arg("max_grad_norm"),
        py::arg("grad_scale"), py::arg("found_inf"));
  m.def("multi_tensor_lamb_apply", &lamp::multi_tensor_lamb_apply,
        "LAMB pass 2: apply the update with trust ratios from sq_norms (pass 1's, summed over shards)",
        py::arg("params"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("steps"), py::arg("model_copies"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("bias_correction"), py::arg("adam_w_mode"), py::arg("use_nvlamb"), py::arg("sq_norms"),
        py::arg("found_inf"));
  // ==== END fused-optimizer bindings ====
}
