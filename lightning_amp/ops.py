"""The one door to the compiled core ``lightning_amp._C``.

Every op here dispatches to the compiled extension when it is built for the tensors'
device and falls back to a pure-PyTorch implementation otherwise (one warning, never an
ImportError). ``LIGHTNING_AMP_DISABLE_EXT=1`` forces the fallback everywhere, so tests can
compare both paths. ``backend(device)`` tells which one is in use.

Conventions shared by all ops:

* ``found_inf`` is a 0-dim float32 tensor on the tensors' device: 0.0 when every value
  seen was finite, 1.0 otherwise. Ops that *produce* it overwrite nothing else on overflow
  that the caller would need to roll back; ops that *consume* it leave every output
  untouched when it is non-zero.
* ``grad_scale`` is the loss scale the gradients were multiplied by (the op divides by it).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence

import torch
from torch import Tensor

_EXT = None
_EXT_ERROR: Optional[str] = None


def _load_extension():
    global _EXT, _EXT_ERROR
    if os.environ.get("LIGHTNING_AMP_DISABLE_EXT") == "1":
        _EXT_ERROR = "disabled by LIGHTNING_AMP_DISABLE_EXT=1"
        return
    try:
        from lightning_amp import _C  # noqa: PLC0415  (compiled extension)

        _EXT = _C
    except ImportError as err:  # the package must keep working without the build
        _EXT_ERROR = str(err)
        warnings.warn(
            f"lightning_amp: compiled extension unavailable ({err}); using the pure-PyTorch fallback ops. "
            "Reinstall with `make install` to build it.",
            RuntimeWarning,
            stacklevel=3,
        )


_load_extension()


def extension_error() -> Optional[str]:
    """Why the compiled extension is not in use, or None when it is loaded."""
    return _EXT_ERROR


def _ext_for(device: torch.device | str):
    """The extension module if it has kernels for ``device``, else None."""
    if _EXT is None:
        return None
    kind = torch.device(device).type
    if kind == "cpu":
        return _EXT
    if kind == "cuda" and getattr(_EXT, "WITH_CUDA", False):
        return _EXT
    return None


def backend(device: torch.device | str = "cpu") -> str:
    """Which implementation serves ``device``: ``"cpu-ext"``, ``"cuda-ext"`` or ``"torch"``."""
    kind = torch.device(device).type
    return f"{kind}-ext" if _ext_for(device) is not None else "torch"


# --------------------------------------------------------------------------------------
# Weight-gradient GEMM with accumulation (Megatron gradient_accumulation_fusion)
# --------------------------------------------------------------------------------------


def _check_wgrad_args(input: Tensor, grad_output: Tensor, main_grad: Tensor, main_dtypes) -> None:
    if not isinstance(input, Tensor) or not isinstance(grad_output, Tensor) or not isinstance(main_grad, Tensor):
        raise TypeError("wgrad_gemm_accum: input, grad_output and main_grad must be tensors")
    floating = (torch.float32, torch.float16, torch.bfloat16)
    if input.dtype not in floating or grad_output.dtype not in floating:
        raise TypeError(
            f"wgrad_gemm_accum: input and grad_output must be float32/float16/bfloat16, "
            f"got input={input.dtype}, grad_output={grad_output.dtype}"
        )
    if input.dtype != grad_output.dtype:
        raise TypeError(f"wgrad_gemm_accum: input ({input.dtype}) and grad_output ({grad_output.dtype}) must share a dtype")
    if main_grad.dtype not in main_dtypes:
        raise TypeError(f"wgrad_gemm_accum: main_grad must be {' or '.join(map(str, main_dtypes))}, got {main_grad.dtype}")
    if not (input.device == grad_output.device == main_grad.device):
        raise ValueError(
            f"wgrad_gemm_accum: all tensors must be on one device, got input={input.device}, "
            f"grad_output={grad_output.device}, main_grad={main_grad.device}"
        )
    if main_grad.dim() != 2:
        raise ValueError(f"wgrad_gemm_accum: main_grad must be 2-D [out, in], got shape {tuple(main_grad.shape)}")
    if input.dim() < 1 or grad_output.dim() < 1 or input.shape[:-1] != grad_output.shape[:-1]:
        raise ValueError(
            f"wgrad_gemm_accum: input [..., in] and grad_output [..., out] must share leading dims, "
            f"got {tuple(input.shape)} and {tuple(grad_output.shape)}"
        )
    if tuple(main_grad.shape) != (grad_output.shape[-1], input.shape[-1]):
        raise ValueError(
            f"wgrad_gemm_accum: main_grad shape {tuple(main_grad.shape)} != [out, in] = "
            f"{(grad_output.shape[-1], input.shape[-1])}"
        )
    if not main_grad.is_contiguous():
        raise ValueError("wgrad_gemm_accum: main_grad must be contiguous (it is accumulated in place)")


def _wgrad_fallback(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    inp = input.reshape(-1, input.shape[-1])
    gout = grad_output.reshape(-1, grad_output.shape[-1])
    if inp.numel() == 0:
        return
    # fp32 math: half operands are upcast so the sum is accumulated in fp32.
    main_grad.add_((gout.float().t() @ inp.float()).to(main_grad.dtype))


def wgrad_gemm_accum_fp32(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """``main_grad += grad_output[..., out]^T @ input[..., in]`` in place, fp32 accumulation.

    ``input`` and ``grad_output`` are fp32/fp16/bf16 with identical leading dims (flattened);
    ``main_grad`` is a contiguous fp32 ``[out, in]`` buffer.
    """
    _check_wgrad_args(input, grad_output, main_grad, (torch.float32,))
    ext = _ext_for(main_grad.device)
    if ext is not None and hasattr(ext, "wgrad_gemm_accum_fp32"):
        ext.wgrad_gemm_accum_fp32(input.contiguous(), grad_output.contiguous(), main_grad)
    else:
        _wgrad_fallback(input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """As :func:`wgrad_gemm_accum_fp32` for a 16-bit ``main_grad`` (fp16/bf16), computed in fp32."""
    _check_wgrad_args(input, grad_output, main_grad, (torch.float16, torch.bfloat16))
    ext = _ext_for(main_grad.device)
    if ext is not None and hasattr(ext, "wgrad_gemm_accum_fp16"):
        ext.wgrad_gemm_accum_fp16(input.contiguous(), grad_output.contiguous(), main_grad)
    else:
        _wgrad_fallback(input, grad_output, main_grad)


# --------------------------------------------------------------------------------------
# Multi-tensor ops
# --------------------------------------------------------------------------------------


def _new_flag(tensors: Sequence[Tensor], device=None) -> Tensor:
    dev = device if device is not None else (tensors[0].device if len(tensors) else "cpu")
    return torch.zeros((), dtype=torch.float32, device=dev)


def multi_tensor_scale(
    src: Sequence[Tensor], dst: Sequence[Tensor], scale: float, per_tensor: bool = False
) -> tuple[Tensor, Optional[Tensor]]:
    """``dst[i] = src[i] * scale`` (dtypes may differ, e.g. fp16 grads into fp32 masters' grads).

    Returns ``(found_inf, per_tensor_flags)``: ``found_inf`` is 1.0 if any element of any
    ``src`` is inf/nan; ``per_tensor_flags`` (float32 ``[len(src)]``, only when ``per_tensor``)
    marks which tensors held non-finite values. ``dst`` may alias ``src`` (in-place unscale).
    """
    if len(src) != len(dst):
        raise ValueError(f"multi_tensor_scale: src and dst must have equal length, got {len(src)} and {len(dst)}")
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.shape != d.shape or s.device != d.device:
            raise ValueError(
                f"multi_tensor_scale: tensor {i}: src {tuple(s.shape)}@{s.device} != dst {tuple(d.shape)}@{d.device}"
            )
    found_inf = _new_flag(src)
    if not src:
        return found_inf, (torch.zeros(0) if per_tensor else None)
    ext = _ext_for(src[0].device)
    if ext is not None and hasattr(ext, "multi_tensor_scale"):
        flags = ext.multi_tensor_scale(list(src), list(dst), float(scale), found_inf)
        return found_inf, (flags if per_tensor else None)
    flags = torch.stack([(~torch.isfinite(s)).any() for s in src]).float()
    found_inf.copy_(flags.max())
    for s, d in zip(src, dst):
        d.copy_(s.float().mul(scale) if s.dtype != d.dtype else s.mul(scale))
    return found_inf, (flags if per_tensor else None)


def multi_tensor_l2norm(tensors: Sequence[Tensor], per_tensor: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Global L2 norm (fp32, 0-dim) of all ``tensors`` and, if ``per_tensor``, each one's norm."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32), (torch.zeros(0) if per_tensor else None)
    ext = _ext_for(tensors[0].device)
    if ext is not None and hasattr(ext, "multi_tensor_l2norm"):
        total, each = ext.multi_tensor_l2norm(list(tensors), per_tensor)
        return total, (each if per_tensor else None)
    each = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    return torch.linalg.vector_norm(each), (each if per_tensor else None)
