"""AmpRuntime: one opt level applied to one model and its optimizers, framework-free.

The object both Lightning plugins hold (``plugin.amp``) and a plain PyTorch loop can use itself::

    amp = AmpRuntime("O2", dtype="bfloat16")
    amp.prepare(model)                       # cast in place for the level
    amp.connect([optimizer], named_params(model))
    with amp.forward_context():
        loss = loss_fn(model(amp.convert_input(batch)), target)
    with amp.backward_context():
        amp.scale_loss(loss).backward()
    amp.step(optimizer)                      # unscale, agree on inf/nan, step or skip on the device
    amp.release()                            # the model handed back plain

Lifecycle: ``resolve_for(device_type)`` (optional: dtype "auto" and the forward's autocast device) ->
``prepare`` -> ``connect``/``add_optimizer`` -> per step ``forward_context``, ``scale_loss`` under
``backward_context``, ``step`` -> ``release``. Policy lives in the modules this calls:
:mod:`~lightning_amp.amp.levels` (what the level is), :mod:`~lightning_amp.amp.module_cast` (the model),
:mod:`~lightning_amp.amp.forward` (the forward), :class:`~lightning_amp.amp.engine.AmpEngine` (the
optimizers, their scalers and steps), :mod:`~lightning_amp.amp.release` (the end of a run).

O2's op policy (:mod:`~lightning_amp.amp.o2_policy`) is registered process-wide while held:
``prepare(module, hold_policy=True)`` holds it until :meth:`release` (a Trainer run);
``hold_policy=False`` holds it for each forward context only (Fabric, which has no end of run); a
recomputing backward holds it for its own duration either way.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
from torch import Tensor
from torch.nn import Module

from lightning_amp.amp import forward as amp_forward
from lightning_amp.amp.engine import AmpEngine
from lightning_amp.amp.fsdp2 import fsdp2_half_compute_, is_fsdp2
from lightning_amp.amp.levels import AmpProperties, LossScaleSpec, resolve_properties
from lightning_amp.amp.module_cast import (cast_floating, cast_module_, cast_outputs_hook, default_dtype,
                                           prepare_o2_module_)
from lightning_amp.amp.o2_policy import PolicyHold, held as held_o2_policy, hold as hold_o2_policy
from lightning_amp.amp.recompute import recompute_context
from lightning_amp.amp.release import release_module_
from lightning_amp.amp.scaler import SCALER_DEFAULTS, LossScaler, check_scaler_keywords
from lightning_amp.amp.step import OptimizerStep


def named_params(module: Module) -> Dict[Tensor, List[str]]:
    """Every param of ``module`` -> all of its names (shared params have several): for messages."""
    names: Dict[Tensor, List[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return names


def casts_batch(props: AmpProperties) -> bool:
    """Whether the batch's floating tensors are cast to half before forward: the pure half model (O3)."""
    return props.cast_model and not props.autocast


