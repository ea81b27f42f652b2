"""LossScaler: static or dynamic loss scaling, framework-free, state held in Python floats.

The scale is a plain Python float, so reading it never synchronises a device; the caller
reduces ``found_inf`` (across ranks too) and calls ``update(found_inf)`` once per optimizer
step, skipped or not.

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

Decisions: ``init_scale`` outside ``[min_loss_scale, max_loss_scale]`` is clamped into it
(so lowering ``max_loss_scale`` alone is enough); a static scale ignores the bounds and
``init_scale`` and never changes, but still counts overflows.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Union

from lightning_amp.amp.levels import check_loss_scale

DEFAULT_MIN_LOSS_SCALE = 1.0


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


class LossScaler:
    """Multiplier applied to the loss before backward, adapted to gradient overflows.

    Args:
        loss_scale: a positive float for a static scale, or "dynamic".
        init_scale: first dynamic scale (clamped into [min_loss_scale, max_loss_scale]).
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
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_loss_scale: Optional[float] = None,
        max_loss_scale: float = 2.0**24,
    ) -> None:
        spec = check_loss_scale(loss_scale)
        init_scale = _positive_finite(init_scale, "init_scale")
        growth_factor = _positive_finite(growth_factor, "growth_factor")
        if growth_factor <= 1.0:
            raise ValueError(f"`growth_factor` must be a finite number > 1; got {growth_factor!r}")
        backoff_factor = _positive_finite(backoff_factor, "backoff_factor")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"`backoff_factor` must be in the open interval (0, 1); got {backoff_factor!r}")
        self.growth_interval = _positive_int(growth_interval, "growth_interval")
        self.hysteresis = _positive_int(hysteresis, "hysteresis")
        if min_loss_scale is None:
            min_scale = DEFAULT_MIN_LOSS_SCALE
        else:
            min_scale = _positive_finite(min_loss_scale, "min_loss_scale")
        max_scale = _positive_finite(max_loss_scale, "max_loss_scale")
        if min_scale > max_scale:
            raise ValueError(
                f"`min_loss_scale` ({min_scale}) must be <= `max_loss_scale` ({max_scale}); "
                "the default floor is 1.0"
            )

        self.dynamic = spec == "dynamic"
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_loss_scale = min_scale
        self.max_loss_scale = max_scale
        self._scale = min(max(init_scale, min_scale), max_scale) if self.dynamic else spec
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        self.overflows_in_a_row = 0
        self.total_overflows = 0
        self.steps = 0

    @property
    def scale(self) -> float:
        """The current loss scale (a Python float)."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """1 / scale: the factor that unscales gradients."""
        return 1.0 / self._scale

    @property
    def growth_tracker(self) -> int:
        """Clean steps in a row since the last growth or overflow."""
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows still tolerated before the next backoff (0: every overflow backs off)."""
        return self._hysteresis_tracker

    def update(self, found_inf: Any) -> None:
        """Advance by one optimizer step; ``found_inf`` is truthy when that step's grads overflowed."""
        found_inf = bool(found_inf)
        self.steps += 1
        if found_inf:
            self.overflows_in_a_row += 1
            self.total_overflows += 1
        else:
            self.overflows_in_a_row = 0
        if not self.dynamic:
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker = max(self._hysteresis_tracker - 1, 0)
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_loss_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = min(self._scale * self.growth_factor, self.max_loss_scale)

    def state_dict(self) -> Dict[str, Any]:
        """All mutable state (plain Python values), enough to resume the trajectory exactly."""
        return {
            "dynamic": self.dynamic,
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
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
        if self.dynamic:
            saved = _positive_finite(float(state_dict["scale"]), "state_dict['scale']")
            self._scale = min(max(saved, self.min_loss_scale), self.max_loss_scale)
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
        self.overflows_in_a_row = int(state_dict.get("overflows_in_a_row", 0))
        self.total_overflows = int(state_dict.get("total_overflows", 0))
        self.steps = int(state_dict.get("steps", 0))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self._scale}, overflows_in_a_row={self.overflows_in_a_row})"
