"""KernelStep: a user's ``torch.optim.Adam`` / ``AdamW`` / ``SGD`` stepped by lightning_amp's fused kernels.

One kernel call per (param group, device, dtype) updates the params and their state in one pass
(under O2 the params are the module's fp32 Parameters, as at O1), and changes nothing at all when the device flag ``found_inf`` is non-zero (step counters
included): no host read decides the skip.

Which optimizers (:func:`supports`): the class is exactly ``torch.optim.Adam``, ``AdamW`` or
``SGD`` (subclasses may override ``step``) and its ``step`` is torch's own (:func:`steps_as_torch`:
not patched on the class nor wrapped on the instance, since the kernels would update instead and the
patch would never run), not ``fused=True`` (those unscale in their own
kernel), and every group has a float ``lr`` and ``betas``, ``maximize=False`` and
``differentiable=False``; Adam's ``amsgrad`` and ``decoupled_weight_decay``, SGD's momentum,
dampening, nesterov and weight decay are supported; an optimizer with step pre/post hooks (its
own, or torch's global ones, looked at on every step) steps itself (the hooks run), and so does one
with a param that is not float32/float16/bfloat16 (complex, float64) or a sparse grad
(``nn.Embedding(sparse=True)``) or sparse state (a momentum buffer its own step made from one).
Anything else steps itself.
The rule is checked whenever the plan is (re)built and its inputs on every step (a group edit
that leaves the rule makes the optimizer step itself from then on); a sparse grad is looked for
when the plan is built and, on every step, among the params that had no grad then.

Contract towards the user's optimizer object: hyperparameters are read from ``param_groups`` on
every step (LR schedulers and group edits take effect); the state is torch's (``step`` a 0-dim
fp32 tensor on the param's device, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with
amsgrad; ``momentum_buffer`` for SGD with momentum), so ``state_dict()`` loads into a plain
torch optimizer and back. Math is fp32 (torch computes in the param's dtype: equal on fp32
params and masters up to rounding order, more accurate on 16-bit params).

Host cost: the lists (params, state) are built once and rebuilt only when the
number of groups or a group's params list changes (``len`` and identity of the list and of its
first and last param), or when a param has no state yet. The first step of a plan with
missing state reads ``found_inf`` on the host (once), so a skipped first step creates no state.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.optim.optimizer as torch_optimizer
from torch import Tensor

from lightning_amp import ops
from lightning_amp.amp.step_plan import StepPlan

KERNEL_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
#: the code of the wrapper torch puts around a class's ``step`` at its first construction (profiling, step hooks)
_PROFILE_WRAPPER_CODE = torch.optim.Optimizer.profile_hook_step(lambda *args: None).__code__


def _unhooked(step: Any) -> Any:
    """``step`` without torch's profiling wrapper (``Optimizer._patch_step_function``), if it has one."""
    return step.__wrapped__ if getattr(step, "__code__", None) is _PROFILE_WRAPPER_CODE else step


#: torch's own ``step`` of each class, captured at import: another function there was patched in
_TORCH_STEPS = {cls: _unhooked(cls.step) for cls in KERNEL_CLASSES}


