"""Weight-gradient GEMM with accumulation (Megatron's gradient_accumulation_fusion).

The compiled kernels are the torch.library ops ``lightning_amp::wgrad_gemm_accum_fp32`` / ``_fp16``
(schema ``(Tensor input, Tensor grad_output, Tensor(a!) main_grad) -> ()``, see
:mod:`lightning_amp.ops._library`), which check their arguments in C++; the pure-PyTorch
fallback checks its own.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _ext
from ._ext import _c10_name, _check_dense, _check_float_like
from . import _library


def _check_wgrad_args(op: str, input: Tensor, grad_output: Tensor, main_grad: Tensor, main_dtypes) -> None:
    """The fallback's checks: those of the C++ entry points (csrc/bindings.cpp ``check_wgrad``), in
    their order and with their messages and exception types."""
    if not isinstance(input, Tensor) or not isinstance(grad_output, Tensor) or not isinstance(main_grad, Tensor):
        raise TypeError(f"{op}: input, grad_output and main_grad must be tensors")
    for name, t in (("input", input), ("grad_output", grad_output)):
        if t.device != main_grad.device:
            raise ValueError(f"{op}: {name} is on {t.device} but main_grad is on {main_grad.device} "
                             "(all tensors must share one device)")
    _check_dense(op, "main_grad", main_grad)
    _check_float_like(op, "input", input)
    _check_float_like(op, "grad_output", grad_output)
    if input.dtype != grad_output.dtype:
        raise TypeError(f"{op}: input ({_c10_name(input.dtype)}) and grad_output ({_c10_name(grad_output.dtype)}) "
                        "must share a dtype")
    if main_grad.dim() != 2:
        raise ValueError(f"{op}: main_grad must be 2-D [out, in], got shape {list(main_grad.shape)}")
    if input.dim() < 1 or grad_output.dim() < 1:
        raise ValueError(f"{op}: input and grad_output need at least 1 dim")
    if input.shape[:-1] != grad_output.shape[:-1]:
        raise ValueError(f"{op}: input [..., in] and grad_output [..., out] must share leading dims, got "
                         f"{list(input.shape)} and {list(grad_output.shape)}")
    if tuple(main_grad.shape) != (grad_output.shape[-1], input.shape[-1]):
        raise ValueError(f"{op}: main_grad shape {list(main_grad.shape)} != [out, in] = "
                         f"[{grad_output.shape[-1]}, {input.shape[-1]}]")
    if not main_grad.is_contiguous():
        raise ValueError(f"{op}: main_grad must be contiguous (got strides {list(main_grad.stride())})")
    if main_grad.dtype not in main_dtypes:
        if main_dtypes == (torch.float32,):
            raise TypeError(f"{op}: main_grad must be Float, got {_c10_name(main_grad.dtype)}")
        raise TypeError(f"{op}: main_grad must be float16 or bfloat16, got {_c10_name(main_grad.dtype)}")


def _mm_has_out_dtype() -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` takes 16-bit operands (a 16-bit GEMM
    with fp32 accumulation and an fp32 result; CUDA kernels only, probed on meta tensors)."""
    a = torch.empty(2, 2, dtype=torch.bfloat16, device="meta")
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


_MM_OUT_DTYPE = _mm_has_out_dtype()


def _product_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` as an fp32 tensor with fp32 accumulation and no rounding of the result to 16 bits.

    CUDA runs the 16-bit GEMM at its own speed (``out_dtype=torch.float32``); elsewhere the
    operands are upcast (exact) and multiplied in fp32.
    """
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _wgrad_fallback(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """Pure-PyTorch ``main_grad += grad_output^T @ input``: the fp32 product (a temporary of
    main_grad's size, see :func:`_product_fp32`), then one add computed in fp32, so a 16-bit
    main_grad is rounded once per element."""
    inp = input.reshape(-1, input.shape[-1])
    gout = grad_output.reshape(-1, grad_output.shape[-1])
    if inp.numel() == 0 or gout.numel() == 0:
        return
    main_grad.add_(_product_fp32(gout.t(), inp))


def wgrad_gemm_accum_fp32(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """``main_grad += grad_output[..., out]^T @ input[..., in]`` in place, fp32 accumulation.

    ``input`` and ``grad_output`` are fp32/fp16/bf16 with identical leading dims (flattened);
    ``main_grad`` is a contiguous fp32 ``[out, in]`` buffer.

    Backends: CUDA ``cublasGemmEx`` with beta = 1 into ``main_grad`` (CUBLAS_COMPUTE_32F).
    CPU: fp32 operands via ``addmm_`` (sgemm, beta = 1); 16-bit operands through one of three paths:
    ``onednn`` (oneDNN's micro-kernel inside torch, on AMX or AVX-512 BF16/FP16 units), ``mkl`` (MKL's
    ``cblas_gemm_bf16bf16f32`` / ``cblas_gemm_f16f16f32``) or ``aten`` (token blocks upcast to fp32,
    then ``addmm_``). All three sum exact products in fp32 with beta = 1 and differ only in the order of
    the sums, so every process of a machine takes the same one: the fastest, measured once per machine
    and cached beside the build (:mod:`._wgrad_choice`; the first 16-bit call of a machine takes about a
    second more), or a rule of the CPU where that cache can be neither read nor written.
    ``LIGHTNING_AMP_WGRAD_CPU_GEMM`` pins one, or ``fastest`` times them once per process.
    No path materialises the full product. The fallback (no extension) builds the fp32 product
    (on CUDA with the 16-bit GEMM, ``out_dtype=torch.float32``) and adds it.
    """
    if isinstance(main_grad, Tensor) and _ext._ext_for(main_grad.device) is not None:
        if main_grad.device.type == "cpu" and not torch.compiler.is_compiling():  # traced: the operator decides
            _ext._decide_wgrad_cpu_gemm(getattr(input, "dtype", None))
        _library.run("wgrad_gemm_accum_fp32", input, grad_output, main_grad)
    else:
        _check_wgrad_args("wgrad_gemm_accum_fp32", input, grad_output, main_grad, (torch.float32,))
        _wgrad_fallback(input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """As :func:`wgrad_gemm_accum_fp32` for a 16-bit ``main_grad`` (fp16/bf16), computed in fp32.

    Each element of ``main_grad`` is rounded once (the result is the 16-bit rounding of the
    fp32-accumulated sum): CPU and CUDA upcast row tiles of main_grad into an fp32 workspace
    (16 / 64 MiB at most), accumulate the GEMM into it with beta = 1 and round it back once;
    the fallback adds the fp32 product in one fp32 add.
    """
    if isinstance(main_grad, Tensor) and _ext._ext_for(main_grad.device) is not None:
        if main_grad.device.type == "cpu" and not torch.compiler.is_compiling():  # traced: the operator decides
            _ext._decide_wgrad_cpu_gemm(getattr(input, "dtype", None))
        _library.run("wgrad_gemm_accum_fp16", input, grad_output, main_grad)
    else:
        _check_wgrad_args("wgrad_gemm_accum_fp16", input, grad_output, main_grad, (torch.float16, torch.bfloat16))
        _wgrad_fallback(input, grad_output, main_grad)
