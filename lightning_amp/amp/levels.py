"""Apex's optimisation levels O0-O3 as frozen property records, and their validation.

Level defaults (apex's table, plus two O2 options of lightning-amp; ``dtype`` is the *half* dtype
the level computes in):

======  ==========  ========  ===================  ==============  ==========  ==================  ============  ===========
level   cast_model  autocast  keep_batchnorm_fp32  fp32_params     loss_scale  cast_model_outputs  half_buffers  norm_policy
======  ==========  ========  ===================  ==============  ==========  ==================  ============  ===========
O0      False       False     False                False           1.0         None                False         None
O1      False       True      False                False           "dynamic"   None                False         None
O2      True        True      True                 True            "dynamic"   torch.float32       False         "half"
O3      True        False     False                False           1.0         None                True          None
======  ==========  ========  ===================  ==============  ==========  ==================  ============  ===========

``fp32_params`` is what apex's ``master_weights`` keyword sets (the keyword keeps apex's name): with a cast
model, the module's own params stay fp32 and are what the optimizer steps; there is no separate master
copy (unlike ``FusedAdam(master_weights=True)``, which keeps an fp32 copy of each half param in its state).

Decisions where apex left room:

* O0 is plain fp32: any valid ``dtype`` request (a half dtype, "auto", or float32) is accepted
  and ``dtype`` becomes ``torch.float32``; an *unknown* dtype is still an error.
* With bfloat16 the default loss scale is 1.0 (scaling off: bf16 has fp32's exponent range);
  an explicit ``loss_scale`` (a number or "dynamic") is honoured.
* Dynamic-scaler keywords (``init_scale``, ``growth_factor``, ...) with a static scale do nothing:
  with an explicit numeric ``loss_scale`` that is a contradiction and raises; when the static scale
  is the level's or bfloat16's default, :func:`~lightning_amp.amp.scaler.check_scaler_keywords` warns (a dtype "auto" resolves
  per device, so portable code may meet either).
* apex's own examples pass ``loss_scale`` and ``keep_batchnorm_fp32`` from argparse, as strings; the
  strings apex took mean what they meant there: "dynamic", a number ("128.0"), "True" and "False"
  (also for ``master_weights``). Other spellings ("true", "Dynamic") raise, as in apex.
* O0 and O1 never cast the model, so ``master_weights=True`` or any explicit
  ``keep_batchnorm_fp32`` (True or False) is a contradiction and raises, as apex did.
  ``master_weights=False`` is accepted (it is the level's value).
* ``half_buffers`` and ``norm_policy`` are O2's (:mod:`~lightning_amp.amp.forward`): an explicit value at
  O0/O1 raises; O3 (a pure half model) accepts only ``half_buffers=True``, and so does O2 with
  ``master_weights=False``; ``norm_policy`` is for O2 alone, and its "fp32" needs
  ``keep_batchnorm_fp32`` (O2 computes a half BatchNorm over fp32 Parameters through its op policy).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Mapping, Optional, Union

import torch

from lightning_amp._dtype_names import AUTO, FP32_NAMES, HALF_DTYPE_NAMES, half_dtype, half_dtype_spellings

LossScaleSpec = Union[float, str]

OPT_LEVELS = ("O0", "O1", "O2", "O3")

_DTYPE_NAMES: Mapping[str, torch.dtype] = MappingProxyType(
    {name: getattr(torch, dtype) for name, dtype in HALF_DTYPE_NAMES.items()})
_ALLOWED_DTYPES = f'{half_dtype_spellings()}, torch.float16, torch.bfloat16 or "auto"'
_OUTPUT_DTYPE_NAMES: Mapping[str, torch.dtype] = MappingProxyType(
    {**_DTYPE_NAMES, **dict.fromkeys(FP32_NAMES, torch.float32), "float64": torch.float64, "double": torch.float64}
)


@dataclass(frozen=True)
class AmpProperties:
    """The resolved, immutable properties of one opt level.

    opt_level: "O0".."O3". dtype: the half dtype computed in (torch.float32 for O0).
    cast_model: the model computes in ``dtype`` inside forward (O2, O3); its params are cast to ``dtype``
    in place unless ``fp32_params``.
    autocast: forward runs under ``torch.autocast(dtype)`` (O1 with the registered cast lists; O2 with
    its ``norm_policy``, see :mod:`lightning_amp.amp.forward`).
    keep_batchnorm_fp32: BatchNorm layers keep fp32 params and statistics and compute in fp32.
    fp32_params: with ``cast_model``, the module's params stay fp32 (what the optimizer steps, what
    checkpoints hold, what ``module.weight`` is) and autocast gives forward their half copies; set by
    apex's ``master_weights`` keyword (no separate master copy exists).
    loss_scale: a positive static scale, or "dynamic". cast_model_outputs: dtype the model's
    floating outputs are cast to, or None to leave them alone.
    half_buffers: the model's floating buffers are stored in ``dtype`` (else they keep the dtype the
    model gave them); BatchNorm's follow ``keep_batchnorm_fp32``.
    norm_policy: O2's forward: "half" runs norms (LayerNorm, GroupNorm, RMSNorm), softmax and the
    elementwise math torch's autocast upcasts in the activations' half dtype, as under ``bf16-true``;
    "fp32" leaves torch's autocast lists as they are, as under ``bf16-mixed``. None below O2.
    """

    opt_level: str
    dtype: torch.dtype
    cast_model: bool
    autocast: bool
    keep_batchnorm_fp32: bool
    fp32_params: bool
    loss_scale: LossScaleSpec
    cast_model_outputs: Optional[torch.dtype]
    half_buffers: bool = False
    norm_policy: Optional[str] = None

    @property
    def master_weights(self) -> bool:
        """Deprecated: :attr:`fp32_params` (the module's own params stay fp32; no master copy exists)."""
        warnings.warn("AmpProperties.master_weights is deprecated: use AmpProperties.fp32_params (the module's own "
                      "params stay fp32; there is no separate master copy)", DeprecationWarning, stacklevel=2)
        return self.fp32_params

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the loss scale adapts to overflows."""
        return self.loss_scale == "dynamic"

    @property
    def scaling_enabled(self) -> bool:
        """False when the loss is never multiplied (a static scale of exactly 1.0)."""
        return self.dynamic_loss_scale or self.loss_scale != 1.0


O0 = AmpProperties("O0", torch.float32, False, False, False, False, 1.0, None)
O1 = AmpProperties("O1", torch.float16, False, True, False, False, "dynamic", None)
O2 = AmpProperties("O2", torch.float16, True, True, True, True, "dynamic", torch.float32, norm_policy="half")
O3 = AmpProperties("O3", torch.float16, True, False, False, False, 1.0, None, half_buffers=True)

NORM_POLICIES = ("half", "fp32")

LEVEL_DEFAULTS: Mapping[str, AmpProperties] = MappingProxyType({"O0": O0, "O1": O1, "O2": O2, "O3": O3})

LEVEL_SUMMARIES: Mapping[str, str] = MappingProxyType({
    "O0": "fp32 everything (a baseline; non-finite grads are still skipped).",
    "O1": "fp32 model, forward under autocast plus the cast lists, dynamic loss scale (fp16).",
    "O2": "fp32 params, forward under autocast with norms, softmax and activations kept half (BatchNorm fp32), "
          "fp32 grads and update, dynamic loss scale (fp16).",
    "O3": "pure half (optionally BatchNorm fp32 with keep_batchnorm_fp32=True), static scale 1.0.",
})
"""One line per level, for the documentation of the per-level plugin classes."""


# The names each argument takes, as annotations (built from the tables above): LightningCLI (jsonargparse)
# checks them when it parses a config or a command line, so a bad value is a usage error there, not a
# traceback. Level names are matched case-insensitively (both spellings listed).
OptLevelName = Literal[(*OPT_LEVELS, *(level.lower() for level in OPT_LEVELS))]  # type: ignore[misc]
DtypeName = Literal[("auto", *_DTYPE_NAMES, *FP32_NAMES)]  # type: ignore[misc]
OutputDtypeName = Literal[tuple(_OUTPUT_DTYPE_NAMES)]  # type: ignore[misc]
NormPolicyName = Literal[NORM_POLICIES]  # type: ignore[misc]


def resolve_dtype(dtype: Union[str, torch.dtype], device_type: str = "cpu") -> torch.dtype:
    """Map a user dtype request to torch.float16 or torch.bfloat16.

    "auto" gives bfloat16 on CPU and on CUDA devices that support it, float16 elsewhere.
    Raises ValueError naming ``dtype`` and the allowed values for anything else.
    """
    if isinstance(dtype, torch.dtype) and dtype in (torch.float16, torch.bfloat16):
        return dtype
    name = half_dtype(dtype)  # the plugins' names, shared with `lightning-amp bench --dtype`
    if name is not None:
        return _auto_dtype(device_type) if name == AUTO else getattr(torch, name)
    raise ValueError(f"`dtype` must be one of {_ALLOWED_DTYPES}; got {dtype!r}")


def _auto_dtype(device_type: str) -> torch.dtype:
    if device_type == "cpu":
        return torch.bfloat16
    # native bf16 only: by default torch counts the bf16 a V100 or T4 emulates (slowly), where float16 is the choice
    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return torch.float16


def _is_fp32_request(dtype: object) -> bool:
    if isinstance(dtype, torch.dtype):
        return dtype == torch.float32
    return isinstance(dtype, str) and dtype.strip().lower() in FP32_NAMES


def _check_opt_level(opt_level: object) -> str:
    if isinstance(opt_level, str) and opt_level.strip().upper() in LEVEL_DEFAULTS:
        return opt_level.strip().upper()
    hint = ""
    if isinstance(opt_level, str) and opt_level.strip().startswith("0"):
        hint = " (the prefix is the letter O, not the digit zero)"
    raise ValueError(f"`opt_level` must be one of O0, O1, O2, O3{hint}; got {opt_level!r}")


def check_loss_scale(loss_scale: object, name: str = "loss_scale") -> LossScaleSpec:
    """Validate a loss-scale spec: "dynamic" or a positive finite number (returned as float). A number
    given as a string (``"128.0"``, as apex's examples pass it from argparse, and apex took it) counts
    as that number."""
    if isinstance(loss_scale, str):
        if loss_scale == "dynamic":
            return "dynamic"
        try:
            loss_scale = float(loss_scale)
        except ValueError:
            pass
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        value = float(loss_scale)
        if value > 0 and math.isfinite(value):
            return value
    raise ValueError(f'`{name}` must be "dynamic" or a positive finite number (also as a string, e.g. "128.0"); '
                     f"got {loss_scale!r}")


_APEX_BOOL_STRINGS = MappingProxyType({"True": True, "False": False})


def _check_optional_bool(value: object, name: str) -> Optional[bool]:
    """None, True or False; apex's strings "True"/"False" (from argparse) mean True/False."""
    if isinstance(value, str) and value in _APEX_BOOL_STRINGS:
        return _APEX_BOOL_STRINGS[value]
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"`{name}` must be True, False or None (the level's default), or apex's strings "
                     f'"True"/"False"; got {value!r}')


def _check_norm_policy(value: object, opt_level: str) -> Optional[str]:
    if value is None:
        return None
    if opt_level != "O2":
        raise ValueError(f"`norm_policy` applies to opt_level O2 only (its forward under autocast); got "
                         f"{value!r} with {opt_level}. Leave it None there.")
    if isinstance(value, str) and value.strip().lower() in NORM_POLICIES:
        return value.strip().lower()
    raise ValueError(f'`norm_policy` must be "half" (norms, softmax and activations in the half dtype, as '
                     f'bf16-true), "fp32" (torch\'s autocast lists, as bf16-mixed) or None; got {value!r}')


def _check_output_dtype(value: object) -> Optional[torch.dtype]:
    if value is None:
        return None
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str) and value.strip().lower() in _OUTPUT_DTYPE_NAMES:
        return _OUTPUT_DTYPE_NAMES[value.strip().lower()]
    raise ValueError(
        "`cast_model_outputs` must be None or a floating torch dtype (or its name, e.g. \"float32\"); "
        f"got {value!r}"
    )