def _group_supported(optimizer: torch.optim.Optimizer, group: Dict[str, Any]) -> bool:
    if group.get("maximize", False) or group.get("differentiable", False) or group.get("fused", False):
        return False
    if not isinstance(group["lr"], float) and not (isinstance(group["lr"], int) and not isinstance(group["lr"], bool)):
        return False
    if isinstance(optimizer, torch.optim.SGD):
        return True
    return all(isinstance(b, (float, int)) for b in group["betas"])


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Step pre/post hooks would run around ``optimizer.step()``: its own, or torch's global ones
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``)."""
    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None)
                or getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
                or getattr(torch_optimizer, "_global_optimizer_post_hooks", None))


def steps_as_torch(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` is torch's own method, so the kernels may update instead of calling it:
    its class's ``step`` is the one torch defined (captured at import; torch wraps it for profiling and its
    step hooks at the class's first construction: the hooks are looked at apart, :func:`has_step_hooks`) and
    the instance has no ``step`` of its own, except the call counter a torch LR scheduler wraps around the
    class's (``_wrapped_by_lr_sched``: it only sets ``_opt_called``, as :meth:`KernelStep.step` does). Read
    on every step: a patch made after the first step counts from the next."""
    original = _TORCH_STEPS.get(type(optimizer))
    if original is None or _unhooked(type(optimizer).step) is not original:
        return False
    own = vars(optimizer).get("step")
    return own is None or (getattr(own, "_wrapped_by_lr_sched", False)
                           and _unhooked(getattr(own, "__wrapped__", None)) is original)


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :class:`KernelStep` can step ``optimizer`` (the rule in the module docstring; an
    optimizer with step pre/post hooks, its own or global, or a patched ``step`` steps itself, so the
    hooks and the patch run)."""
    if has_step_hooks(optimizer) or not steps_as_torch(optimizer):
        return False
    return (type(optimizer) in KERNEL_CLASSES and all(_group_supported(optimizer, g) for g in optimizer.param_groups)
            and all(p.dtype in _FLOATS and not _sparse(optimizer, p)
                    for g in optimizer.param_groups for p in g["params"]))


def _sparse_grad(param: Tensor) -> bool:
    return param.grad is not None and param.grad.layout != torch.strided


def _sparse(optimizer: torch.optim.Optimizer, param: Tensor) -> bool:
    """A sparse grad, or sparse state left by the optimizer's own step on one."""
    return _sparse_grad(param) or any(isinstance(v, Tensor) and v.layout != torch.strided
                                      for v in optimizer.state.get(param, {}).values())


class _Part:
    """One kernel call: params of one group sharing (device, dtype)."""

    def __init__(self, optimizer, group: dict, params: List[Tensor]) -> None:
        self.group, self.params = group, params
        self.device = params[0].device
        state = [optimizer.state[p] for p in params]
        self.steps = [st.get("step") for st in state]
        self.exp_avgs = [st.get("exp_avg") for st in state]
        self.exp_avg_sqs = [st.get("exp_avg_sq") for st in state]
        self.max_exp_avg_sqs = [st.get("max_exp_avg_sq") for st in state]
        self.momentum_buffers = [st.get("momentum_buffer") for st in state]


