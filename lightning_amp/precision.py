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
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

import lightning.pytorch as pl
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_amp.amp.flat import FlatGradBuffer
from lightning_amp.amp import forward as amp_forward
from lightning_amp.amp.levels import AmpProperties, resolve_properties
from lightning_amp.amp.master import (
    MasterParams,
    nonfinite_flags,
    optimizer_grads,
    optimizer_params,
    rescale_grads_,
    unscale_grads_,
)
from lightning_amp.amp.module_cast import cast_floating, cast_module_, cast_outputs_hook
from lightning_amp.amp.scaler import LossScaler

log = logging.getLogger(__name__)

OVERFLOW_WARN_AFTER = 10
"""Overflows in a row of one optimizer after which (and every so many) a one-line warning is issued."""

_SKIPPED_ATTR = "_lightning_amp_step_skipped"
_STATE_VERSION = 1


def main_params(optimizer: Optimizer) -> Generator[Tensor, None, None]:
    """The params ``optimizer`` steps on: the fp32 masters under O2 (what clipping must see)."""
    yield from optimizer_params(optimizer)


def _unscales_in_step(optimizer: Optimizer) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


# --------------------------------------------------------------------------------------
# LR schedulers that do not advance on a skipped optimizer step
# --------------------------------------------------------------------------------------

_SKIP_AWARE: Dict[type, type] = {}


