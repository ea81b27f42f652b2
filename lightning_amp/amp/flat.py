"""FlatGradBuffer: every param's ``.grad`` as a view into one flat buffer per (device, dtype).

Contract
--------
* ``FlatGradBuffer(params)`` allocates, for each (device, dtype) among the params that require
  grad, one contiguous zero buffer holding all their gradients back to back (in the order
  given), and sets each ``p.grad`` to a view of its slice. Autograd then accumulates into
  those views in place, so after ``backward()`` the buffers hold every gradient.
* The views must stay attached: clear gradients with :meth:`zero_` (or the fused optimizers'
  ``zero_grad``, which zero in place when given this buffer), never by setting ``p.grad = None``.
  If something replaced a ``p.grad`` anyway, :meth:`rebind` copies its values into the slice
  and re-attaches the view; :meth:`views_intact` tells whether that is needed.
* Whole-buffer ops are single calls over ``len(buffers)`` tensors: :meth:`unscale_` (multiply by
  ``1/scale`` and detect inf/nan) and :meth:`norm` (global L2 norm, fp32).
* Memory: one extra allocation per (device, dtype); the per-param grads cost nothing more.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from lightning_amp import ops


class FlatGradBuffer:
    """Flat gradient storage for ``params`` (see the module docstring for the contract)."""

    def __init__(self, params: Iterable[Tensor]):
        params = [p for p in params]
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(f"FlatGradBuffer: params[{i}] is {type(p).__name__}, expected a tensor")
        seen: set = set()
        self.params: list = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                if not p.is_floating_point():
                    raise TypeError(f"FlatGradBuffer: params must be floating point, got {p.dtype}")
                seen.add(id(p))
                self.params.append(p)
        sizes: dict = {}
        for p in self.params:
            key = (p.device, p.dtype)
            sizes[key] = sizes.get(key, 0) + p.numel()
        #: one contiguous gradient buffer per (device, dtype)
        self.buffers: dict = {key: torch.zeros(n, dtype=key[1], device=key[0]) for key, n in sizes.items()}
        self._slices: list = []
        offsets = {key: 0 for key in sizes}
        for p in self.params:
            key = (p.device, p.dtype)
            start = offsets[key]
            offsets[key] = start + p.numel()
            self._slices.append((key, start, p.numel()))
        self.rebind()

    def _view(self, i: int) -> Tensor:
        key, start, n = self._slices[i]
        return self.buffers[key][start:start + n].view(self.params[i].shape)

    def views_intact(self) -> bool:
        """True when every param's ``.grad`` is still its view into the flat buffer."""
        return all(
            p.grad is not None and p.grad.data_ptr() == self._view(i).data_ptr() and p.grad.shape == p.shape
            for i, p in enumerate(self.params)
        )

    @torch.no_grad()
    def rebind(self) -> None:
        """(Re-)attach every ``p.grad`` as a view, keeping values a replaced ``p.grad`` held."""
        for i, p in enumerate(self.params):
            view = self._view(i)
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            elif p.grad is None:
                view.zero_()
            p.grad = view

    @torch.no_grad()
    def zero_(self) -> None:
        """Zero all gradients in place (one fill per buffer), re-attaching views if needed."""
        if not self.views_intact():
            for p in self.params:
                p.grad = None
            self.rebind()
        for buf in self.buffers.values():
            buf.zero_()

    def unscale_(self, scale: float) -> Tensor:
        """Divide all gradients by ``scale`` in one call per buffer; returns ``found_inf``
        (0-dim fp32, 1.0 if any gradient was inf/nan) on the first buffer's device."""
        flags = []
        for buf in self.buffers.values():
            found, _ = ops.multi_tensor_scale([buf], [buf], 1.0 / scale)
            flags.append(found)
        if not flags:
            return torch.zeros((), dtype=torch.float32)
        home = flags[0].device
        return torch.stack([f.to(home) for f in flags]).amax()

    def norm(self) -> Tensor:
        """Global L2 norm (0-dim fp32) of all gradients, computed over the flat buffers."""
        norms = [ops.multi_tensor_l2norm([buf])[0] for buf in self.buffers.values()]
        if not norms:
            return torch.zeros((), dtype=torch.float32)
        home = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(home).float().reshape(()) for n in norms]))

    def __contains__(self, param: Tensor) -> bool:
        return any(param is p for p in self.params)
