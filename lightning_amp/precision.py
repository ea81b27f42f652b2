"""AmpPrecision and AmpO0Plugin..AmpO3Plugin: the thin Lightning adapter over ``lightning_amp.amp``.

Hook order (Lightning's strategies): ``convert_module`` (cast the model in place) ->
``connect`` (fp32 masters into the optimizers, one LossScaler per optimizer, skip-aware LR
schedulers) -> per step ``convert_input``, ``forward_context``, ``pre_backward`` (loss * scale),
``post_backward`` (O2: half grads added into the fp32 master grads), ``optimizer_step``.

``optimizer_step``: run the closure, unscale (into the masters under O2), agree on
``found_inf`` across ranks (all-reduce MAX), then ``_after_closure`` (hooks and clipping see
unscaled grads). On inf/nan the step is skipped: params, optimizer state and the LR scheduler
(``interval="step"``) stay as they were, grads are dropped, the offending param names are
logged at debug level (a one-line warning after every ``OVERFLOW_WARN_AFTER`` overflows in a
row) and the scale backs off. Non-finite grads are checked and skipped at *every* level and
scale, static 1.0 and bf16 included: no inf/nan ever reaches the params.

Optimizers that unscale inside their kernel (``_step_supports_amp_scaling``, e.g.
``torch.optim.AdamW(fused=True)`` or ``lightning_amp.FusedAdam``) get ``grad_scale`` /
``found_inf`` as ``torch.amp.GradScaler`` hands them (``on_before_optimizer_step`` then sees
scaled grads, as with GradScaler), unless clipping is requested: then the grads are unscaled
first and the optimizer steps normally (clipping always works).

Under O2 the grads live on the fp32 masters once a backward has finished (``on_after_backward``
still sees the half ``.grad``; ``on_before_optimizer_step``, clipping and the optimizer see the
masters' grads): inspect them through :func:`main_params` (``trainer.optimizers[i]``'s params),
not through the module's half params, whose ``.grad`` is None by then.

Several optimizers (manual optimization): each has its own scaler. A backward uses the
smallest scale among the optimizers whose params require grad, and grads already held by such
an optimizer at another scale are re-based first, so accumulated grads always carry one
known factor.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Generator
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

import lightning.pytorch as pl
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_amp.amp.casts import cast_context
from lightning_amp.amp.gate import make_scheduler_skip_aware
from lightning_amp.amp.levels import AmpProperties, resolve_properties
from lightning_amp.amp.master import MasterParams, load_masters, masters_into_state_dict, optimizer_params
from lightning_amp.amp.module_cast import cast_floating, cast_module_, cast_outputs_hook
from lightning_amp.amp.scaler import LossScaler
from lightning_amp.amp.step import OptimizerStep, agree, all_reduce_master_grads, unscales_in_step

log = logging.getLogger(__name__)

OVERFLOW_WARN_AFTER = 10
"""Overflows in a row of one optimizer after which (and every so many) a one-line warning is issued."""

_STATE_VERSION = 1


def main_params(optimizer: Optimizer) -> Generator[Tensor, None, None]:
    """The params ``optimizer`` steps on: the fp32 masters under O2 (what clipping must see)."""
    yield from optimizer_params(optimizer)


def _unwrap(model: Module) -> Module:
    """The LightningModule inside a strategy wrapper (DDP, ...)."""
    while not isinstance(model, pl.LightningModule) and isinstance(getattr(model, "module", None), Module):
        model = model.module
    return model


# --------------------------------------------------------------------------------------
# The plugin
# --------------------------------------------------------------------------------------


class AmpPrecision(Precision):
    """Apex-style mixed precision (opt levels O0-O3) as a Lightning precision plugin.

    Args:
        opt_level: "O0" (fp32), "O1" (autocast + cast lists), "O2" (half model, fp32 BatchNorm,
            fp32 master weights), "O3" (pure half).
        dtype: "float16", "bfloat16", a torch dtype, or "auto" (bfloat16 on CPU and on CUDA
            devices that support it, else float16).
        loss_scale: a positive static scale or "dynamic"; None is the level's default (1.0 with
            bfloat16).
        keep_batchnorm_fp32, master_weights, cast_model_outputs: overrides of the level's
            defaults (None keeps them); contradictions raise ValueError.
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
        min_loss_scale, max_loss_scale: the dynamic :class:`~lightning_amp.amp.scaler.LossScaler`.
        combine_grad: the grads of the params each optimizer steps on (the fp32 masters under O2)
            live as views in one flat buffer per (device, dtype)
            (:class:`~lightning_amp.amp.flat.FlatGradBuffer`); unscaling is one call per buffer.
        fused_update: a plain ``torch.optim.Adam``/``AdamW``/``SGD`` is stepped by lightning_amp's
            fused kernels (unscaled grads, skip decided on the device, under O2 the master update
            and the half copy in one pass; :mod:`lightning_amp.amp.kernel_step` says which group
            options qualify). False: the optimizer's own ``step()`` runs, and the skip is decided
            on the host.
        allow_missing_masters: under master weights, a param whose checkpoint entry is missing or
            has another shape raises ValueError on save and on load (naming the params); True
            keeps the current master instead, with a warning naming them.

    Properties: ``loss_scale`` (current scale of the first optimizer), ``loss_scales`` (all),
    ``skipped_steps`` (optimizer steps skipped for non-finite grads), ``properties``.
    """

    def __init__(
        self,
        opt_level: str = "O1",
        dtype: Union[str, torch.dtype] = "auto",
        loss_scale: Optional[Union[float, str]] = None,
        keep_batchnorm_fp32: Optional[bool] = None,
        master_weights: Optional[bool] = None,
        cast_model_outputs: Optional[torch.dtype] = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_loss_scale: Optional[float] = None,
        max_loss_scale: float = 2.0**24,
        combine_grad: bool = False,
        fused_update: bool = True,
        allow_missing_masters: bool = False,
    ) -> None:
        for name, value in (("combine_grad", combine_grad), ("fused_update", fused_update),
                            ("allow_missing_masters", allow_missing_masters)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False; got {value!r}")
        self.combine_grad, self.fused_update, self.allow_missing_masters = combine_grad, fused_update, allow_missing_masters
        self._request = dict(
            opt_level=opt_level,
            dtype=dtype,
            loss_scale=loss_scale,
            keep_batchnorm_fp32=keep_batchnorm_fp32,
            master_weights=master_weights,
            cast_model_outputs=cast_model_outputs,
        )
        self._scaler_kwargs = dict(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
        )
        self._device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._resolve()
        self._scalers: List[LossScaler] = []
        self._states: List[OptimizerStep] = []
        self._skipped_before = 0  # skipped steps restored from a checkpoint
        self._ddp: Optional[Module] = None
        self._local_master_grads = False  # masters hold grads of no_sync backwards, not yet all-reduced
        self._param_names: Dict[Tensor, List[str]] = {}
        self._pending_state: Optional[dict] = None
        #: names of the params whose grads were non-finite at the last skipped step (this rank's view)
        self.last_nonfinite_params: List[str] = []

    # ---- configuration ---------------------------------------------------------------

    def _resolve(self) -> None:
        self._properties = resolve_properties(**self._request, device_type=self._device_type)
        self._new_scaler()  # validates the scaler arguments now
        props = self._properties
        half = "bf16" if props.dtype == torch.bfloat16 else "16"
        if props.opt_level == "O0":
            self.precision = "32-true"
        elif props.opt_level == "O3":
            self.precision = f"{half}-true"
        else:
            self.precision = f"{half}-mixed"

    def _new_scaler(self) -> LossScaler:
        return LossScaler(self._properties.loss_scale, **self._scaler_kwargs)

    def _use_device_type(self, device_type: str) -> None:
        if device_type != self._device_type:
            self._device_type = device_type
            self._resolve()

    @property
    def properties(self) -> AmpProperties:
        """The resolved opt-level properties (dtype "auto" is resolved for the Trainer's device at setup)."""
        return self._properties

    @property
    def loss_scale(self) -> float:
        """Current loss scale of the first optimizer (the initial scale before setup)."""
        return self._scalers[0].scale if self._scalers else self._new_scaler().scale

    @property
    def loss_scales(self) -> List[float]:
        """Current loss scale of every optimizer, in the order of ``trainer.optimizers``."""
        return [s.scale for s in self._scalers]

    @property
    def scalers(self) -> List[LossScaler]:
        """The LossScaler of every optimizer."""
        return list(self._scalers)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because of non-finite gradients (all optimizers; waits for
        the flags of steps still on their way to the host)."""
        for state in self._states:
            state.gate.poll(wait=True)
        return self._skipped_before + sum(s.skipped for s in self._states)

    # ---- model -----------------------------------------------------------------------

    def convert_module(self, module: Module) -> Module:
        """Cast the model in place (O0: fp32; O2/O3: half, BatchNorm fp32 if kept) and hook its outputs."""
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            self._use_device_type(trainer.strategy.root_device.type)
        props = self._properties
        if props.opt_level == "O0":
            cast_module_(module, torch.float32)
        elif props.cast_model:
            cast_module_(module, props.dtype, props.keep_batchnorm_fp32)
            for sub in module.modules():
                if isinstance(sub, _DeviceDtypeModuleMixin):
                    sub._dtype = props.dtype
        cast_outputs_hook(module, props.cast_model_outputs)
        return module

    def convert_input(self, data: Any) -> Any:
        """O2/O3: floating tensors of the batch become the half dtype; other levels leave it alone."""
        if self._properties.cast_model:
            return cast_floating(data, self._properties.dtype)
        return data

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """O1: ``torch.autocast`` plus the registered cast lists; a no-op at other levels."""
        props = self._properties
        if not props.autocast:
            yield
            return
        with torch.autocast(self._device_type, dtype=props.dtype, cache_enabled=False):
            with cast_context(props.dtype, self._device_type):
                yield

    # ---- optimizers ------------------------------------------------------------------

    def connect(self, model: Module, optimizers: List[Optimizer], lr_schedulers: List[Any]) -> tuple:
        """Swap half params for fp32 masters (O2), give each optimizer a scaler, make step schedulers skip-aware."""
        lightning_module = _unwrap(model)
        self._ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        self._param_names = {}
        for name, param in lightning_module.named_parameters(remove_duplicate=False):
            self._param_names.setdefault(param, []).append(name)

        props = self._properties
        registry: Dict[Tensor, Tensor] = {}
        self._states = []
        for index, optimizer in enumerate(optimizers):
            self._check_optimizer(index, optimizer)
            masters = MasterParams(optimizer, registry) if props.master_weights else None
            self._warn_on_vanishing_eps(index, optimizer)
            if index >= len(self._scalers):
                self._scalers.append(self._new_scaler())
            self._states.append(self._new_state(optimizer, self._scalers[index], masters, self.combine_grad))
        if self._pending_state is not None:
            self._load_scaler_states(self._pending_state)
            self._pending_state = None

        for config in lr_schedulers:
            if getattr(config, "interval", "step") == "step":
                make_scheduler_skip_aware(config.scheduler)
        return model, optimizers, lr_schedulers

    def _check_optimizer(self, index: int, optimizer: Optimizer) -> None:
        props = self._properties
        if isinstance(optimizer, LBFGS) and (props.scaling_enabled or props.master_weights):
            raise ValueError(
                f"optimizers[{index}] ({type(optimizer).__name__}) re-evaluates its closure inside step() and cannot "
                f"be used with loss scaling or master weights (opt_level={props.opt_level}, "
                f"loss_scale={props.loss_scale!r}, master_weights={props.master_weights}). Allowed: "
                "loss_scale=1.0 without master weights (e.g. O0, O3, or O1 with bfloat16)."
            )

    @staticmethod
    def _warn_on_vanishing_eps(index: int, optimizer: Optimizer) -> None:
        """A half param stepped directly (no master) with an ``eps`` that is 0 in its dtype divides by zero."""
        for group in optimizer.param_groups:
            eps = group.get("eps")
            if not isinstance(eps, float) or eps <= 0:
                continue
            for param in group["params"]:
                if param.dtype in (torch.float16, torch.bfloat16) and torch.tensor(eps, dtype=param.dtype).item() == 0:
                    rank_zero_warn(
                        f"lightning_amp: optimizers[{index}] ({type(optimizer).__name__}) steps {param.dtype} params "
                        f"directly with eps={eps}, which is 0 in {param.dtype}: its updates can divide by zero and "
                        "write inf/nan into the params. Use O2 (fp32 master weights) or a larger eps."
                    )
                    return

    def _new_state(self, optimizer: Optimizer, scaler: LossScaler, masters: Optional[MasterParams],
                   combine_grad: bool) -> OptimizerStep:
        return OptimizerStep(optimizer, scaler, masters, combine_grad, self.fused_update, on_skip=self._on_skip)

    def _state_of(self, optimizer: Optimizer) -> OptimizerStep:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one
        for state in self._states:
            if state.optimizer is optimizer:
                return state
        # an optimizer the Trainer did not hand to connect(): give it a scaler of its own
        self._check_optimizer(len(self._states), optimizer)
        self._scalers.append(self._new_scaler())
        state = self._new_state(optimizer, self._scalers[-1], None, False)
        self._states.append(state)
        return state

    # ---- backward --------------------------------------------------------------------

    def _backward_scale(self) -> Union[float, Tensor]:
        """The scale of the next backward: a float when static, else the device tensor (no host read)."""
        if not self._states:
            return 1.0
        candidates = self._states
        if len(candidates) > 1:
            candidates = [s for s in self._states if s.requires_grad()] or self._states
        scales = [s.scaler.static_scale if s.scaler.static_scale is not None else s.scaler.scale_tensor
                  for s in candidates]
        if len(scales) == 1 or all(isinstance(x, float) for x in scales):
            scale = scales[0] if len(scales) == 1 else min(scales)
        else:
            scale = torch.stack([torch.as_tensor(x, device=candidates[0].scaler.device) for x in scales]).min()
        for state in candidates:
            state.gate.poll()
            state.rebase(scale, shared=len(candidates) > 1)
        return scale

    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        """Multiply the loss by the current loss scale (computed in fp32) before the backward hooks."""
        scale = self._backward_scale()
        if isinstance(scale, Tensor) or scale != 1.0:
            if tensor.dtype in (torch.float16, torch.bfloat16):
                tensor = tensor.float()
            tensor = tensor * scale
        return super().pre_backward(tensor, module)

    def post_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        """After the user hooks: O2 half grads are added into the fp32 master grads (fp32 accumulation)."""
        closure_loss = super().post_backward(tensor, module)
        self._move_grads_to_masters()
        return closure_loss

    def _move_grads_to_masters(self) -> None:
        with_masters = [s for s in self._states if s.masters is not None]
        if not with_masters:
            return
        synced = self._ddp is None or getattr(self._ddp, "require_backward_grad_sync", True)
        if synced and self._local_master_grads:
            self._local_master_grads = False
            all_reduce_master_grads(with_masters, getattr(self._ddp, "process_group", None))
        for state in with_masters:
            state.masters.accumulate_model_grads_()
        if not synced:
            self._local_master_grads = True

    # ---- optimizer step --------------------------------------------------------------

    @staticmethod
    def _clipping_requested(model: "pl.LightningModule") -> bool:
        if not model.automatic_optimization:
            return False  # manual clipping goes through clip_gradients, which unscales first
        trainer = model._trainer
        if trainer is not None and trainer.gradient_clip_val:
            return True
        return type(model).configure_gradient_clipping is not pl.LightningModule.configure_gradient_clipping

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: "pl.LightningModule",
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Closure, unscale (or inspect), agree on overflow, clip, then step or skip on the device."""
        state = self._state_of(optimizer)
        if isinstance(optimizer, LBFGS):  # allowed only without scaling: needs its closure
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            self._after_closure(model, optimizer)  # backward was skipped (training_step returned None)
            return None
        state.gate.poll(wait=True)  # the previous step's deferred scheduler calls set the lr read below
        factor = state.grad_factor
        in_kernel = (unscales_in_step(optimizer) and state.driver == "protocol" and factor is not None
                     and not (isinstance(factor, float) and factor == 1.0) and not self._clipping_requested(model))
        found_inf = agree(state.inspect() if in_kernel else state.unscale())
        self._after_closure(model, optimizer)
        state.apply(found_inf, in_kernel, **kwargs)
        self._log_metrics(model)
        return closure_result

    def _on_skip(self, state: OptimizerStep) -> None:
        """A skipped step reached the host: name the params, log, warn every OVERFLOW_WARN_AFTER in a row."""
        names = [self._param_names.get(p, [f"<unnamed {tuple(p.shape)}>"])[0] for p in state.nonfinite_params()]
        self.last_nonfinite_params = names
        index = self._states.index(state)
        in_a_row = state.scaler.overflows_in_a_row
        log.debug("lightning_amp: optimizer %d step skipped for non-finite gradients (loss scale %s); params: %s",
                  index, state.scaler.scale, ", ".join(names) or "<on another rank>")
        if in_a_row % OVERFLOW_WARN_AFTER == 0:
            shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
            rank_zero_warn(
                f"lightning_amp: {in_a_row} optimizer steps in a row skipped for non-finite gradients "
                f"(optimizer {index}, loss scale {state.scaler.scale}); non-finite grads in: {shown or 'another rank'}"
            )

    def _log_metrics(self, model: "pl.LightningModule") -> None:
        """Log the scale (a device tensor) and the skipped steps settled so far, on the steps the
        Trainer writes to its logger (``log_every_n_steps``) only."""
        trainer = model._trainer
        if trainer is None or trainer.barebones or model._current_fx_name is None or trainer._results is None:
            return
        if trainer.logger is None or not trainer._logger_connector.should_update_logs:
            return
        scaler = self._scalers[0]
        scale = scaler.static_scale if scaler.static_scale is not None else scaler.scale_tensor.clone()
        skipped = self._skipped_before + sum(s.skipped for s in self._states)
        for name, value in (("amp/loss_scale", scale), ("amp/skipped_steps", float(skipped))):
            model.log(name, value, on_step=True, on_epoch=False, logger=True, batch_size=1)

    # ---- clipping --------------------------------------------------------------------

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the (fp32 master under O2) grads after making sure they are unscaled; fused optimizers too."""
        if clip_val and clip_val > 0:
            self._state_of(optimizer).unscale()
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Divide ``optimizer``'s grads by their loss scale now (idempotent until the next backward)."""
        self._state_of(optimizer).unscale()

    # ---- checkpointing ---------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Scaler state of every optimizer and the skipped-step counts (fp32 masters go in ``state_dict``)."""
        return {
            "version": _STATE_VERSION,
            "opt_level": self._properties.opt_level,
            "loss_scalers": [s.state_dict() for s in self._scalers],
            "skipped_steps": self.skipped_steps,
            "skipped_per_optimizer": [s.skipped for s in self._states],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "loss_scalers" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: `state_dict` must come from an AmpPrecision plugin "
                f"(with a 'loss_scalers' list); got keys {sorted(state_dict) if isinstance(state_dict, dict) else state_dict!r}"
            )
        self._skipped_before = int(state_dict.get("skipped_steps", 0))
        if self._states:
            self._load_scaler_states(state_dict)
        else:
            self._pending_state = state_dict  # applied when connect() creates the scalers

    def _load_scaler_states(self, state_dict: Dict[str, Any]) -> None:
        saved = state_dict["loss_scalers"]
        if len(saved) != len(self._scalers):
            rank_zero_warn(
                f"lightning_amp: the checkpoint holds {len(saved)} loss scaler(s) but there are "
                f"{len(self._scalers)} optimizer(s); restoring the first {min(len(saved), len(self._scalers))}."
            )
        for scaler, scaler_state in zip(self._scalers, saved):
            scaler.load_state_dict(scaler_state)
        for state, skipped in zip(self._states, state_dict.get("skipped_per_optimizer", [])):
            state.skipped = int(skipped)
        self._skipped_before -= sum(s.skipped for s in self._states)  # the rest: optimizers not here now

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        """Under master weights, the checkpoint's ``state_dict`` holds the fp32 master values (exact resume,
        loadable into a plain fp32 model); remaining half tensors there are upcast to fp32.

        Lightning skips this hook for weights-only checkpoints (``save_weights_only=True``): those hold
        the half values (still loadable into an fp32 model, but rounded)."""
        if not self._properties.master_weights:
            return
        model_state = checkpoint.get("state_dict")
        if not isinstance(model_state, dict):
            return
        pairs = [pair for state in self._states if state.masters is not None for pair in state.masters.pairs]
        self._report(masters_into_state_dict(pairs, self._param_names, model_state), "saved")
        for key, value in model_state.items():
            if isinstance(value, Tensor) and value.dtype in (torch.float16, torch.bfloat16):
                model_state[key] = value.float()

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        """Restore the fp32 masters from the checkpoint's ``state_dict``; accept the state of a sibling class."""
        own = type(self).__qualname__
        if own not in checkpoint:
            for key in _PLUGIN_NAMES:
                if key in checkpoint and isinstance(checkpoint[key], dict) and "loss_scalers" in checkpoint[key]:
                    self.load_state_dict(checkpoint[key])
                    break
        model_state = checkpoint.get("state_dict")
        if not isinstance(model_state, dict):
            return
        for state in self._states:
            if state.masters is not None:
                self._report(load_masters(state.masters, self._param_names, model_state), "loaded")

    def _report(self, mismatched: List[str], verb: str) -> None:
        if not mismatched:
            return
        message = (f"lightning_amp: the fp32 masters of {len(mismatched)} param(s) could not be {verb}: the "
                   f"checkpoint's state_dict has no entry of the param's shape for {', '.join(mismatched)}")
        if not self.allow_missing_masters:
            raise ValueError(message + " (pass allow_missing_masters=True to keep the current masters instead)")
        rank_zero_warn(message + "; their current masters are kept (allow_missing_masters=True)")


class AmpO0Plugin(AmpPrecision):
    """Apex O0: fp32 everything (a baseline; non-finite grads are still skipped). Same kwargs as AmpPrecision."""

    def __init__(self, **kwargs: Any) -> None:
        _no_opt_level(kwargs, "AmpO0Plugin")
        super().__init__(opt_level="O0", **kwargs)


class AmpO1Plugin(AmpPrecision):
    """Apex O1: fp32 model, forward under autocast plus the cast lists, dynamic loss scale (fp16)."""

    def __init__(self, **kwargs: Any) -> None:
        _no_opt_level(kwargs, "AmpO1Plugin")
        super().__init__(opt_level="O1", **kwargs)


class AmpO2Plugin(AmpPrecision):
    """Apex O2: half model (BatchNorm fp32), fp32 master weights in the optimizer, dynamic loss scale (fp16)."""

    def __init__(self, **kwargs: Any) -> None:
        _no_opt_level(kwargs, "AmpO2Plugin")
        super().__init__(opt_level="O2", **kwargs)


class AmpO3Plugin(AmpPrecision):
    """Apex O3: pure half (optionally BatchNorm fp32 with keep_batchnorm_fp32=True), static scale 1.0."""

    def __init__(self, **kwargs: Any) -> None:
        _no_opt_level(kwargs, "AmpO3Plugin")
        super().__init__(opt_level="O3", **kwargs)


def _no_opt_level(kwargs: Dict[str, Any], cls_name: str) -> None:
    if "opt_level" in kwargs:
        raise TypeError(f"{cls_name} fixes the opt level; use AmpPrecision(opt_level=...) to choose one")


_PLUGIN_NAMES = ("AmpPrecision", "AmpO0Plugin", "AmpO1Plugin", "AmpO2Plugin", "AmpO3Plugin")

__all__ = ["AmpPrecision", "AmpO0Plugin", "AmpO1Plugin", "AmpO2Plugin", "AmpO3Plugin", "main_params",
           "make_scheduler_skip_aware", "OVERFLOW_WARN_AFTER"]
