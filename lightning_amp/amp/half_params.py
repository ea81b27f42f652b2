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
  entry stay until it exits. Steps and writes *inside* the block (manual optimization:
  ``training_step`` holds several forwards, optimizer steps and ``toggle_optimizer`` calls):
  :meth:`HalfParams.refresh` (called by the plugin after each optimizer step) copies the stepped
  params again, so the next forward of the same ``training_step`` sees them; with
  ``watch_writes=True`` a global forward pre-hook (active only inside the block) also recasts,
  before a module's forward, the copy of any of its params written since (version counter) or
  whose ``requires_grad`` changed. The plugin watches only under manual optimization: under
  automatic optimization the block is one ``training_step`` whose step and callbacks run outside
  it, and the hook would cost a Python call per module forward. A write to a param *through the
  attribute* inside the block (``self.weight.copy_(...)`` in ``training_step``) lands on the half
  copy, not on the Parameter; write through ``self.parameters()`` there.

Host cost per forward: one cast per param and one dict write per slot, in one loop over a plan
that is rebuilt only when a module or parameter is registered anywhere (torch's global
registration hooks) or a slot no longer holds its param. Memory: the half copies live only while
autograd keeps them for backward (no persistent half weights).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import (
    register_module_forward_pre_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
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


class _Registrations:
    """Counts module and parameter registrations anywhere in the process (torch's global hooks,
    installed on the first :func:`registration_count` call)."""

    count = 0
    installed = False

    @classmethod
    def bump(cls, *args: object) -> None:
        cls.count += 1


def registration_count() -> int:
    """A number that changes whenever a module or parameter is registered on any module after the
    first call (``register_module``/``register_parameter``, attribute assignment, ``ModuleList.append``):
    a structure cached at count ``n`` is current while this returns ``n``. Deleting a submodule and
    writing ``_parameters`` directly are not counted."""
    if not _Registrations.installed:
        register_module_module_registration_hook(_Registrations.bump)
        register_module_parameter_registration_hook(_Registrations.bump)
        _Registrations.installed = True
    return _Registrations.count


def reads_fp32(module: nn.Module, keep_batchnorm_fp32: bool) -> bool:
    """Whether O2 leaves ``module`` on its fp32 Parameters: BatchNorm when kept fp32, and embeddings
    with sparse grads (autograd cannot cast a sparse grad back through a half copy)."""
    if keep_batchnorm_fp32 and isinstance(module, _BatchNorm):
        return True
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and bool(module.sparse)


class _Entry:
    """One fp32 Parameter and the slots (module ``_parameters``, module ``__dict__``, name) that read it."""

    __slots__ = ("param", "slots", "version")

    def __init__(self, param: Tensor) -> None:
        self.param = param
        self.slots: List[Tuple[Dict[str, Optional[Tensor]], Dict[str, object], str]] = []
        self.version = -1


class _StalePlan(Exception):
    """A slot no longer holds the param the plan recorded (``_parameters`` written directly)."""


class HalfParams:
    """Half copies of ``module``'s fp32 params during forward (see the module docstring).

    Args:
        module: the model (its Parameters are fp32).
        dtype: the half dtype of the copies.
        keep_batchnorm_fp32: BatchNorm modules keep reading their fp32 Parameters.
        watch_writes: recast, before each module forward inside the block, copies whose param was
            written or whose ``requires_grad`` changed since they were made (manual optimization).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool,
                 watch_writes: bool = True) -> None:
        self.module, self.dtype, self.keep_batchnorm_fp32 = module, dtype, keep_batchnorm_fp32
        self.watch_writes = watch_writes
        self._plan: List[_Entry] = []
        self._by_module: Dict[int, List[Tuple[str, _Entry]]] = {}
        self._built_at = -1
        self._installed: List[_Entry] = []
        self._hook: Optional[RemovableHandle] = None
        self._depth = 0

    def _build_plan(self) -> None:
        entries: Dict[int, _Entry] = {}
        by_module: Dict[int, List[Tuple[str, _Entry]]] = {}
        for sub in modules_outside_metrics(self.module):
            if reads_fp32(sub, self.keep_batchnorm_fp32):
                continue
            for name, param in sub._parameters.items():
                if param is None:
                    continue
                entry = entries.get(id(param))
                if entry is None:
                    entry = entries[id(param)] = _Entry(param)
                entry.slots.append((sub._parameters, sub.__dict__, name))
                by_module.setdefault(id(sub), []).append((name, entry))
        self._plan, self._by_module = list(entries.values()), by_module
        self._built_at = registration_count()

    def __enter__(self) -> "HalfParams":
        self._depth += 1
        if self._depth == 1:
            try:
                self._install()
                if self.watch_writes:
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
        if self._built_at != registration_count():
            self._build_plan()
        try:
            self._install_plan()
        except _StalePlan:
            self._remove()
            self._build_plan()
            self._install_plan()

    def _install_plan(self) -> None:
        dtype, fp32, installed = self.dtype, torch.float32, self._installed
        for entry in self._plan:
            param = entry.param
            if param.dtype is not fp32:
                continue
            half = param.to(dtype)
            installed.append(entry)
            for params, attrs, name in entry.slots:
                if params.get(name) is not param:
                    raise _StalePlan
                attrs[name] = half
            entry.version = param._version

    def _recast(self, entry: _Entry) -> None:
        half = entry.param.to(self.dtype)
        for _, attrs, name in entry.slots:
            attrs[name] = half
        entry.version = entry.param._version

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        """Before each module's forward inside the block: recast a copy whose param was written since
        (version counter) or whose ``requires_grad`` changed (``toggle_optimizer``, freezing)."""
        held = self._by_module.get(id(module))
        if held is None:
            return
        grad_on = torch.is_grad_enabled()
        attrs = module.__dict__
        for name, entry in held:
            half = attrs.get(name)
            if half is None:
                continue
            param = entry.param
            if param._version != entry.version or half.requires_grad != (param.requires_grad and grad_on):
                self._recast(entry)

    def refresh(self) -> None:
        """Inside the block, copy every param again (the plugin calls it after each optimizer step:
        a manual step inside ``training_step`` need not bump the version counters). Outside, nothing
        to do: the next entry copies them."""
        if self._depth > 0:
            for entry in self._installed:
                self._recast(entry)

    def _remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for entry in self._installed:
            for _, attrs, name in entry.slots:
                attrs.pop(name, None)
        self._installed = []