class KernelStep:
    """Steps ``optimizer`` (see :func:`supports`) with the fused kernels.

    Args:
        optimizer: a torch Adam/AdamW/SGD.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.adam = not isinstance(optimizer, torch.optim.SGD)
        self.adam_w = isinstance(optimizer, torch.optim.AdamW)
        # the cached plan (shared class with the fused optimizers); the signature also holds each
        # group's AMSGrad and momentum switches, which decide what state the kernels get
        self.plan = StepPlan(key=lambda g: (bool(g.get("amsgrad")), g.get("momentum", 0) != 0))
        self._gradless: List[Tensor] = []  # trainable params without grad when the plan was built
        self._fresh = True

    @property
    def _parts(self) -> List[_Part]:
        return self.plan.parts or []

    def usable(self) -> bool:
        """True when this step can run through the kernels (the plan is rebuilt here if needed)."""
        if has_step_hooks(self.optimizer) or not steps_as_torch(self.optimizer):  # since the plan was built
            return False
        if not self.plan.current(self.optimizer.param_groups):
            if not supports(self.optimizer):
                return False
            self._build()
        elif any(map(_sparse_grad, self._gradless)):
            return False
        return True

    def _build(self) -> None:
        state = self.optimizer.state
        self._fresh = False
        self._gradless = [p for g in self.optimizer.param_groups for p in g["params"]
                          if p.requires_grad and p.grad is None]
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if self._needs_state(p, group):
                    self._fresh = True
                else:
                    self._normalise_state(p)
        parts: List[_Part] = []
        if not self._fresh:
            for group in self.optimizer.param_groups:
                buckets: Dict[tuple, List[Tensor]] = {}
                for p in group["params"]:
                    if p.requires_grad:
                        buckets.setdefault((p.device, p.dtype), []).append(p)
                for params in buckets.values():
                    parts.append(_Part(self.optimizer, group, params))
        self.plan.store(self.optimizer.param_groups, parts)

    def _needs_state(self, p: Tensor, group: dict) -> bool:
        st = self.optimizer.state.get(p, {})
        if self.adam:
            return "exp_avg" not in st or (group["amsgrad"] and "max_exp_avg_sq" not in st)
        return group["momentum"] != 0 and st.get("momentum_buffer") is None

    def _normalise_state(self, p: Tensor) -> None:
        """State loaded from a checkpoint: step as a device fp32 counter, buffers in the param's dtype."""
        st = self.optimizer.state[p]
        for key, value in list(st.items()):
            if not isinstance(value, Tensor):
                continue
            if key == "step":
                if value.device != p.device or value.dtype != torch.float32 or value.dim() != 0:
                    st[key] = value.to(device=p.device, dtype=torch.float32).reshape(())
            elif value.dtype != p.dtype or value.device != p.device or not value.is_contiguous():
                st[key] = value.to(device=p.device, dtype=p.dtype).contiguous()

    @property
    def needs_host_flag(self) -> bool:
        """True while some param has no state yet: that step must know the flag on the host."""
        return self._fresh

    def _init_state(self) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None or not self._needs_state(p, group):
                    continue
                st = self.optimizer.state[p]
                if self.adam:
                    st.setdefault("step", torch.zeros((), dtype=torch.float32, device=p.device))
                    for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                        st.setdefault(key, torch.zeros_like(p, memory_format=torch.contiguous_format))
                else:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    st["_first"] = True  # the kernel's first run sets the buffer to the grad, as torch

    @torch.no_grad()
    def step(self, found_inf: Callable[[torch.device], Optional[Tensor]], skipped_on_host: bool = False) -> None:
        """One update of every group; ``found_inf(device)`` is the agreed device flag (grads unscaled)."""
        self.optimizer._opt_called = True  # what torch's step wrapper records for its LR schedulers
        if self._fresh:
            if skipped_on_host:
                return
            self._init_state()
            self._first_step(found_inf)
            self.plan.drop()  # state complete now: build the cached plan next time
            return
        for part in self._parts:
            params, grads = part.params, [p.grad for p in part.params]
            if any(g is None for g in grads):
                self._run(part, [i for i, g in enumerate(grads) if g is not None], found_inf)
                continue
            grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
            self._call(part.group, params, grads, part, found_inf(part.device), False)

    def _run(self, part: _Part, keep: List[int], found_inf) -> None:
        """The subset ``keep`` of a part (params without grad do not move, as in torch)."""
        if not keep:
            return
        pick = lambda xs: [xs[i] for i in keep] if xs is not None else None  # noqa: E731
        sub = _Part.__new__(_Part)
        sub.steps, sub.exp_avgs, sub.exp_avg_sqs = pick(part.steps), pick(part.exp_avgs), pick(part.exp_avg_sqs)
        sub.max_exp_avg_sqs, sub.momentum_buffers = pick(part.max_exp_avg_sqs), pick(part.momentum_buffers)
        params = pick(part.params)
        grads = [p.grad.contiguous() for p in params]
        self._call(part.group, params, grads, sub, found_inf(part.device), False)

    def _first_step(self, found_inf) -> None:
        for group in self.optimizer.param_groups:
            buckets: Dict[tuple, List[Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    first = bool(self.optimizer.state[p].pop("_first", False))
                    buckets.setdefault((p.device, p.dtype, first), []).append(p)
            for (device, _, first), params in buckets.items():
                part = _Part(self.optimizer, group, params)
                grads = [p.grad.contiguous() for p in params]
                self._call(group, params, grads, part, found_inf(device), first)

    def _call(self, group, params, grads, part, found_inf, first_run) -> None:
        if self.adam:
            beta1, beta2 = group["betas"]
            ops.multi_tensor_adam(
                params, grads, part.exp_avgs, part.exp_avg_sqs, part.steps, lr=group["lr"], beta1=beta1,
                beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                adam_w_mode=self.adam_w or bool(group.get("decoupled_weight_decay", False)),
                max_exp_avg_sqs=part.max_exp_avg_sqs if group["amsgrad"] else None,
                found_inf=found_inf, checked=not first_run and self.plan.built,
            )
        else:
            momentum = group["momentum"]
            ops.multi_tensor_sgd(
                params, grads, part.momentum_buffers if momentum != 0 else None, lr=group["lr"], momentum=momentum,
                dampening=group["dampening"], weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                first_run=first_run, found_inf=found_inf,
                checked=not first_run and self.plan.built,
            )