def resolve_properties(
    opt_level: str,
    dtype: Union[str, torch.dtype] = "auto",
    loss_scale: Optional[LossScaleSpec] = None,
    keep_batchnorm_fp32: Optional[bool] = None,
    master_weights: Optional[bool] = None,
    cast_model_outputs: Optional[torch.dtype] = None,
    half_buffers: Optional[bool] = None,
    norm_policy: Optional[str] = None,
    device_type: str = "cpu",
) -> AmpProperties:
    """Resolve one opt level's properties: level defaults, then explicit overrides.

    ``None`` means "the level's default". Raises ValueError naming the offending argument
    and its allowed values for unknown levels/dtypes, bad scales, and overrides that
    contradict the level (O0/O1 with ``master_weights=True``, ``keep_batchnorm_fp32`` or ``half_buffers``
    set; ``half_buffers=False`` for a whole half model; ``norm_policy`` below or above O2).
    """
    level = LEVEL_DEFAULTS[_check_opt_level(opt_level)]
    keep_batchnorm_fp32 = _check_optional_bool(keep_batchnorm_fp32, "keep_batchnorm_fp32")
    master_weights = _check_optional_bool(master_weights, "master_weights")
    output_dtype = _check_output_dtype(cast_model_outputs)
    half_buffers = _check_optional_bool(half_buffers, "half_buffers")
    policy = _check_norm_policy(norm_policy, level.opt_level)
    explicit_scale = None if loss_scale is None else check_loss_scale(loss_scale)

    if level.opt_level == "O0" and _is_fp32_request(dtype):
        half = torch.float32
    else:
        half = resolve_dtype(dtype, device_type)

    if not level.cast_model:
        if master_weights:
            raise ValueError(
                f"`master_weights=True` is not allowed with opt_level {level.opt_level}: the model's weights "
                "stay fp32 there, so they already are the master weights. Allowed: None or False "
                "(use O2 for fp32 masters of a half model)."
            )
        if keep_batchnorm_fp32 is not None:
            raise ValueError(
                f"`keep_batchnorm_fp32` must be None with opt_level {level.opt_level}: the model is not cast, "
                f"so BatchNorm already runs in fp32 (got {keep_batchnorm_fp32!r}). It applies to O2 and O3."
            )
        if half_buffers is not None:
            raise ValueError(
                f"`half_buffers` must be None with opt_level {level.opt_level}: the model is not cast, so its "
                f"buffers keep their dtype (got {half_buffers!r}). It applies to O2 (and O3, where it is True)."
            )
    masters = level.fp32_params if master_weights is None else master_weights
    keep_bn = level.keep_batchnorm_fp32 if keep_batchnorm_fp32 is None else keep_batchnorm_fp32
    if policy == "fp32" and masters and not keep_bn:
        raise ValueError(
            '`keep_batchnorm_fp32=False` with `norm_policy="fp32"`: half BatchNorm over fp32 Parameters is computed '
            'by O2\'s op policy, which "fp32" turns off. Use norm_policy="half" or keep_batchnorm_fp32=True.'
        )
    if level.cast_model and not masters and half_buffers is False:
        raise ValueError(
            f"`half_buffers=False` needs fp32 master weights: with opt_level {level.opt_level} and "
            "master_weights=False the whole model, buffers included, is half. Allowed: None or True "
            "(or O2 with master weights for fp32 buffers)."
        )

    if level.opt_level == "O0":
        half = torch.float32

    if explicit_scale is not None:
        scale = explicit_scale
    elif half == torch.bfloat16:
        scale = 1.0
    else:
        scale = level.loss_scale

    return dataclasses.replace(
        level,
        dtype=half,
        loss_scale=scale,
        keep_batchnorm_fp32=keep_bn,
        fp32_params=masters,
        cast_model_outputs=level.cast_model_outputs if output_dtype is None else output_dtype,
        half_buffers=(level.cast_model and not masters) if half_buffers is None else half_buffers,
        norm_policy=level.norm_policy if policy is None else policy,
    )
