"""Grads that are not dense real tensors: sparse (``nn.Embedding(sparse=True)``) and complex.

``torch._amp_foreach_non_finite_check_and_unscale_`` and the fused kernels take dense real
floating tensors only. The other kinds stay out of the half and fused paths
(O2/O3 never cast complex tensors, the kernel step leaves such optimizers to their own
``step()``) but are checked for inf/nan and unscaled like every grad, so an overflow in them
still skips the step:

* a sparse COO grad through its values (``_values()``, a view of its storage); a 16-bit one that
  is not coalesced is also checked coalesced, since summing duplicate indices (what its optimizer
  does) can overflow although no single value does;
* a complex grad through ``torch.view_as_real`` (a real view of its storage).

Host cost on the common path (dense real grads only): a layout, an ``is_complex``, a device and a dtype
read per grad.

torch's CUDA kernel of the check-and-unscale takes float32 and float16 only (torch 2.11-2.14:
"not implemented for 'BFloat16'", and with mixed dtypes it may have unscaled some tensors before it
refuses one). bfloat16 grads on CUDA (O3 with a loss scale) are checked by
``ops.multi_tensor_check_finite`` and unscaled by one ``torch._foreach_mul_`` instead: the same flag
and values, one extra read of those grads.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from lightning_amp import ops

_HALF = (torch.float16, torch.bfloat16)


def is_dense_real(grad: Tensor) -> bool:
    """Whether ``grad`` is a strided real tensor (what the foreach and fused kernels take)."""
    return grad.layout == torch.strided and not grad.is_complex()


def real_values(grad: Tensor) -> Tensor:
    """A dense real tensor sharing ``grad``'s storage and holding all its stored numbers: a sparse
    COO grad's values, a complex grad viewed as (re, im) pairs, else ``grad`` itself."""
    if grad.layout == torch.sparse_coo:
        grad = grad._values()
    elif grad.layout != torch.strided:
        raise TypeError(f"lightning_amp: grads of layout {grad.layout} are not supported (strided or sparse_coo)")
    return torch.view_as_real(grad) if grad.is_complex() else grad


def check_and_unscale_(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``grads *= inv_scale`` in place and ``found_inf`` (0-dim fp32) set to 1.0 if any holds inf/nan,
    for grads of any kind on ``found_inf``'s device (see the module docstring); no host read."""
    grads = list(grads)
    if all(map(is_dense_real, grads)):
        _dense_check_and_unscale_(grads, found_inf, inv_scale)
        return
    others = [g for g in grads if not is_dense_real(g)]
    views = [g for g in grads if is_dense_real(g)] + [real_values(g) for g in others]
    _dense_check_and_unscale_(views, found_inf, inv_scale)
    summed = _coalesced_half_values(others)
    if summed:
        _dense_check_and_unscale_(summed, found_inf, torch.ones_like(inv_scale))


def torch_unscale_takes(t: Tensor) -> bool:
    """Whether torch's ``_amp_foreach_non_finite_check_and_unscale_`` has a kernel for ``t``'s device and
    dtype (its CUDA kernel has none for bfloat16)."""
    return not (t.is_cuda and t.dtype == torch.bfloat16)


def _dense_check_and_unscale_(tensors: List[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    theirs: List[Tensor] = []
    ours: List[Tensor] = []
    for t in tensors:  # one pass: this runs for every grad at every step
        (theirs if torch_unscale_takes(t) else ours).append(t)
    if theirs:
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_inf, inv_scale)
    if ours:
        ops.multi_tensor_check_finite(ours, found_inf)
        torch._foreach_mul_(ours, inv_scale)


def check_finite(grads: Sequence[Tensor], found_inf: Tensor) -> None:
    """``found_inf`` set to 1.0 if any grad holds inf/nan, the grads only read (kinds as
    :func:`check_and_unscale_`, which with an inverse scale of 1 gives the same flag but rewrites
    every grad in place: twice the memory traffic and, on the CPU, several times the time)."""
    grads = list(grads)
    views = [g if is_dense_real(g) else real_values(g) for g in grads] + _coalesced_half_values(grads)
    ops.multi_tensor_check_finite(views, found_inf)


def _coalesced_half_values(grads: Sequence[Tensor]) -> List[Tensor]:
    return [real_values(g.coalesce()) for g in grads
            if g.layout == torch.sparse_coo and g.dtype in _HALF and not g.is_coalesced()]