class AmpRuntime:
    """One opt level's runtime (see the module docstring).

    Args:
        opt_level, dtype, loss_scale, keep_batchnorm_fp32, master_weights, cast_model_outputs, half_buffers,
            norm_policy: the level and its overrides (:func:`~lightning_amp.amp.levels.resolve_properties`).
        scaler_kwargs: the dynamic :class:`LossScaler` keywords (:data:`~lightning_amp.amp.scaler.SCALER_DEFAULTS`
            for those left out).
        combine_grad, fused_update: as :class:`~lightning_amp.amp.step.OptimizerStep`.
        device_type: where the model computes ("cpu", "cuda", ...); None: "cuda" when available, else "cpu".
        warn: how warnings are issued (the Lightning plugins pass a rank-zero warn).
        scaler_keywords_for_dynamic_only: the dynamic-scaler keywords configure the dynamic levels this runtime may
            change to (:meth:`change_level`, the precision ladder): with a static scale they are kept, not refused.

    Raises ValueError naming the argument for any invalid option, at construction.
    """

    def __init__(self, opt_level: str = "O1", dtype: Union[str, torch.dtype] = "auto",
                 loss_scale: Optional[LossScaleSpec] = None, keep_batchnorm_fp32: Optional[bool] = None,
                 master_weights: Optional[bool] = None, cast_model_outputs: Optional[Union[str, torch.dtype]] = None,
                 half_buffers: Optional[bool] = None, norm_policy: Optional[str] = None,
                 scaler_kwargs: Optional[Dict[str, Any]] = None, combine_grad: bool = False,
                 fused_update: bool = True, device_type: Optional[str] = None,
                 warn: Callable[[str], Any] = warnings.warn, scaler_keywords_for_dynamic_only: bool = False) -> None:
        for name, value in (("combine_grad", combine_grad), ("fused_update", fused_update)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False; got {value!r}")
        unknown = sorted(set(scaler_kwargs or ()) - set(SCALER_DEFAULTS))
        if unknown:
            raise TypeError(f"unknown loss-scaler keywords {unknown}; allowed: {sorted(SCALER_DEFAULTS)}")
        #: the level as asked for (None: the level's default), resolved per device by :meth:`resolve_for`
        self.request: Dict[str, Any] = dict(opt_level=opt_level, dtype=dtype, loss_scale=loss_scale,
                                            keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
                                            cast_model_outputs=cast_model_outputs, half_buffers=half_buffers,
                                            norm_policy=norm_policy)
        self.scaler_kwargs: Dict[str, Any] = {**SCALER_DEFAULTS, **(scaler_kwargs or {})}
        self.combine_grad, self.fused_update, self.warn = combine_grad, fused_update, warn
        self.scaler_keywords_for_dynamic_only = scaler_keywords_for_dynamic_only
        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        self.properties = self._resolve(self.device_type)
        self.engine = AmpEngine(self.new_scaler, self.check_optimizer, combine_grad, fused_update, warn=warn)
        self.module: Optional[Module] = None  # the model prepare() cast, until release()
        self._policy: Optional[PolicyHold] = None  # O2's op policy held from prepare() to release()
        self._policy_per_forward = False
        self._fsdp2_checked = False  # see _half_params_by_fsdp2

    # ---- the level ---------------------------------------------------------------------

    def _resolve(self, device_type: str) -> AmpProperties:
        props = resolve_properties(**self.request, device_type=device_type)
        LossScaler(props.loss_scale, **self.scaler_kwargs)  # validates the scaler keywords now
        if not self.scaler_keywords_for_dynamic_only:
            check_scaler_keywords(props, self.request["loss_scale"], self.scaler_kwargs, self.warn)
        return props

    def resolve_for(self, device_type: str) -> None:
        """The model computes on ``device_type``: dtype "auto" and the level's defaults resolve for it."""
        if device_type != self.device_type:
            self.device_type = device_type
            self.properties = self._resolve(device_type)

    def new_scaler(self) -> LossScaler:
        """A fresh LossScaler for the level (one per optimizer)."""
        return LossScaler(self.properties.loss_scale, **self.scaler_kwargs)

    def check_optimizer(self, index: int, optimizer: torch.optim.Optimizer) -> None:
        """ValueError naming ``optimizers[index]`` when the level cannot step it: LBFGS re-evaluates its
        closure inside ``step()``, which loss scaling cannot wrap."""
        props = self.properties
        if isinstance(optimizer, torch.optim.LBFGS) and props.scaling_enabled:
            raise ValueError(
                f"optimizers[{index}] ({type(optimizer).__name__}) re-evaluates its closure inside step() and cannot "
                f"be used with loss scaling (opt_level={props.opt_level}, loss_scale={props.loss_scale!r}). "
                "Allowed: loss_scale=1.0 (e.g. O0, O3, or O1/O2 with bfloat16)."
            )

    @property
    def loss_scale(self) -> float:
        """Current loss scale of the first optimizer (the initial scale before one is connected)."""
        return self.engine.scalers[0].scale if self.engine.scalers else self.new_scaler().scale

    # ---- the model ---------------------------------------------------------------------

    def init_context(self) -> contextlib.AbstractContextManager:
        """What a model is created in (``Trainer.init_module``, ``Fabric.init_module``): where the level casts
        the params to half (O3), the half dtype is torch's default dtype inside, restored on exit, so the
        params are created half (as under Lightning's ``bf16-true``/``16-true``); otherwise nothing (fp32
        params, as under Lightning's mixed precisions)."""
        props = self.properties
        if props.cast_model and not props.fp32_params:
            return default_dtype(props.dtype)
        return contextlib.nullcontext()

    def prepare(self, module: Module, fsdp2: bool = False, hold_policy: bool = True) -> Module:
        """Cast ``module`` in place for the level and hook its outputs; returns it. O0: fp32. Master weights
        (O2): params fp32, buffers as the model has them (``half_buffers``), BatchNorm fp32 if kept. O3: half.

        ``fsdp2``: FSDP2 has sharded it, so under master weights FSDP2's policy all-gathers the fp32 shards
        as half params (:mod:`~lightning_amp.amp.fsdp2`); otherwise that is checked at the first forward.
        ``hold_policy``: O2's op policy stays registered until :meth:`release` (else per forward context)."""
        props = self.properties
        self._fsdp2_checked = fsdp2
        if props.opt_level == "O0":
            cast_module_(module, torch.float32)
        elif props.cast_model and props.fp32_params:
            if fsdp2:
                fsdp2_half_compute_(module, props.dtype, props.keep_batchnorm_fp32)  # refuses half params first
            prepare_o2_module_(module, props.dtype, props.keep_batchnorm_fp32, props.half_buffers)
        elif props.cast_model:
            cast_module_(module, props.dtype, props.keep_batchnorm_fp32)
        cast_outputs_hook(module, props.cast_model_outputs)
        self.module = module
        self._release_policy()
        self._policy_per_forward = not hold_policy
        if hold_policy and amp_forward.uses_o2_policy(props):
            self._policy = hold_o2_policy()
        return module

    def release(self) -> None:
        """End of a run: the prepared model handed back plain (:func:`~lightning_amp.amp.release.release_module_`),
        O2's op policy unregistered. Idempotent; :meth:`prepare` makes the model ready again."""
        module, self.module = self.module, None
        if module is not None:
            release_module_(module, self.properties)
        self._release_policy()

    def change_level(self, opt_level: str, loss_scale: Optional[LossScaleSpec]) -> None:
        """Go on at another level that keeps fp32 Parameters (O0, O1, O2: no new Parameters, the optimizers keep
        theirs): the prepared model is released and prepared again at the new level (its forward context and O2's
        op policy hold follow), and every optimizer gets a fresh scaler at ``loss_scale`` (:meth:`AmpEngine.restart`).
        ValueError (nothing changed) when the other options do not fit the new level."""
        old_props, old_request = self.properties, dict(self.request)
        self.request.update(opt_level=opt_level, loss_scale=loss_scale)
        try:
            props = self._resolve(self.device_type)
        except ValueError:
            self.request = old_request
            raise
        if props.cast_model and not props.fp32_params or old_props.cast_model and not old_props.fp32_params:
            self.request = old_request
            raise ValueError(f"change_level: {old_props.opt_level} -> {props.opt_level} would change the Parameters' "
                             "dtype; allowed levels: O0, O1, O2 (fp32 Parameters)")
        module, hold = self.module, not self._policy_per_forward
        if module is not None:
            release_module_(module, old_props)
        self._release_policy()
        self.properties = props
        if module is not None:
            self.prepare(module, hold_policy=hold)
        self.engine.restart()

    def _release_policy(self) -> None:
        if self._policy is not None:
            self._policy.release()
            self._policy = None

    @property
    def holds_policy(self) -> bool:
        """Whether O2's op policy is registered by this runtime now (from :meth:`prepare` to :meth:`release`)."""
        return self._policy is not None

    # ---- forward and backward ----------------------------------------------------------

    def convert_input(self, data: Any, cast_mixed: bool = False) -> Any:
        """O3: the batch's floating tensors become the half dtype, saturating at its range (an fp32
        ``finfo.min`` mask stays finite). O1 and O2 leave it alone (autocast casts where an op needs it, as
        the Trainer's ``bf16-mixed``), unless ``cast_mixed``: then they cast it so too, as Fabric's
        ``bf16-mixed``/``16-mixed`` cast a forward's floating inputs. O0 never casts."""
        props = self.properties
        if casts_batch(props) or (cast_mixed and props.autocast):
            return cast_floating(data, props.dtype, saturating=True)
        return data

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """The level's forward: :func:`lightning_amp.amp.forward.forward_context` on :attr:`device_type`."""
        if not self._fsdp2_checked:
            self._half_params_by_fsdp2()
        with self._policy_for_a_block(), amp_forward.forward_context(self.properties, self.device_type):
            yield

    def backward_context(self) -> contextlib.AbstractContextManager:
        """What a backward runs in: forwards re-run inside it (activation checkpointing) see the level's
        forward dtypes (:mod:`lightning_amp.amp.recompute`)."""
        state = amp_forward.recompute_state(self.properties)  # O2's holds the op policy for the backward itself
        return contextlib.nullcontext() if state is None else recompute_context(state)

    def _policy_for_a_block(self) -> contextlib.AbstractContextManager:
        if self._policy_per_forward and amp_forward.uses_o2_policy(self.properties):
            return held_o2_policy()
        return contextlib.nullcontext()

    def _half_params_by_fsdp2(self) -> None:
        """At the first forward: if FSDP2 sharded the model after :meth:`prepare` (Fabric's
        ModelParallelStrategy runs its ``parallelize_fn`` then), under master weights FSDP2's policy
        all-gathers the fp32 shards as half params from now on (:mod:`lightning_amp.amp.fsdp2`)."""
        self._fsdp2_checked = True
        props, module = self.properties, self.module
        if module is not None and props.cast_model and props.fp32_params and is_fsdp2(module):
            fsdp2_half_compute_(module, props.dtype, props.keep_batchnorm_fp32)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss`` times the scale of its backward: :meth:`AmpEngine.scale_loss`."""
        return self.engine.scale_loss(loss)

    # ---- optimizers --------------------------------------------------------------------

    def connect(self, optimizers: List[torch.optim.Optimizer], param_names: Dict[Tensor, List[str]]) -> None:
        """A scaler and a step for every optimizer (``param_names``: param -> its names, for messages)."""
        self.engine.connect(optimizers, param_names)

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerStep:
        """Connect one more optimizer (Fabric's plugin connects each the first time it sees it)."""
        return self.engine.add_optimizer(optimizer)

    def state_of(self, optimizer: torch.optim.Optimizer) -> OptimizerStep:
        """The step of ``optimizer`` (wrapped or not); one not connected gets a scaler of its own."""
        return self.engine.state_of(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, after_unscale: Callable[[], None] = lambda: None,
             grads_read: bool = False, **step_kwargs: Any) -> None:
        """Unscale (or only check), agree on inf/nan across ranks, ``after_unscale()``, then step or skip on
        the device: :meth:`AmpEngine.step`."""
        self.engine.step(optimizer, after_unscale, grads_read, **step_kwargs)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s grads by their loss scale now (idempotent until the next backward)."""
        self.engine.state_of(optimizer).unscale()