def _skip_aware_class(cls: type) -> type:
    if getattr(cls, "_lightning_amp_skip_aware", False):
        return cls
    if cls not in _SKIP_AWARE:

        def step(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(getattr(self, "optimizer", None), _SKIPPED_ATTR, False):
                return None  # the optimizer step it follows was skipped for non-finite grads
            return cls.step(self, *args, **kwargs)

        def __reduce_ex__(self, protocol: Any) -> Any:
            # the wrapper class cannot be looked up by name: rebuild it from the original class
            return _rebuild_skip_aware, (cls, self.__dict__.copy())

        _SKIP_AWARE[cls] = type(
            cls.__name__,
            (cls,),
            {"step": step, "__reduce_ex__": __reduce_ex__, "_lightning_amp_skip_aware": True,
             "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return _SKIP_AWARE[cls]


def _rebuild_skip_aware(cls: type, state: Dict[str, Any]) -> Any:
    scheduler = cls.__new__(cls)
    scheduler.__dict__.update(state)
    make_scheduler_skip_aware(scheduler)
    return scheduler


def make_scheduler_skip_aware(scheduler: Any) -> None:
    """Make ``scheduler.step()`` a no-op right after a skipped step of ``scheduler.optimizer``.

    The scheduler's class is swapped for a subclass (``isinstance`` and ``state_dict`` unchanged).
    """
    scheduler.__class__ = _skip_aware_class(type(scheduler))


# --------------------------------------------------------------------------------------
# Per-optimizer state
# --------------------------------------------------------------------------------------


class _OptimizerAmp:
    """Scaler, masters and the loss-scale factor carried by one optimizer's current grads."""

    def __init__(
        self, optimizer: Optimizer, scaler: LossScaler, masters: Optional[MasterParams], combine_grad: bool = False
    ) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self.masters = masters
        # combine_grad: the stepped params' grads are views into one flat buffer per (device, dtype)
        self.flat = FlatGradBuffer(list(optimizer_params(optimizer))) if combine_grad else None
        self.model_params: List[Tensor] = masters.model_params if masters else list(optimizer_params(optimizer))
        self.grad_factor = 1.0  # the loss scale the optimizer's grads are multiplied by right now
        self.check: Optional[tuple] = None  # (found_inf, flags, params) of the last unscale / check
        self.skipped = 0

    def requires_grad(self) -> bool:
        return any(p.requires_grad for p in self.model_params)

    def rebase(self, scale: float) -> None:
        """Before a backward at ``scale``: re-base grads already held at another factor onto it."""
        if self.masters is not None and self.masters.has_model_grads():
            self.masters.accumulate_model_grads_()
        if self.flat is not None and not self.flat.views_intact():
            self.flat.rebind()  # e.g. after zero_grad(set_to_none=True): autograd must add into the views
        grads = optimizer_grads(self.optimizer)
        if grads and self.grad_factor != scale:
            rescale_grads_(grads, scale / self.grad_factor)
        self.grad_factor = scale
        self.check = None

    def _params_with_grad(self) -> List[Tensor]:
        if self.masters is not None and self.masters.has_model_grads():
            self.masters.accumulate_model_grads_()
        return [p for p in optimizer_params(self.optimizer) if p.grad is not None]

    def unscale(self) -> tuple:
        """Divide the grads by their factor in place (idempotent); ``(found_inf, flags, params)``."""
        if self.check is not None and self.grad_factor == 1.0:
            return self.check
        params = self._params_with_grad()
        if self.flat is not None and self.flat.views_intact() and len(params) == len(self.flat.params):
            found_inf = self.flat.unscale_(self.grad_factor)  # one call per flat buffer
            flags = nonfinite_flags([p.grad for p in params])[1] if found_inf.item() else None
        else:
            found_inf, flags = unscale_grads_([p.grad for p in params], 1.0 / self.grad_factor)
        self.grad_factor = 1.0
        self.check = (found_inf, flags, params)
        return self.check

    def inspect(self) -> tuple:
        """Check the grads for inf/nan without touching them; ``(found_inf, flags, params)``."""
        params = self._params_with_grad()
        found_inf, flags = nonfinite_flags([p.grad for p in params])
        return found_inf, flags, params

    def clear_grads(self) -> None:
        if self.masters is not None:
            self.masters.clear_grads_()
        for p in self.model_params:
            p.grad = None
        for p in optimizer_params(self.optimizer):
            p.grad = None
        if self.flat is not None:
            self.flat.zero_()  # re-attaches the views, zeroed

    def after_step(self, grads_unscaled: bool) -> None:
        self.grad_factor = 1.0 if grads_unscaled else self.grad_factor
        self.check = None


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
    ) -> None:
        if not isinstance(combine_grad, bool):
            raise ValueError(f"`combine_grad` must be True or False; got {combine_grad!r}")
        self.combine_grad = combine_grad
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
        self._states: List[_OptimizerAmp] = []
        self._skipped_steps = 0
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
        """Optimizer steps skipped so far because of non-finite gradients (all optimizers)."""
        return self._skipped_steps

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
        """The level's forward: see :func:`lightning_amp.amp.forward.forward_context`."""
        with amp_forward.forward_context(self._properties, self._device_type):
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
            self._states.append(_OptimizerAmp(optimizer, self._scalers[index], masters, self.combine_grad))
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

    def _state_of(self, optimizer: Optimizer) -> _OptimizerAmp:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one
        for state in self._states:
            if state.optimizer is optimizer:
                return state
        # an optimizer the Trainer did not hand to connect(): give it a scaler of its own
        self._check_optimizer(len(self._states), optimizer)
        self._scalers.append(self._new_scaler())
        state = _OptimizerAmp(optimizer, self._scalers[-1], None)
        self._states.append(state)
        return state

    # ---- backward --------------------------------------------------------------------

    def _backward_scale(self) -> float:
        if not self._states:
            return 1.0
        candidates = self._states
        if len(candidates) > 1:
            candidates = [s for s in self._states if s.requires_grad()] or self._states
        scale = min(s.scaler.scale for s in candidates)
        for state in candidates:
            state.rebase(scale)
        return scale

    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        """Multiply the loss by the current loss scale (computed in fp32) before the backward hooks."""
        scale = self._backward_scale()
        if scale != 1.0:
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
            self._all_reduce_master_grads(with_masters)
        for state in with_masters:
            state.masters.accumulate_model_grads_()
        if not synced:
            self._local_master_grads = True

    @torch.no_grad()
    def _all_reduce_master_grads(self, states: List[_OptimizerAmp]) -> None:
        """Average the grads that earlier ``no_sync`` backwards left in the masters (DDP skipped them)."""
        self._local_master_grads = False
        if not (dist.is_available() and dist.is_initialized()):
            return
        masters = list({id(m): m for s in states for m in s.masters.masters}.values())
        if not masters:
            return
        group = getattr(self._ddp, "process_group", None)
        flat = torch.cat([(m.grad if m.grad is not None else torch.zeros_like(m)).reshape(-1) for m in masters])
        dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size(group))
        offset = 0
        for m in masters:
            chunk = flat[offset : offset + m.numel()].view_as(m)
            if m.grad is None:
                m.grad = chunk.clone()
            else:
                m.grad.copy_(chunk)  # in place: keeps combine_grad's flat-buffer views attached
            offset += m.numel()

    # ---- optimizer step --------------------------------------------------------------

    @staticmethod
    def _clipping_requested(model: "pl.LightningModule") -> bool:
        if not model.automatic_optimization:
            return False  # manual clipping goes through clip_gradients, which unscales first
        trainer = model._trainer
        if trainer is not None and trainer.gradient_clip_val:
            return True
        return type(model).configure_gradient_clipping is not pl.LightningModule.configure_gradient_clipping

    @staticmethod
    def _agree(found_inf: Tensor) -> bool:
        """Every rank takes the same decision: the max of ``found_inf`` over all ranks."""
        if dist.is_available() and dist.is_initialized():
            found_inf = found_inf.detach().clone()
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item() != 0)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: "pl.LightningModule",
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Closure, unscale, agree on overflow, clip, then step (or skip) and update the scale."""
        state = self._state_of(optimizer)
        if isinstance(optimizer, LBFGS):  # allowed only without scaling: needs its closure
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            self._after_closure(model, optimizer)  # backward was skipped (training_step returned None)
            return None

        in_kernel = _unscales_in_step(optimizer) and state.grad_factor != 1.0 and not self._clipping_requested(model)
        found_inf, flags, params = state.inspect() if in_kernel else state.unscale()
        skip = self._agree(found_inf)
        self._after_closure(model, optimizer)

        if skip:
            self._skip(state, flags, params)
        else:
            if in_kernel:
                device = params[0].device if params else torch.device("cpu")
                optimizer.grad_scale = torch.full((), state.grad_factor, dtype=torch.float32, device=device)
                optimizer.found_inf = torch.zeros((), dtype=torch.float32, device=device)
                try:
                    optimizer.step(**kwargs)
                finally:
                    del optimizer.grad_scale, optimizer.found_inf
            else:
                optimizer.step(**kwargs)
            if state.masters is not None:
                state.masters.copy_to_model_()
            setattr(optimizer, _SKIPPED_ATTR, False)
        state.after_step(grads_unscaled=not in_kernel)
        state.scaler.update(skip)
        self._log_metrics(model)
        return closure_result

    def _skip(self, state: _OptimizerAmp, flags: Optional[Tensor], params: List[Tensor]) -> None:
        state.skipped += 1
        self._skipped_steps += 1
        setattr(state.optimizer, _SKIPPED_ATTR, True)
        names = self._names_of_flagged(state, flags, params)
        self.last_nonfinite_params = names
        index = self._states.index(state)
        log.debug(
            "lightning_amp: optimizer %d step skipped for non-finite gradients (loss scale %s); params: %s",
            index,
            state.scaler.scale,
            ", ".join(names) or "<on another rank>",
        )
        in_a_row = state.scaler.overflows_in_a_row + 1
        if in_a_row % OVERFLOW_WARN_AFTER == 0:
            shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
            rank_zero_warn(
                f"lightning_amp: {in_a_row} optimizer steps in a row skipped for non-finite gradients "
                f"(optimizer {index}, loss scale {state.scaler.scale}); non-finite grads in: {shown or 'another rank'}"
            )
        state.clear_grads()

    def _names_of_flagged(self, state: _OptimizerAmp, flags: Optional[Tensor], params: List[Tensor]) -> List[str]:
        if flags is None:
            return []
        halves = {id(m): h for h, m in state.masters.pairs} if state.masters is not None else {}
        names = []
        for param, flag in zip(params, flags.tolist()):
            if flag:
                model_param = halves.get(id(param), param)
                names.append(self._param_names.get(model_param, [f"<unnamed {tuple(param.shape)}>"])[0])
        return names

    def _log_metrics(self, model: "pl.LightningModule") -> None:
        trainer = model._trainer
        if trainer is None or trainer.barebones or model._current_fx_name is None or trainer._results is None:
            return
        has_logger = trainer.logger is not None
        for name, value in (("amp/loss_scale", self.loss_scale), ("amp/skipped_steps", self._skipped_steps)):
            model.log(name, float(value), on_step=True, on_epoch=False, logger=has_logger, batch_size=1)

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
            "skipped_steps": self._skipped_steps,
            "skipped_per_optimizer": [s.skipped for s in self._states],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "loss_scalers" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: `state_dict` must come from an AmpPrecision plugin "
                f"(with a 'loss_scalers' list); got keys {sorted(state_dict) if isinstance(state_dict, dict) else state_dict!r}"
            )
        self._skipped_steps = int(state_dict.get("skipped_steps", 0))
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
        for state in self._states:
            if state.masters is None:
                continue
            for half, master in state.masters.pairs:
                for name in self._param_names.get(half, []):
                    # a strategy may save gathered full tensors of sharded params: only same-shape entries
                    if isinstance(model_state.get(name), Tensor) and model_state[name].shape == master.shape:
                        model_state[name] = master.detach().clone()
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
            if state.masters is None:
                continue
            values = {}
            for half, _ in state.masters.pairs:
                for name in self._param_names.get(half, []):
                    value = model_state.get(name)
                    if isinstance(value, Tensor) and value.shape == half.shape:  # sharded params: see on_save
                        values[half] = value
                        break
            state.masters.load_masters_(values)


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
