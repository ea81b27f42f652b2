"""Shared machinery of the fused optimizers: validation, per-(device, dtype) partitioning,
in-kernel unscaling protocol and a dtype-preserving ``load_state_dict``.

Subclasses implement ``_init_state(p, group)`` and ``_update(group, parts, grad_scale, found_inf)``
where ``parts`` maps a partition key to the params (with grads) that one kernel call updates.
"""
from __future__ import annotations

from collections import defaultdict
from itertools import chain
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_amp.amp.scaling_protocol import InKernelScaling
from lightning_amp.amp.step_plan import StepPlan


def check_nonnegative(name: str, value: float) -> None:
    """ValueError naming ``name`` unless ``value`` is a finite number >= 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0.0 <= float(value) < float("inf")):
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number >= 0)")


def check_unit_interval(name: str, value: float) -> None:
    """ValueError naming ``name`` unless ``0 <= value < 1``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0.0 <= float(value) < 1.0):
        raise ValueError(f"Invalid {name}: {value!r} (must be in [0, 1))")


def check_betas(betas: Any) -> None:
    """ValueError unless ``betas`` is a pair of numbers in ``[0, 1)``."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (must be a pair (beta1, beta2) in [0, 1))")
    check_unit_interval("betas[0]", betas[0])
    check_unit_interval("betas[1]", betas[1])


def as_pair(betas: Any) -> Any:
    """``betas`` as a tuple when it is a list or tuple (kept as given otherwise, for validation)."""
    return tuple(betas) if isinstance(betas, (list, tuple)) else betas


def _as_flag_tensor(name: str, value: Any) -> Optional[Tensor]:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float32)
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        return value.reshape(()).float()
    raise TypeError(f"step(): {name} must be a one-element float tensor (or a number), got {value!r}")


class FusedOptimizer(InKernelScaling, torch.optim.Optimizer):
    """Base of FusedAdam/SGD/LAMB/Adadelta: one ``lightning_amp.ops`` call per (group, device, dtype).

    ``step(closure=None, *, grad_scale=None, found_inf=None)``: ``grad_scale`` (loss scale the
    grads carry) is divided out inside the kernel, which leaves each ``p.grad`` unscaled (as torch's
    ``fused=True`` optimizers); a non-zero ``found_inf`` leaves params, state, step counters and grads
    untouched. Both may also be set as attributes ``optimizer.grad_scale`` /
    ``optimizer.found_inf`` (the protocol of ``torch.amp.GradScaler`` for optimizers with
    ``_step_supports_amp_scaling``).
    """

    def add_param_group(self, param_group: dict) -> None:
        self.step_plan.drop()
        super().add_param_group(param_group)
        self._validate_group(self.param_groups[-1])
        for p in self.param_groups[-1]["params"]:
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(
                    f"{type(self).__name__}: params must be float32/float16/bfloat16, got {p.dtype}"
                )

    # -- flat gradient buffer (combine_grad) ----------------------------------------------
    def attach_flat_grads(self, flat_grads) -> None:
        """Use a :class:`~lightning_amp.amp.flat.FlatGradBuffer`: ``zero_grad`` then zeroes its
        buffers in place (whatever ``set_to_none`` says) so the grad views stay attached."""
        from lightning_amp.amp.flat import FlatGradBuffer  # noqa: PLC0415  (amp.flat imports ops only)

        if flat_grads is not None and not isinstance(flat_grads, FlatGradBuffer):
            raise TypeError(f"{type(self).__name__}.attach_flat_grads: expected a FlatGradBuffer or None, "
                            f"got {type(flat_grads).__name__}")
        self._flat_grads = flat_grads

    #: the default of ``zero_grad``'s ``set_to_none`` when given apex's ``set_grad_none`` (None: torch's, True)
    set_grad_none: Optional[bool] = None

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """As torch's (``set_to_none`` defaults to True, or to apex's ``set_grad_none`` given to the
        constructor); grads living in an attached FlatGradBuffer are zeroed in place instead."""
        if set_to_none is None:
            set_to_none = self.set_grad_none is not False
        flat = getattr(self, "_flat_grads", None)
        if flat is None:
            return super().zero_grad(set_to_none=set_to_none)
        flat.zero_()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p not in flat:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    # -- subclass hooks -------------------------------------------------------------------
    def _validate_group(self, group: dict) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _init_state(self, p: Tensor, group: dict) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _needs_init(self, p: Tensor, group: dict) -> bool:
        """Whether ``p`` has no optimizer state yet (created lazily on its first step)."""
        return len(self.state.get(p, ())) == 0

    def _partition_key(self, p: Tensor, group: dict) -> tuple:
        """Params sharing this key are updated by one kernel call."""
        return (p.device, p.dtype, p.grad.dtype)

    def _update(self, group: dict, parts: dict, grad_scale: Callable, found_inf: Callable) -> None:
        raise NotImplementedError  # pragma: no cover - overridden

    def _state_dtype(self, p: Tensor, group: dict, key: str) -> torch.dtype:
        """dtype a floating state tensor ``key`` of ``p`` is kept in (restored by load_state_dict)."""
        return p.dtype

    def _before_update(self, grad_scale: Callable, found_inf: Callable) -> None:
        """Hook run once per step after the skip check (LAMB computes its global grad norm here)."""

    # -- step ---------------------------------------------------------------------------------
    def _params_with_grad(self, group: dict) -> list:
        out = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            out.append(p)
        return out

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, *, grad_scale: Any = None, found_inf: Any = None):
        """Update every param group; returns ``closure()``'s loss (if a closure is given)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        grad_scale = _as_flag_tensor("grad_scale", grad_scale)
        found_inf = _as_flag_tensor("found_inf", found_inf)
        scale_on, inf_on = _per_device(grad_scale), _per_device(found_inf)

        plan = self.step_plan.cached(self.param_groups)
        if plan is None:
            work = [(group, self._params_with_grad(group)) for group in self.param_groups]
            fresh = [(p, group) for group, ps in work for p in ps if self._needs_init(p, group)]
            if fresh and found_inf is not None and bool(found_inf.item() != 0):
                return loss  # an overflow on the very first step must not even create state
            for p, group in fresh:
                self._init_state(p, group)
            plan = []
            for group, ps in work:
                parts: dict = defaultdict(list)
                for p in ps:
                    parts[self._partition_key(p, group)].append(p)
                plan.append((group, dict(parts)))
            complete = all(len(ps) == len(group["params"]) for group, ps in work) and not fresh
            if complete:
                self.step_plan.store(self.param_groups, plan)
            else:
                self.step_plan.drop()
        self._before_update(scale_on, inf_on)
        for group, parts in plan:
            if parts:
                self._update(group, parts, scale_on, inf_on)
        return loss

    # Cached plan (:class:`~lightning_amp.amp.step_plan.StepPlan`, shared with the kernel step):
    # the partitions of the last step, reused while every param of every group has a grad and state
    # and the groups keep their signature; ``add_param_group`` and ``load_state_dict`` drop it. A
    # stored plan also spares the fallbacks their per-tensor Python checks (``checked=True``; the compiled
    # ops check every argument in C++ on every call).
    @property
    def _checked(self) -> bool:
        return self.step_plan.built

    @property
    def step_plan(self) -> StepPlan:
        plan = self.__dict__.get("_step_plan")
        if plan is None:
            plan = self.__dict__["_step_plan"] = StepPlan()
        return plan

    @property
    def _plan(self) -> Optional[list]:
        """The cached partitions (None until a full, clean step built them)."""
        return self.step_plan.parts

    # -- checkpoints ----------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but state tensors keep the dtype the optimizer needs (e.g. fp32 masters of
        bf16 params are not rounded to bf16), step counters become fp32 on the param's device, and
        loaded tensors never alias the given ``state_dict``."""
        self.step_plan.drop()
        originals = {k: dict(v) for k, v in state_dict["state"].items()}
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        owners = {}
        for group in self.param_groups:
            for p in group["params"]:
                owners[p] = group
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(saved_ids, params):
            if pid not in originals:
                continue
            st = self.state[p]
            for key, value in originals[pid].items():
                if not isinstance(value, Tensor):
                    continue
                if key == "step":
                    st[key] = value.detach().to(device=p.device, dtype=torch.float32, copy=True).reshape(())
                elif value.is_floating_point():
                    dtype = self._state_dtype(p, owners[p], key)
                    st[key] = value.detach().to(device=p.device, dtype=dtype, copy=True)


def _per_device(flag: Optional[Tensor]) -> Callable[[torch.device], Optional[Tensor]]:
    """``flag`` moved to a device once per step (cached), or None."""
    cache: dict = {}

    def on(device: torch.device) -> Optional[Tensor]:
        if flag is None:
            return None
        if device not in cache:
            cache[device] = flag if flag.device == device else flag.to(device, non_blocking=True)
        return cache[device]

    return on


def new_step(p: Tensor) -> Tensor:
    """A fresh per-param step counter: 0-dim fp32 on the param's device (as torch's fused optimizers)."""
    return torch.zeros((), dtype=torch.float32, device=p.device)


def grads_of(params: list) -> list:
    """The grads of ``params`` for one kernel call. A non-contiguous grad is replaced by a contiguous copy
    (``p.grad`` itself: the kernels read the grads densely and, given a ``grad_scale``, write them back
    unscaled, which must reach ``p.grad``)."""
    for p in params:
        if not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
    return [p.grad for p in params]
