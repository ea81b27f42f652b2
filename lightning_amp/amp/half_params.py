"""O2's one set of params: the module's Parameters are fp32, its forward sees half copies.

Contract (see docs/o2-design.md for why):

* :func:`prepare_o2_module_` leaves every floating *Parameter* fp32 (a half one is upcast in
  place, the Parameter object survives) and casts the floating *buffers* of every module to the
  half dtype, except BatchNorm, which stays fp32 with the input/output hooks of
  :func:`~lightning_amp.amp.module_cast.cast_module_`. The optimizer, checkpoints, callbacks,
  ``requires_grad`` and ``p.grad`` therefore all meet the module's own fp32 Parameters.
* :class:`HalfParams` is entered around every forward (the plugin's ``forward_context``): each fp32
  Parameter of a module other than a kept-fp32 BatchNorm or a sparse-grad embedding
  (``nn.Embedding(sparse=True)``: autograd cannot cast its sparse grad back) is cast to half once (``param.to(dtype)``, an autograd op)
  and the copy is put into the owning module instance's ``__dict__`` under the param's name, which
  shadows ``_parameters`` for attribute access (``nn.Module.__getattr__`` only runs when normal
  lookup fails). A param shared by several modules (tied embeddings) gets one copy; a parent that
  reads a child's weight sees the copy too. On exit (also on error) the copies are removed, so
  outside forward ``module.weight`` is the Parameter again. The cast's backward hands the grad back
  in fp32 and AccumulateGrad adds it into ``param.grad``: accumulation is fp32, DDP's hooks fire on
  the Parameters, and any write to a Parameter (callback, ``load_state_dict``, SWA) is what the next
  forward copies — there is no second copy to keep in sync.
* Entering while already entered (a nested forward context) is a no-op; the copies of the outer
  entry stay until it exits. Manual optimization steps inside ``training_step`` (inside the
  block): :meth:`HalfParams.refresh` (called by the plugin after each optimizer step) copies the
  stepped params again, so the next forward of the same ``training_step`` sees them; a global
  forward pre-hook (active only inside the block) recasts, before a module's forward, the copy of
  any of its params written since (version counter) or whose ``requires_grad`` changed
  (``toggle_optimizer`` inside ``training_step``). A write to a param *through the attribute*
  inside the block (``self.weight.copy_(...)`` in ``training_step``) lands on the half copy, not on
  the Parameter; write through ``self.parameters()`` there.

Host cost: one cast and one dict write per param per forward. Memory: the half copies live only
while autograd keeps them for backward (no persistent half weights).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from lightning_amp.amp.module_cast import cast_module_, modules_outside_metrics


@torch.no_grad()
def prepare_o2_module_(module: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> nn.Module:
    """Params fp32, buffers ``dtype`` (BatchNorm fp32 with its hooks when kept); in place, returns ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"prepare_o2_module_: `module` must be a torch.nn.Module, got {type(module).__name__}")
    for sub in modules_outside_metrics(module):
        if keep_batchnorm_fp32 and isinstance(sub, _BatchNorm):
            cast_module_(sub, dtype, keep_batchnorm_fp32=True)
            continue
        for param in sub._parameters.values():
            if param is not None and param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.float()
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                sub._buffers[name] = buffer.to(dtype)
    return module


class HalfParams:
    """Half copies of ``module``'s fp32 params during forward (see the module docstring).

    Args:
        module: the model (its Parameters are fp32).
        dtype: the half dtype of the copies.
        keep_batchnorm_fp32: BatchNorm modules keep reading their fp32 Parameters.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
        self.module, self.dtype, self.keep_batchnorm_fp32 = module, dtype, keep_batchnorm_fp32
        self._slots: List[Tuple[nn.Module, str]] = []
        self._count = -1
        self._holders: Dict[Tensor, Tuple[int, List[Tuple[nn.Module, str]]]] = {}  # param -> (version, slots)
        self._hook: Optional[RemovableHandle] = None
        self._depth = 0

    def _reads_fp32(self, sub: nn.Module) -> bool:
        """Modules forward leaves on their fp32 Parameters: BatchNorm when kept fp32, and embeddings
        with sparse grads (autograd cannot cast a sparse grad back through the half copy)."""
        if self.keep_batchnorm_fp32 and isinstance(sub, _BatchNorm):
            return True
        return isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and bool(sub.sparse)

    def _slots_now(self) -> List[Tuple[nn.Module, str]]:
        """(module, param name) of every param slot, rebuilt when the number of modules changes."""
        subs = list(self.module.modules())
        if len(subs) == self._count:
            return self._slots
        self._count = len(subs)
        self._slots = [(sub, name) for sub in subs if not self._reads_fp32(sub) for name in sub._parameters]
        return self._slots

    def __enter__(self) -> "HalfParams":
        self._depth += 1
        if self._depth == 1:
            try:
                self._install()
                self._hook = register_module_forward_pre_hook(self._pre_forward)
            except BaseException:
                self._depth -= 1
                self._remove()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._remove()

    def _install(self) -> None:
        holders = self._holders
        for sub, name in self._slots_now():
            param = sub._parameters.get(name)
            if param is None or param.dtype != torch.float32:
                continue
            held = holders.get(param)
            if held is None:
                held = holders[param] = (param._version, [])
                sub.__dict__[name] = param.to(self.dtype)
            else:
                sub.__dict__[name] = held[1][0][0].__dict__[held[1][0][1]]
            held[1].append((sub, name))

    def _recast(self, param: Tensor) -> None:
        _, slots = self._holders[param]
        half = param.to(self.dtype)
        for sub, name in slots:
            sub.__dict__[name] = half
        self._holders[param] = (param._version, slots)

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        """Before each module's forward inside the block: recast a copy whose param was written since
        (version counter) or whose ``requires_grad`` changed (``toggle_optimizer``, freezing)."""
        params = module._parameters
        if not params:
            return
        grad_on = torch.is_grad_enabled()
        for name, param in params.items():
            held = self._holders.get(param) if param is not None else None
            if held is None:
                continue
            half = module.__dict__.get(name)
            if half is None or param._version != held[0] or half.requires_grad != (param.requires_grad and grad_on):
                self._recast(param)

    def refresh(self) -> None:
        """Inside the block, copy every param again (the plugin calls it after each optimizer step:
        a manual step inside ``training_step`` need not bump the version counters). Outside, nothing
        to do: the next entry copies them."""
        if self._depth > 0:
            for param in list(self._holders):
                self._recast(param)

    def _remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for _, slots in self._holders.values():
            for sub, name in slots:
                sub.__dict__.pop(name, None)
        self._holders = {}
