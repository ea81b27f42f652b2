"""The compiled kernels of ``lightning_amp._C`` as torch.library operators ``torch.ops.lightning_amp.*``.

Each operator is a Python custom op (``torch.library.custom_op``) whose kernel calls the pybind11
entry point of the same name, which checks every argument in C++ (the only checks on this path).
The schemas declare what each op writes (``mutates_args``; the optimizer steps write their grads,
unscaled, when given a ``grad_scale``), so ``torch.compile`` functionalizes the calls instead of
breaking the graph, and ops that return tensors have fake kernels giving the
outputs' metadata. The operators exist whether or not the extension loaded; the public functions
in :mod:`lightning_amp.ops` call them only when :func:`~lightning_amp.ops.backend` names the
extension for the tensors' device (otherwise the pure-PyTorch fallbacks run, which
``torch.compile`` traces as they are).

Plain meta tensors (outside a fake-tensor mode) reach the fake kernels by dispatch; those hand the
call to the C++ entry point, which refuses them ("is on meta, but this build has kernels for ...").

No ``from __future__ import annotations`` here: ``custom_op`` reads the annotations as types.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _dtensor, _ext

_NS = "lightning_amp"


def _ext_module():
    ext = _ext._EXT
    if ext is None:
        raise RuntimeError(f"torch.ops.{_NS}: the compiled extension is not loaded ({_ext.extension_error()})")
    return ext


def _real_meta(tensors) -> bool:
    """True for real (not fake) meta tensors: an eager call on meta, not a trace."""
    from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC0415

    return any(isinstance(t, Tensor) and t.is_meta and not isinstance(t, FakeTensor) for t in tensors)


# -- weight-gradient GEMM ------------------------------------------------------------------------


def _cpu_path_decided(input: Tensor, main_grad: Tensor) -> None:
    """The machine's CPU GEMM path for 16-bit operands, decided before the kernel runs (here, at run time,
    for a compiled graph: ``ops.wgrad`` decides in eager code, which a trace does not run)."""
    if main_grad.device.type == "cpu":
        _ext._decide_wgrad_cpu_gemm(input.dtype)


@torch.library.custom_op(f"{_NS}::wgrad_gemm_accum_fp32", mutates_args=("main_grad",))
def wgrad_gemm_accum_fp32(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    _cpu_path_decided(input, main_grad)
    _ext_module().wgrad_gemm_accum_fp32(input, grad_output, main_grad)


@torch.library.custom_op(f"{_NS}::wgrad_gemm_accum_fp16", mutates_args=("main_grad",))
def wgrad_gemm_accum_fp16(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    _cpu_path_decided(input, main_grad)
    _ext_module().wgrad_gemm_accum_fp16(input, grad_output, main_grad)


# -- multi-tensor ops ----------------------------------------------------------------------------


@torch.library.custom_op(f"{_NS}::multi_tensor_scale", mutates_args=("dst", "found_inf"))
def multi_tensor_scale(src: List[Tensor], dst: List[Tensor], scale: float, found_inf: Tensor) -> Tensor:
    return _ext_module().multi_tensor_scale(src, dst, scale, found_inf)


@torch.library.custom_op(f"{_NS}::multi_tensor_check_finite", mutates_args=("found_inf",))
def multi_tensor_check_finite(tensors: List[Tensor], found_inf: Tensor) -> None:
    _ext_module().multi_tensor_check_finite(tensors, found_inf)


@torch.library.custom_op(f"{_NS}::multi_tensor_l2norm", mutates_args=())
def multi_tensor_l2norm(tensors: List[Tensor], per_tensor: bool) -> Tuple[Tensor, Tensor]:
    total, each = _ext_module().multi_tensor_l2norm(tensors, per_tensor)
    return total, each


# -- fused optimizer steps -----------------------------------------------------------------------


@torch.library.custom_op(f"{_NS}::multi_tensor_adam",
                         mutates_args=("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps",
                                       "model_copies"))
def multi_tensor_adam(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                      max_exp_avg_sqs: List[Tensor], steps: List[Tensor], model_copies: List[Tensor], lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float, adam_w_mode: bool,
                      bias_correction: bool, grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    _ext_module().multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, model_copies, lr,
                                    beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_scale,
                                    found_inf)


@torch.library.custom_op(f"{_NS}::multi_tensor_sgd",
                         mutates_args=("params", "grads", "momentum_buffers", "model_copies"))
def multi_tensor_sgd(params: List[Tensor], grads: List[Tensor], momentum_buffers: List[Tensor],
                     model_copies: List[Tensor], lr: float, momentum: float, dampening: float, weight_decay: float,
                     nesterov: bool, first_run: bool, grad_scale: Optional[Tensor],
                     found_inf: Optional[Tensor]) -> None:
    _ext_module().multi_tensor_sgd(params, grads, momentum_buffers, model_copies, lr, momentum, dampening,
                                   weight_decay, nesterov, first_run, grad_scale, found_inf)


@torch.library.custom_op(f"{_NS}::multi_tensor_adadelta",
                         mutates_args=("params", "grads", "square_avgs", "acc_deltas", "steps", "model_copies"))
def multi_tensor_adadelta(params: List[Tensor], grads: List[Tensor], square_avgs: List[Tensor],
                          acc_deltas: List[Tensor], steps: List[Tensor], model_copies: List[Tensor], lr: float,
                          rho: float, eps: float, weight_decay: float, grad_scale: Optional[Tensor],
                          found_inf: Optional[Tensor]) -> None:
    _ext_module().multi_tensor_adadelta(params, grads, square_avgs, acc_deltas, steps, model_copies, lr, rho, eps,
                                        weight_decay, grad_scale, found_inf)


@torch.library.custom_op(f"{_NS}::multi_tensor_lamb",
                         mutates_args=("params", "grads", "exp_avgs", "exp_avg_sqs", "steps", "model_copies"))
def multi_tensor_lamb(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                      steps: List[Tensor], model_copies: List[Tensor], lr: float, beta1: float, beta2: float,
                      eps: float, weight_decay: float, bias_correction: bool, grad_averaging: bool,
                      adam_w_mode: bool, global_grad_norm: Tensor, max_grad_norm: float, use_nvlamb: bool,
                      grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    _ext_module().multi_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, model_copies, lr, beta1, beta2, eps,
                                    weight_decay, bias_correction, grad_averaging, adam_w_mode, global_grad_norm,
                                    max_grad_norm, use_nvlamb, grad_scale, found_inf)


@torch.library.custom_op(f"{_NS}::multi_tensor_lamb_moments", mutates_args=("grads", "exp_avgs", "exp_avg_sqs"))
def multi_tensor_lamb_moments(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                              exp_avg_sqs: List[Tensor], steps: List[Tensor], beta1: float, beta2: float, eps: float,
                              weight_decay: float, bias_correction: bool, grad_averaging: bool, adam_w_mode: bool,
                              global_grad_norm: Tensor, max_grad_norm: float, grad_scale: Optional[Tensor],
                              found_inf: Optional[Tensor]) -> Tensor:
    return _ext_module().multi_tensor_lamb_moments(params, grads, exp_avgs, exp_avg_sqs, steps, beta1, beta2, eps,
                                                   weight_decay, bias_correction, grad_averaging, adam_w_mode,
                                                   global_grad_norm, max_grad_norm, grad_scale, found_inf)


@torch.library.custom_op(f"{_NS}::multi_tensor_lamb_apply", mutates_args=("params", "steps", "model_copies"))
def multi_tensor_lamb_apply(params: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                            steps: List[Tensor], model_copies: List[Tensor], lr: float, beta1: float, beta2: float,
                            eps: float, weight_decay: float, bias_correction: bool, adam_w_mode: bool,
                            use_nvlamb: bool, sq_norms: Tensor, found_inf: Optional[Tensor]) -> None:
    _ext_module().multi_tensor_lamb_apply(params, exp_avgs, exp_avg_sqs, steps, model_copies, lr, beta1, beta2, eps,
                                          weight_decay, bias_correction, adam_w_mode, use_nvlamb, sq_norms, found_inf)


# -- fake kernels ----------------------------------------------------------------------------------
#
# Every op gets one: under a trace (fake tensors) it gives the outputs' metadata (nothing for the
# in-place ops); on real meta tensors (an eager call, which dispatch sends here) it hands the call to
# the C++ entry point, which refuses them with its usual message.


def _tensors(args):
    for a in args:
        if isinstance(a, Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, Tensor))


def _no_output(*args):
    return None


_FAKE_OUTPUTS = {
    "multi_tensor_scale": lambda src, *rest: src[0].new_empty((len(src),), dtype=torch.float32),
    "multi_tensor_l2norm": lambda tensors, per_tensor: (tensors[0].new_empty((), dtype=torch.float32),
                                                        tensors[0].new_empty((len(tensors),), dtype=torch.float32)),
    "multi_tensor_lamb_moments": lambda params, *rest: params[0].new_empty((len(params), 2), dtype=torch.float64),
}


def _register_fake(op) -> None:
    name = op._name.split("::")[-1]
    output = _FAKE_OUTPUTS.get(name, _no_output)

    def fake(*args):
        if _real_meta(list(_tensors(args))):
            return getattr(_ext_module(), name)(*args)  # raises: this build has no kernels for meta
        return output(*args)

    op.register_fake(fake)


for _op in (wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16, multi_tensor_scale, multi_tensor_check_finite,
            multi_tensor_l2norm, multi_tensor_adam, multi_tensor_sgd, multi_tensor_adadelta, multi_tensor_lamb,
            multi_tensor_lamb_moments, multi_tensor_lamb_apply):
    _register_fake(_op)


#: the registered operators, ``torch.ops.lightning_amp``
lamp = getattr(torch.ops, _NS)

#: whether DTensor arguments go through DTensor's dispatch (:mod:`._dtensor`: strategies registered)
_DTENSOR_DISPATCH = _dtensor.register(lamp)


def run(name: str, *args):
    """Call kernel ``name``: through its operator ``torch.ops.lightning_amp.<name>`` under a trace
    (``torch.compile``, export, or any active dispatch mode such as a fake-tensor mode) or when the first
    argument is (or its first element is) a DTensor (DTensor's dispatch runs the op on the local shards,
    :mod:`._dtensor`), else straight into the C++ entry point. Both check the arguments in C++; the eager
    shortcut skips the Python of a custom op's dispatch, which a fused optimizer step would pay once per
    (group, device, dtype)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0 or is_dtensor(args[0]):
        return getattr(lamp, name)(*args)
    return getattr(_ext_module(), name)(*args)


def is_dtensor(first) -> bool:
    """Whether ``first`` (an op's first argument: a tensor or a list of them) is, or starts with, a DTensor:
    one isinstance check (the lists of one call share their kind; DTensor refuses a mix)."""
    if not _DTENSOR_DISPATCH:
        return False
    if isinstance(first, (list, tuple)):
        return len(first) > 0 and isinstance(first[0], _dtensor.DTensor)
    return isinstance(first, _dtensor.DTensor)
