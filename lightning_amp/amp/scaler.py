"""LossScaler: static or dynamic loss scaling, framework-free, state held in device tensors.

The state (scale, growth and hysteresis trackers, overflow counters) lives in 0-dim tensors on
one device (:meth:`LossScaler.to`), so ``update(found_inf)`` with a device ``found_inf`` is a
handful of device ops and never reads the flag on the host: the scale update makes no host
sync. :attr:`scale_tensor` (fp32) is what the step path multiplies the loss by and hands to
kernels as ``grad_scale``. The Python-number properties (``scale``, ``growth_tracker``, ...) and
``state_dict`` read the device state, i.e. synchronise: use them outside the step path. The
caller reduces ``found_inf`` (across ranks too) and calls ``update(found_inf)`` once per
optimizer step, skipped or not.

Dynamic rule (Megatron-LM ``DynamicGradScaler``; ``hysteresis=1`` is apex's LossScaler):

* clean step: the growth counter goes up by one; when it reaches ``growth_interval`` the
  scale is multiplied by ``growth_factor`` (capped at ``max_loss_scale``), the growth counter
  goes back to 0 and the hysteresis budget is re-armed to ``hysteresis``.
* overflow step: the growth counter goes back to 0 and the hysteresis budget drops by one;
  when the budget is exhausted (0) the scale is multiplied by ``backoff_factor`` (floored
  at ``min_loss_scale``, so it never collapses to zero).

As in Megatron's code, the budget is re-armed only when the scale *grows*, not by a single
clean step: after ``hysteresis`` overflows every further overflow backs off at once until
``growth_interval`` clean steps in a row have passed. ``overflows_in_a_row`` (reset by any
clean step) is kept separately for observability.

Decisions: ``init_scale`` outside ``[min_loss_scale, max_loss_scale]`` is a ValueError naming
both, never silently clamped (checked for a static scale too, whose level may resolve to dynamic
on another device); a static scale ignores the bounds and
``init_scale`` and never changes, but still counts overflows.
"""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, Optional, Union

import torch
from torch import Tensor

from lightning_amp._keywords import checks_keywords
from lightning_amp.amp.levels import AmpProperties, LossScaleSpec, check_loss_scale

DEFAULT_MIN_LOSS_SCALE = 1.0
"""The floor of a dynamic scale when ``min_loss_scale`` is None."""

SCALER_DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, hysteresis=1,
    min_loss_scale=None, max_loss_scale=2.0**24,
))
"""The dynamic :class:`LossScaler` keywords and their defaults: the one place they are written (the
plugins' signatures and :func:`check_scaler_keywords` read them from here)."""


def _positive_finite(value: object, name: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
        if value > 0 and math.isfinite(value):
            return value
    raise ValueError(f"`{name}` must be a positive finite number; got {value!r}")


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}")


def checked_scaler_options(**options: Any) -> Dict[str, Any]:
    """The dynamic-scaler keywords (:data:`SCALER_DEFAULTS`' names; those left out take the defaults), checked and
    normalised (``min_loss_scale`` None becomes 1.0): TypeError for an unknown keyword, ValueError naming the
    keyword and its allowed values otherwise. ``init_scale`` must lie within the bounds for a static scale too:
    the same arguments must work on every device, where the level may resolve to a dynamic scale."""
    unknown = sorted(set(options) - set(SCALER_DEFAULTS))
    if unknown:
        raise TypeError(f"unknown loss-scaler keywords {unknown}; allowed: {sorted(SCALER_DEFAULTS)}")
    options = {**SCALER_DEFAULTS, **options}
    out = {name: _positive_finite(options[name], name)
           for name in ("init_scale", "growth_factor", "backoff_factor", "max_loss_scale")}
    if out["growth_factor"] <= 1.0:
        raise ValueError(f"`growth_factor` must be a finite number > 1; got {out['growth_factor']!r}")
    if not 0.0 < out["backoff_factor"] < 1.0:
        raise ValueError(f"`backoff_factor` must be in the open interval (0, 1); got {out['backoff_factor']!r}")
    out["growth_interval"] = _positive_int(options["growth_interval"], "growth_interval")
    out["hysteresis"] = _positive_int(options["hysteresis"], "hysteresis")
    floor = options["min_loss_scale"]
    out["min_loss_scale"] = DEFAULT_MIN_LOSS_SCALE if floor is None else _positive_finite(floor, "min_loss_scale")
    if out["min_loss_scale"] > out["max_loss_scale"]:
        raise ValueError(f"`min_loss_scale` ({out['min_loss_scale']}) must be <= `max_loss_scale` "
                         f"({out['max_loss_scale']}); the default floor is 1.0")
    if not out["min_loss_scale"] <= out["init_scale"] <= out["max_loss_scale"]:
        raise ValueError(
            f"`init_scale` ({out['init_scale']}) must lie within [`min_loss_scale`, `max_loss_scale`] = "
            f"[{out['min_loss_scale']}, {out['max_loss_scale']}] (the default floor is 1.0): pass an `init_scale` "
            "inside the bounds")
    return out


