"""Multi-tensor ops (apex's multi_tensor_apply family): scale with overflow check, read-only finite
check, L2 norms.

The compiled kernels are the torch.library ops ``lightning_amp::multi_tensor_*``
(:mod:`lightning_amp.ops._library`), which check their arguments in C++. Tensors the kernels do not
take (float64, non-contiguous) are routed to the pure-PyTorch fallbacks, which check their own.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _ext
from ._ext import _c10_name, _check_dense, _ext_accepts
from . import _choice, _library


def _new_flag(tensors: Sequence[Tensor], device=None) -> Tensor:
    dev = device if device is not None else (tensors[0].device if len(tensors) else "cpu")
    return torch.zeros((), dtype=torch.float32, device=dev)


def _check_list(op: str, name: str, tensors: Sequence[Tensor], device: torch.device) -> None:
    """As csrc/bindings.cpp ``check_list``, for the fallback's wider input: on ``device``, dense, floating
    (float64 too, and any strides: the fallback serves what the kernels do not take)."""
    for i, t in enumerate(tensors):
        what = f"{name}[{i}]"
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {what} is not a tensor")
        if t.device != device:
            raise ValueError(f"{op}: {what} is on {t.device} but the first tensor is on {device} "
                             "(all tensors must share one device)")
        _check_dense(op, what, t)
        if not t.is_floating_point():
            raise TypeError(f"{op}: {what} must be floating point, got {_c10_name(t.dtype)}")


def _check_scale_args(src: Sequence[Tensor], dst: Sequence[Tensor]) -> None:
    """The fallback's checks, in the order of the C++ entry point's."""
    op = "multi_tensor_scale"
    if len(src) != len(dst):
        raise ValueError(f"{op}: src and dst must have equal length, got {len(src)} and {len(dst)}")
    if not src:
        return
    _check_list(op, "src", src, src[0].device)
    _check_list(op, "dst", dst, src[0].device)
    for i, (a, b) in enumerate(zip(src, dst)):
        if a.shape != b.shape:
            raise ValueError(f"{op}: src[{i}] shape {list(a.shape)} != dst[{i}] shape {list(b.shape)}")


def multi_tensor_scale(
    src: Sequence[Tensor], dst: Sequence[Tensor], scale: float, per_tensor: bool = False
) -> tuple[Tensor, Optional[Tensor]]:
    """``dst[i] = src[i] * scale`` (dtypes may differ, e.g. fp16 grads into fp32 masters' grads).

    Returns ``(found_inf, per_tensor_flags)``: ``found_inf`` is 1.0 if any element of any
    ``src`` is inf/nan; ``per_tensor_flags`` (float32 ``[len(src)]``, only when ``per_tensor``)
    marks which tensors held non-finite values. ``dst`` may alias ``src`` (in-place unscale).
    """
    if src and _ext._ext_for(src[0].device) is not None and _ext_accepts(src) and _ext_accepts(dst):
        found_inf = _new_flag(src)
        flags = _library.run("multi_tensor_scale", list(src), list(dst), float(scale), found_inf)
        return found_inf, (flags if per_tensor else None)
    _check_scale_args(src, dst)
    found_inf = _new_flag(src)
    if not src:
        return found_inf, (torch.zeros(0) if per_tensor else None)
    flags = _scale_fallback(src, dst, scale, found_inf)
    return found_inf, (flags if per_tensor else None)


def _scale_fallback(src: Sequence[Tensor], dst: Sequence[Tensor], scale: float, found_inf: Tensor) -> Tensor:
    """Pure-PyTorch multi_tensor_scale: returns the per-tensor flags, ORs them into found_inf."""
    flags = torch.stack([(~torch.isfinite(s)).any() for s in src]).float()
    found_inf.copy_(torch.maximum(found_inf, flags.max().to(found_inf.device)))
    for s, d in zip(src, dst):
        d.copy_(s.float().mul(scale) if s.dtype != d.dtype else s.mul(scale))
    return flags


def _check_finite_args(tensors: Sequence[Tensor], found_inf: Tensor) -> None:
    """The fallback's checks (the compiled op checks the same in C++)."""
    for i, t in enumerate(tensors):
        _check_dense("multi_tensor_check_finite", f"tensors[{i}]", t)
        if not t.is_floating_point():
            raise TypeError(f"multi_tensor_check_finite: tensors[{i}] must be floating point, got {_c10_name(t.dtype)}")
        if t.device != found_inf.device:
            raise ValueError(f"multi_tensor_check_finite: tensors[{i}] is on {t.device} but found_inf is on "
                             f"{found_inf.device}")
    if found_inf.dtype != torch.float32:
        raise TypeError(f"multi_tensor_check_finite: found_inf must be Float, got {_c10_name(found_inf.dtype)}")
    if found_inf.numel() != 1:
        raise ValueError("multi_tensor_check_finite: found_inf must hold one element, got shape "
                         f"{list(found_inf.shape)}")


def multi_tensor_check_finite(tensors: Sequence[Tensor], found_inf: Tensor) -> Tensor:
    """Set ``found_inf`` (0-dim float32, on the tensors' device) to 1.0 if any element of ``tensors``
    (dense, floating) is inf or nan, reading them only; it is never cleared. Returns ``found_inf``.

    The check before a step that unscales inside its own kernel: ``torch._amp_foreach_non_finite_check_and_unscale_``
    with an inverse scale of 1 gives the same flag but writes every tensor back (and has no CUDA kernel
    for bfloat16); here one read-only pass over every dtype, on the CPU and on CUDA."""
    if isinstance(found_inf, Tensor) and _ext._ext_for(found_inf.device) is not None and _ext_accepts(tensors):
        live = [t for t in tensors if t.numel()]
        if live:
            _library.run("multi_tensor_check_finite", live, found_inf)
            return found_inf
    _check_finite_args(tensors, found_inf)
    tensors = [t for t in tensors if t.numel()]
    if tensors:
        _check_finite_fallback(tensors, found_inf)
    return found_inf


def _check_finite_fallback(tensors: Sequence[Tensor], found_inf: Tensor) -> None:
    """Pure-PyTorch multi_tensor_check_finite (no host read)."""
    bad = torch.stack([(~torch.isfinite(t)).any() for t in tensors]).any().float()
    torch.maximum(found_inf, bad.reshape(found_inf.shape), out=found_inf)


def multi_tensor_l2norm(tensors: Sequence[Tensor], per_tensor: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Global L2 norm (fp32, 0-dim) of all ``tensors`` (dense, floating) and, if ``per_tensor``, each one's norm."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32), (torch.zeros(0) if per_tensor else None)
    if _ext._ext_for(tensors[0].device) is not None and _ext_accepts(tensors):
        device = tensors[0].device
        if (_choice.prefers_torch("l2norm", device, tensors[0].dtype) and not _library.is_dtensor(tensors)
                and all(t.device == device for t in tensors)):  # else the kernel's checks name the stray one
            total, each = _torch_l2norm(tensors)
        else:
            total, each = _library.run("multi_tensor_l2norm", list(tensors), bool(per_tensor))
    else:
        total, each = _l2norm_fallback(tensors)
    return total, (each if per_tensor else None)


def _torch_l2norm(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """torch's ``_foreach_norm`` (fp32 results, also of 16-bit tensors) and the norm of those norms: the
    kernels' (global, per-tensor) pair, for tensors the kernels take (checked by the caller)."""
    each = torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float32))
    return torch.linalg.vector_norm(each), each


def _l2norm_fallback(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Pure-PyTorch multi_tensor_l2norm: (global norm, per-tensor norms), fp32, accumulated in float64 as the
    kernels accumulate (torch's fp32 reduction is off by ~1e-5 on a 1M-element tensor). Checks what the kernels
    refuse."""
    _check_list("multi_tensor_l2norm", "tensors", tensors, tensors[0].device)
    each = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors])
    return torch.linalg.vector_norm(each).float(), each.float()
