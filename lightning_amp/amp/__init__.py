"""Framework-free mixed-precision core: opt levels, loss scaling, cast lists."""
from lightning_amp.amp.casts import (
    UnsafeHalfOpError,
    active_cast,
    cast_context,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
    unregister_function,
)
from lightning_amp.amp.levels import LEVEL_DEFAULTS, OPT_LEVELS, AmpProperties, resolve_dtype, resolve_properties
from lightning_amp.amp.runtime import AmpRuntime
from lightning_amp.amp.scaler import LossScaler

__all__ = [
    "LEVEL_DEFAULTS",
    "OPT_LEVELS",
    "AmpProperties",
    "AmpRuntime",
    "LossScaler",
    "UnsafeHalfOpError",
    "active_cast",
    "cast_context",
    "float_function",
    "half_function",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "resolve_dtype",
    "resolve_properties",
    "unregister_function",
]