@checks_keywords
class LossScaler:
    """Multiplier applied to the loss before backward, adapted to gradient overflows.

    Args:
        loss_scale: a positive float for a static scale, or "dynamic".
        init_scale: first dynamic scale, within [min_loss_scale, max_loss_scale] (else ValueError).
        growth_factor: > 1; the scale is multiplied by it after ``growth_interval`` clean steps.
        backoff_factor: in (0, 1); the scale is multiplied by it on a counted overflow.
        growth_interval: integer >= 1, clean steps in a row before growing.
        hysteresis: integer >= 1, overflows tolerated before backing off (1 = back off at once).
        min_loss_scale: floor of the dynamic scale; None means 1.0.
        max_loss_scale: ceiling of the dynamic scale.
    """

    def __init__(
        self,
        loss_scale: Union[float, str] = "dynamic",
        init_scale: float = SCALER_DEFAULTS["init_scale"],
        growth_factor: float = SCALER_DEFAULTS["growth_factor"],
        backoff_factor: float = SCALER_DEFAULTS["backoff_factor"],
        growth_interval: int = SCALER_DEFAULTS["growth_interval"],
        hysteresis: int = SCALER_DEFAULTS["hysteresis"],
        min_loss_scale: Optional[float] = SCALER_DEFAULTS["min_loss_scale"],
        max_loss_scale: float = SCALER_DEFAULTS["max_loss_scale"],
    ) -> None:
        spec = check_loss_scale(loss_scale)
        options = checked_scaler_options(init_scale=init_scale, growth_factor=growth_factor,
                                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                                         hysteresis=hysteresis, min_loss_scale=min_loss_scale,
                                         max_loss_scale=max_loss_scale)
        self.dynamic = spec == "dynamic"
        self.growth_factor, self.backoff_factor = options["growth_factor"], options["backoff_factor"]
        self.growth_interval, self.hysteresis = options["growth_interval"], options["hysteresis"]
        self.min_loss_scale, self.max_loss_scale = options["min_loss_scale"], options["max_loss_scale"]
        #: the static scale as a Python float (None when dynamic): known on the host, never changes
        self.static_scale: Optional[float] = None if self.dynamic else spec
        self.steps = 0  # updates so far (host-side: every update is counted without reading the flag)
        scale = options["init_scale"] if self.dynamic else spec
        self._set_state(scale, 0, self.hysteresis, 0, 0, torch.device("cpu"))

    def _set_state(self, scale: float, growth: int, hyst: int, in_a_row: int, total: int, device) -> None:
        # float64 scale: exact as a Python float (odd factors such as 0.4 round as in Python)
        self._scale = torch.tensor(scale, dtype=torch.float64, device=device)
        self._scale32 = self._scale.float()
        # [growth tracker, hysteresis tracker, overflows in a row, total overflows]
        self._counters = torch.tensor([growth, hyst, in_a_row, total], dtype=torch.int64, device=device)

    @property
    def device(self) -> torch.device:
        return self._scale.device

    def to(self, device: Union[str, torch.device]) -> "LossScaler":
        """Move the state to ``device`` (where the grads and ``found_inf`` live); returns self."""
        device = torch.device(device)
        if device != self._scale.device:
            self._scale = self._scale.to(device)
            self._scale32 = self._scale32.to(device)
            self._counters = self._counters.to(device)
        return self

    @property
    def scales_the_loss(self) -> bool:
        """Whether the loss is multiplied at all: dynamic, or a static scale other than 1.0."""
        return self.dynamic or self.static_scale != 1.0

    @property
    def scale_tensor(self) -> Tensor:
        """The current scale as a 0-dim fp32 tensor on :attr:`device` (updated in place; no host read)."""
        return self._scale32

    @property
    def scale(self) -> float:
        """The current loss scale (a Python float; reads the device state)."""
        return self.static_scale if self.static_scale is not None else float(self._scale.item())

    @property
    def inv_scale(self) -> float:
        """1 / scale: the factor that unscales gradients."""
        return 1.0 / self.scale

    def cap(self, limit: float) -> None:
        """Keep the scale at most ``limit`` from now on: the ceiling (and the floor, where above it) becomes
        ``limit``, a scale above it is lowered to it, a static one too. The backward of a float16 loss runs
        at most at 2**15 (:meth:`~lightning_amp.amp.engine.AmpEngine.scale_loss`): capped here, the scale
        the scaler reports, grows from and backs off from is the factor its grads carry. Device ops only
        (no host read); nothing once capped at or below ``limit``."""
        if self.static_scale is not None:
            if self.static_scale > limit:
                self.static_scale = limit
                self._scale.fill_(limit)
                self._scale32.fill_(limit)
            return
        if self.max_loss_scale <= limit:
            return
        self.max_loss_scale = limit
        self.min_loss_scale = min(self.min_loss_scale, limit)
        self._scale.clamp_(max=limit)
        self._scale32.copy_(self._scale)

    def report_tensor(self) -> Tensor:
        """``[scale, overflows in a row]`` as a new 1-dim fp32 tensor on :attr:`device` (no host read):
        what a skipped step's report copies to the host with its flag."""
        return torch.stack([self._scale32, self._counters[2].float()])

    @property
    def growth_tracker(self) -> int:
        """Clean steps in a row since the last growth or overflow."""
        return int(self._counters[0].item())

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows still tolerated before the next backoff (0: every overflow backs off)."""
        return int(self._counters[1].item())

    @property
    def overflows_in_a_row(self) -> int:
        return int(self._counters[2].item())

    @property
    def total_overflows(self) -> int:
        return int(self._counters[3].item())

    @torch.no_grad()
    def update(self, found_inf: Any) -> None:
        """Advance by one optimizer step; ``found_inf`` (a bool, a number or a one-element tensor, e.g.
        on the device) is non-zero when that step's grads overflowed. Device ops only, no host read."""
        self.steps += 1
        if isinstance(found_inf, Tensor):
            flag = (found_inf.reshape(()) != 0).to(device=self.device, dtype=torch.int64, non_blocking=True)
        else:
            flag = torch.tensor(int(bool(found_inf)), dtype=torch.int64, device=self.device)
        c = self._counters
        c[2].add_(1).mul_(flag)  # overflows in a row
        c[3].add_(flag)  # total overflows
        if not self.dynamic:
            return
        clean = 1 - flag
        c[0].add_(1).mul_(clean)  # growth tracker: +1, or 0 on overflow
        c[1].sub_(flag).clamp_(min=0)  # hysteresis budget: -1 on overflow
        backoff = flag * (c[1] <= 0)
        grow = c[0] >= self.growth_interval  # only after a clean step
        self._scale.copy_(torch.where(
            backoff.bool(), (self._scale * self.backoff_factor).clamp_(min=self.min_loss_scale),
            torch.where(grow, (self._scale * self.growth_factor).clamp_(max=self.max_loss_scale), self._scale),
        ))
        c[1].copy_(torch.where(grow, self.hysteresis, c[1]))
        c[0].mul_(~grow)
        self._scale32.copy_(self._scale)

    def state_dict(self) -> Dict[str, Any]:
        """All mutable state (plain Python values), enough to resume the trajectory exactly."""
        return {
            "dynamic": self.dynamic,
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
            "overflows_in_a_row": self.overflows_in_a_row,
            "total_overflows": self.total_overflows,
            "steps": self.steps,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore state saved by ``state_dict``; the constructor's configuration is kept.

        A static scaler keeps its configured scale; a dynamic one takes the saved scale
        (clamped into its bounds), also when the checkpoint came from a static scaler.
        """
        missing = [k for k in ("scale", "growth_tracker", "hysteresis_tracker") if k not in state_dict]
        if missing:
            raise ValueError(f"`state_dict` lacks the LossScaler keys {missing}; got keys {sorted(state_dict)}")
        scale = self.scale
        if self.dynamic:
            saved = _positive_finite(float(state_dict["scale"]), "state_dict['scale']")
            scale = min(max(saved, self.min_loss_scale), self.max_loss_scale)
        self._set_state(scale, int(state_dict["growth_tracker"]), int(state_dict["hysteresis_tracker"]),
                        int(state_dict.get("overflows_in_a_row", 0)), int(state_dict.get("total_overflows", 0)),
                        self.device)
        self.steps = int(state_dict.get("steps", 0))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale}, overflows_in_a_row={self.overflows_in_a_row})"


def check_scaler_keywords(properties: AmpProperties, loss_scale: Optional[LossScaleSpec],
                          scaler_kwargs: Mapping[str, Any], warn: Callable[[str], Any]) -> None:
    """Refuse or flag dynamic-scaler keywords that a static scale would silently ignore.

    ``scaler_kwargs`` are the :class:`LossScaler` keywords as given; those that differ from
    :data:`SCALER_DEFAULTS` count as given. With a dynamic scale nothing happens. With an explicit
    numeric ``loss_scale`` they raise ValueError naming them; with the level's or bfloat16's default
    static scale ``warn`` is called with a message naming them and ``loss_scale="dynamic"``.
    """
    if properties.dynamic_loss_scale:
        return
    given = sorted(name for name, value in scaler_kwargs.items() if value != SCALER_DEFAULTS[name])
    if not given:
        return
    names = ", ".join(f"`{name}`" for name in given)
    if loss_scale is not None:
        raise ValueError(f"{names} configure the dynamic loss scale, but `loss_scale={loss_scale!r}` is static; "
                         'pass loss_scale="dynamic" or leave them out')
    why = "bfloat16 needs no scaling" if properties.dtype == torch.bfloat16 else f"the {properties.opt_level} default"
    warn(f"{names}: no effect, the loss scale is a fixed {properties.loss_scale} ({why}); "
         'pass loss_scale="dynamic" to use them')
