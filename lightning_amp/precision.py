"""AmpPrecision and AmpO0Plugin..AmpO3Plugin: the thin Lightning adapter over ``lightning_amp.amp``.

Hook order: ``convert_module`` (cast the model in place; under master weights (O2) the params stay
fp32, :func:`~lightning_amp.amp.module_cast.prepare_o2_module_`, and O2's op policy is registered
until ``teardown``, :mod:`lightning_amp.amp.o2_policy`) -> ``connect`` (the
:class:`~lightning_amp.amp.engine.AmpEngine`: one LossScaler and one
:class:`~lightning_amp.amp.step.OptimizerStep` per optimizer; step-interval LR schedulers made
skip-aware) -> per step ``convert_input``, ``forward_context`` (:mod:`lightning_amp.amp.forward`),
``pre_backward`` (loss * scale), ``optimizer_step`` -> ``teardown`` (the model handed back plain).

``optimizer_step``: run the closure, unscale (``on_before_optimizer_step`` and clipping see unscaled
grads with every optimizer; only when neither the module nor a callback overrides that hook and no
clipping is requested does an optimizer that unscales in its kernel, ``_step_supports_amp_scaling``,
get them still scaled); agree on ``found_inf`` across ranks (an all-reduce MAX of the device flag),
``_after_closure`` (hooks, clipping), then step. On inf/nan the step is skipped on the device:
params, optimizer state and the LR scheduler (``interval="step"``) stay as they were and the scale
backs off; when the flag reaches the host (:mod:`lightning_amp.amp.gate`) the grads are dropped and
the offending param names logged at debug level (a warning after every ``OVERFLOW_WARN_AFTER``
overflows in a row). No host sync on the way with plain torch Adam/AdamW/SGD or protocol optimizers
(see :mod:`lightning_amp.amp.step` for the drivers and the one host read of the first step).
Non-finite grads are skipped at every level and scale, static 1.0 and bf16 included.

Under O2 the optimizer holds the module's own fp32 Parameters and their grads are fp32 (the
half copies autocast makes in forward hand their grads back through autograd's cast), so ``p.grad``,
``grad_norm`` and clipping see what the optimizer steps on, unscaled in
``on_before_optimizer_step`` as with Lightning's ``16-mixed``. Under ``ModelParallelStrategy`` (FSDP2) the half
copies are FSDP2's own: every ``fully_shard`` group all-gathers its fp32 shards as half for compute
and reduce-scatters fp32 grads (:mod:`lightning_amp.amp.fsdp2` checks or sets the policies). Several optimizers
(manual optimization): each has its own scaler (see the engine for the shared backward scale).
"""
from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Callable, Dict, List, Literal, Optional, Union

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

import lightning.pytorch as pl
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_amp.amp import forward as amp_forward
from lightning_amp.amp.engine import OVERFLOW_WARN_AFTER, AmpEngine
from lightning_amp.amp.fsdp2 import fsdp2_half_compute_, is_fsdp2
from lightning_amp.amp.gate import make_scheduler_skip_aware
from lightning_amp.amp.levels import (AmpProperties, DtypeName, NormPolicyName, OptLevelName, OutputDtypeName,
                                      resolve_properties)
from lightning_amp.amp.master import optimizer_params
from lightning_amp.amp.module_cast import cast_floating, cast_module_, cast_outputs_hook, prepare_o2_module_
from lightning_amp.amp.o2_policy import PolicyHold, hold as hold_o2_policy
from lightning_amp.amp.recompute import recompute_context
from lightning_amp.amp.release import release_module_
from lightning_amp.amp.scaler import SCALER_DEFAULTS, LossScaler, check_scaler_keywords
from lightning_amp.amp.step import OptimizerStep
from lightning_amp.unsupported import refuse_strategy

_STATE_VERSION = 1


def main_params(optimizer: Optimizer) -> Generator[Tensor, None, None]:
    """The params ``optimizer`` steps on (the module's own params at every level; kept for callers
    of the former design, where O2's optimizer held private masters)."""
    yield from optimizer_params(optimizer)


def _unwrap(model: Module) -> Module:
    """The LightningModule inside a strategy wrapper (DDP, ...)."""
    while not isinstance(model, pl.LightningModule) and isinstance(getattr(model, "module", None), Module):
        model = model.module
    return model


class AmpPrecision(Precision):
    """Apex-style mixed precision (opt levels O0-O3) as a Lightning precision plugin.

    Args:
        opt_level: "O0" (fp32), "O1" (autocast + cast lists), "O2" (fp32 params, forward under autocast
            with norms, softmax and activations kept half, fp32 BatchNorm, fp32 grads and update),
            "O3" (pure half); case-insensitive.
        dtype: "float16", "bfloat16", a torch dtype, or "auto" (bfloat16 on CPU and on CUDA
            devices that support it, else float16).
        loss_scale: a positive static scale or "dynamic"; None is the level's default (1.0 with
            bfloat16). A number as a string ("128.0", as apex took it from argparse) is that number.
        keep_batchnorm_fp32, master_weights, cast_model_outputs: overrides of the level's
            defaults (None keeps them; apex's strings "True"/"False" are True/False); contradictions
            raise ValueError.
        half_buffers: O2: store the model's floating buffers in the half dtype (default False: they
            keep the dtype the model gave them).
        norm_policy: O2's forward: "half" (default: norms, softmax and activations in the half dtype,
            as ``bf16-true``) or "fp32" (torch's autocast lists, as ``bf16-mixed``).
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
        min_loss_scale, max_loss_scale: the dynamic :class:`~lightning_amp.amp.scaler.LossScaler`.
        combine_grad: the grads of the params each optimizer steps on live as views in one flat
            buffer per (device, dtype) (:class:`~lightning_amp.amp.flat.FlatGradBuffer`); unscaling is one call per buffer.
        fused_update: a plain ``torch.optim.Adam``/``AdamW``/``SGD`` is stepped by lightning_amp's
            fused kernels (unscaled grads, skip decided on the device, one pass over params and
            state; :mod:`lightning_amp.amp.kernel_step` says which group
            options qualify). False: the optimizer's own ``step()`` runs, and the skip is decided
            on the host.

    Properties: ``loss_scale`` (current scale of the first optimizer), ``loss_scales`` (all),
    ``skipped_steps`` (optimizer steps skipped for non-finite grads), ``properties``.
    """

    def __init__(
        self,
        opt_level: OptLevelName = "O1",
        dtype: Union[DtypeName, torch.dtype] = "auto",
        loss_scale: Optional[Union[float, Literal["dynamic"]]] = None,
        keep_batchnorm_fp32: Optional[bool] = None,
        master_weights: Optional[bool] = None,
        cast_model_outputs: Optional[Union[OutputDtypeName, torch.dtype]] = None,
        half_buffers: Optional[bool] = None,
        norm_policy: Optional[NormPolicyName] = None,
        init_scale: float = SCALER_DEFAULTS["init_scale"],
        growth_factor: float = SCALER_DEFAULTS["growth_factor"],
        backoff_factor: float = SCALER_DEFAULTS["backoff_factor"],
        growth_interval: int = SCALER_DEFAULTS["growth_interval"],
        hysteresis: int = SCALER_DEFAULTS["hysteresis"],
        min_loss_scale: Optional[float] = SCALER_DEFAULTS["min_loss_scale"],
        max_loss_scale: float = SCALER_DEFAULTS["max_loss_scale"],
        combine_grad: bool = False,
        fused_update: bool = True,
    ) -> None:
        for name, value in (("combine_grad", combine_grad), ("fused_update", fused_update)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False; got {value!r}")
        self.combine_grad, self.fused_update = combine_grad, fused_update
        self._request = dict(opt_level=opt_level, dtype=dtype, loss_scale=loss_scale,
                             keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
                             cast_model_outputs=cast_model_outputs, half_buffers=half_buffers,
                             norm_policy=norm_policy)
        self._scaler_kwargs = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                                   growth_interval=growth_interval, hysteresis=hysteresis,
                                   min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale)
        self._device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._engine: Optional[AmpEngine] = None
        self._resolve()
        self._engine = AmpEngine(self._properties, self._new_scaler, combine_grad, fused_update,
                                 warn=rank_zero_warn)
        self._fsdp2_checked = False  # see _half_params_by_fsdp2
        self._converted: Optional[Module] = None  # the model convert_module prepared, until teardown
        self._o2_policy: Optional[PolicyHold] = None  # O2's op policy, registered from convert_module to teardown

    def _resolve(self) -> None:
        self._properties = resolve_properties(**self._request, device_type=self._device_type)
        self._new_scaler()  # validates the scaler arguments now
        check_scaler_keywords(self._properties, self._request["loss_scale"], self._scaler_kwargs, rank_zero_warn)
        props = self._properties
        half = "bf16" if props.dtype == torch.bfloat16 else "16"
        if props.opt_level == "O0":
            self.precision = "32-true"
        elif props.opt_level == "O3":
            self.precision = f"{half}-true"
        else:
            self.precision = f"{half}-mixed"
        if self._engine is not None:
            self._engine.properties = props

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
        return self.scalers[0].scale if self.scalers else self._new_scaler().scale

    @property
    def loss_scales(self) -> List[float]:
        """Current loss scale of every optimizer, in the order of ``trainer.optimizers``."""
        return [s.scale for s in self.scalers]

    @property
    def scalers(self) -> List[LossScaler]:
        """The LossScaler of every optimizer."""
        return list(self._engine.scalers)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because of non-finite gradients (all optimizers; waits for
        the flags of steps still on their way to the host)."""
        return self._engine.skipped_steps

    @property
    def last_nonfinite_params(self) -> List[str]:
        """Names of the params whose grads were non-finite at the last skipped step (this rank's view)."""
        return self._engine.last_nonfinite_params

    @property
    def _states(self) -> List[OptimizerStep]:
        return self._engine.states

    def convert_module(self, module: Module) -> Module:
        """Cast the model in place and hook its outputs. O0: fp32. Master weights (O2): params fp32,
        buffers as the model has them (``half_buffers``), BatchNorm fp32 if kept; O2's op policy
        registered until ``teardown``. O3: half."""
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            fabric_name = _FABRIC_NAMES.get(type(self).__name__, "FabricAmpPrecision")
            raise TypeError(
                f"{type(self).__name__} is a Lightning Trainer plugin and got a module without a Trainer (Lightning "
                f"Fabric?). With Fabric use lightning_amp.fabric.{fabric_name}(...): "
                f"`Fabric(plugins=[{fabric_name}()])`."
            )
        self._use_device_type(trainer.strategy.root_device.type)
        refuse_strategy(self, trainer.strategy)
        self._convert_module(module, fsdp2=isinstance(trainer.strategy, ModelParallelStrategy))
        return module

    def teardown(self) -> None:
        """End of a Trainer run: hand the model back as a plain module
        (:func:`~lightning_amp.amp.release.release_module_`); the next run's ``convert_module`` prepares it again."""
        module, self._converted = self._converted, None
        if module is not None:
            release_module_(module, self._properties)
        self._release_o2_policy()
        super().teardown()

    def _release_o2_policy(self) -> None:
        if self._o2_policy is not None:
            self._o2_policy.release()
            self._o2_policy = None

    def _convert_module(self, module: Module, fsdp2: bool = False) -> None:
        """Cast ``module`` in place for the level; ``fsdp2``: FSDP2 has sharded it (ModelParallelStrategy),
        so under master weights FSDP2's policy all-gathers the fp32 shards as half params."""
        props = self._properties
        self._fsdp2_checked = fsdp2
        if props.opt_level == "O0":
            cast_module_(module, torch.float32)
        elif props.cast_model and props.master_weights:
            if fsdp2:
                fsdp2_half_compute_(module, props.dtype, props.keep_batchnorm_fp32)  # refuses half params first
            prepare_o2_module_(module, props.dtype, props.keep_batchnorm_fp32, props.half_buffers)
        elif props.cast_model:
            cast_module_(module, props.dtype, props.keep_batchnorm_fp32)
            for sub in module.modules():
                if isinstance(sub, _DeviceDtypeModuleMixin):
                    sub._dtype = props.dtype
        cast_outputs_hook(module, props.cast_model_outputs)
        self._converted = module
        self._hold_o2_policy_for_the_run()

    def _hold_o2_policy_for_the_run(self) -> None:
        """O2's op policy registered from ``convert_module`` to ``teardown`` (the run)."""
        self._release_o2_policy()
        if amp_forward.uses_o2_policy(self._properties):
            self._o2_policy = hold_o2_policy()

    def _o2_policy_per_forward(self) -> contextlib.AbstractContextManager:
        """What a forward context holds of O2's op policy beyond the run's hold: nothing here."""
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        props = self._properties
        return f"{type(self).__name__}(opt_level={props.opt_level!r}, dtype={props.dtype}, loss_scale={props.loss_scale!r})"

    def convert_input(self, data: Any) -> Any:
        """O3: floating tensors of the batch become the half dtype, saturating at its range (an fp32
        ``finfo.min`` mask stays finite); other levels leave it alone (O2's autocast casts where an op
        needs it, as ``bf16-mixed``)."""
        if _casts_batch(self._properties):
            return cast_floating(data, self._properties.dtype, saturating=True)
        return data

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """The level's forward: see :func:`lightning_amp.amp.forward.forward_context`."""
        if not self._fsdp2_checked:
            self._half_params_by_fsdp2()
        with self._o2_policy_per_forward(), amp_forward.forward_context(self._properties, self._device_type):
            yield

    def _half_params_by_fsdp2(self) -> None:
        """At the first forward: if FSDP2 sharded the model after ``convert_module`` (Fabric's
        ModelParallelStrategy runs its ``parallelize_fn`` then), under master weights FSDP2's policy
        all-gathers the fp32 shards as half params from now on (:mod:`lightning_amp.amp.fsdp2`)."""
        self._fsdp2_checked = True
        props, module = self._properties, self._converted
        if module is not None and props.cast_model and props.master_weights and is_fsdp2(module):
            fsdp2_half_compute_(module, props.dtype, props.keep_batchnorm_fp32)

    def connect(self, model: Module, optimizers: List[Optimizer], lr_schedulers: List[Any]) -> tuple:
        """Give each optimizer a scaler and an OptimizerStep, make step schedulers skip-aware."""
        lightning_module = _unwrap(model)
        names: Dict[Tensor, List[str]] = {}
        for name, param in lightning_module.named_parameters(remove_duplicate=False):
            names.setdefault(param, []).append(name)
        self._engine.connect(optimizers, names)

        for config in lr_schedulers:
            if getattr(config, "interval", "step") == "step":
                make_scheduler_skip_aware(config.scheduler)
        return model, optimizers, lr_schedulers

    def backward(self, tensor: Tensor, model: "pl.LightningModule", *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Lightning's backward; forwards re-run inside it (activation checkpointing) see the level's
        forward dtypes (:mod:`lightning_amp.amp.recompute`)."""
        with self._recompute_context():
            super().backward(tensor, model, *args, **kwargs)

    def _recompute_context(self) -> contextlib.AbstractContextManager:
        state = amp_forward.recompute_state(self._properties)
        return contextlib.nullcontext() if state is None else recompute_context(state)

    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        """Multiply the loss by the current loss scale (computed in fp32) before the backward hooks."""
        return super().pre_backward(self._scaled(tensor), module)

    def _scaled(self, tensor: Tensor) -> Tensor:
        """The loss times the scale of its backward: :meth:`AmpEngine.scale_loss`."""
        return self._engine.scale_loss(tensor)

    @staticmethod
    def _grads_read_before_step(model: "pl.LightningModule") -> bool:
        """Whether anything between the closure and the step may read the grads (then they are unscaled
        first, see :meth:`AmpEngine.step`): an ``on_before_optimizer_step`` of the module or of a callback,
        or clipping (``gradient_clip_val``, an own ``configure_gradient_clipping``)."""
        trainer = model._trainer
        if trainer is None or is_overridden("on_before_optimizer_step", model, pl.LightningModule):
            return True
        if any(is_overridden("on_before_optimizer_step", callback, pl.Callback) for callback in trainer.callbacks):
            return True
        if not model.automatic_optimization:
            return False  # manual clipping goes through clip_gradients, which unscales first
        return bool(trainer.gradient_clip_val) or is_overridden("configure_gradient_clipping", model,
                                                                pl.LightningModule)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: "pl.LightningModule",
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Closure, unscale (or inspect), agree on overflow, clip, then step or skip on the device."""
        self._engine.state_of(optimizer)  # an optimizer not seen at connect is checked (LBFGS) and gets a scaler
        if isinstance(optimizer, LBFGS):  # allowed only without scaling: needs its closure
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            self._after_closure(model, optimizer)  # backward was skipped (training_step returned None)
            return None
        self._engine.step(optimizer, lambda: self._after_closure(model, optimizer),
                          self._grads_read_before_step(model), **kwargs)
        self._log_metrics(model)
        return closure_result

    def _log_metrics(self, model: "pl.LightningModule") -> None:
        """Log the scale (a device tensor) and the skipped steps settled so far, on the steps the
        Trainer writes to its logger (``log_every_n_steps``) only."""
        trainer = model._trainer
        if trainer is None or trainer.barebones or model._current_fx_name is None or trainer._results is None:
            return
        if trainer.logger is None or not trainer._logger_connector.should_update_logs:
            return
        scaler = self._engine.scalers[0]
        scale = scaler.static_scale if scaler.static_scale is not None else scaler.scale_tensor.clone()
        skipped = self._engine.settled_skipped_steps
        for name, value in (("amp/loss_scale", scale), ("amp/skipped_steps", float(skipped))):
            model.log(name, value, on_step=True, on_epoch=False, logger=True, batch_size=1)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the (fp32 master under O2) grads after making sure they are unscaled; fused optimizers too."""
        if clip_val and clip_val > 0:
            self._engine.state_of(optimizer).unscale()
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Divide ``optimizer``'s grads by their loss scale now (idempotent until the next backward)."""
        self._engine.state_of(optimizer).unscale()

    def state_dict(self) -> Dict[str, Any]:
        """Scaler state of every optimizer and the skipped-step counts."""
        return {"version": _STATE_VERSION, "opt_level": self._properties.opt_level, **self._engine.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "loss_scalers" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: `state_dict` must come from an AmpPrecision plugin "
                f"(with a 'loss_scalers' list); got keys {sorted(state_dict) if isinstance(state_dict, dict) else state_dict!r}"
            )
        self._engine.load_state_dict(state_dict)

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        """Under master weights the checkpoint's params are already the fp32 Parameters; its half buffers
        are upcast to fp32 there, so it loads into a plain fp32 model as it is."""
        if not self._properties.master_weights:
            return
        model_state = checkpoint.get("state_dict")
        if not isinstance(model_state, dict):
            return
        for key, value in model_state.items():
            if isinstance(value, Tensor) and value.dtype in (torch.float16, torch.bfloat16):
                model_state[key] = value.float()

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        """Accept the plugin state of a sibling class. The weights (fp32, also in checkpoints of the
        former design, whose ``state_dict`` held the masters) are loaded by Lightning itself."""
        own = type(self).__qualname__
        if own not in checkpoint:
            for key in _PLUGIN_NAMES:
                if key in checkpoint and isinstance(checkpoint[key], dict) and "loss_scalers" in checkpoint[key]:
                    self.load_state_dict(checkpoint[key])
                    break


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
    """Apex O2: fp32 params, forward under autocast with norms, softmax and activations kept half
    (BatchNorm fp32), fp32 grads and update, dynamic loss scale (fp16)."""

    def __init__(self, **kwargs: Any) -> None:
        _no_opt_level(kwargs, "AmpO2Plugin")
        super().__init__(opt_level="O2", **kwargs)


class AmpO3Plugin(AmpPrecision):
    """Apex O3: pure half (optionally BatchNorm fp32 with keep_batchnorm_fp32=True), static scale 1.0."""

    def __init__(self, **kwargs: Any) -> None:
        _no_opt_level(kwargs, "AmpO3Plugin")
        super().__init__(opt_level="O3", **kwargs)


def _casts_batch(props: AmpProperties) -> bool:
    """Whether the batch's floating tensors are cast to half before forward: the pure half model (O3)."""
    return props.cast_model and not props.autocast


def _no_opt_level(kwargs: Dict[str, Any], cls_name: str) -> None:
    if "opt_level" in kwargs:
        raise TypeError(f"{cls_name} fixes the opt level; use AmpPrecision(opt_level=...) to choose one")


_PLUGIN_NAMES = ("AmpPrecision", "AmpO0Plugin", "AmpO1Plugin", "AmpO2Plugin", "AmpO3Plugin")
_FABRIC_NAMES = {"AmpPrecision": "FabricAmpPrecision", "AmpO0Plugin": "FabricAmpO0Precision",
                 "AmpO1Plugin": "FabricAmpO1Precision", "AmpO2Plugin": "FabricAmpO2Precision",
                 "AmpO3Plugin": "FabricAmpO3Precision"}


def _report_compute_dtype_to_throughput_monitor() -> None:
    """Lightning's ``ThroughputMonitor`` reads the peak FLOP/s of the compute dtype it derives from the
    precision plugin through a fixed list of Lightning's own plugins, any other counting as fp32: the
    MFU it logged for O1-O3 was against the fp32 peak (an H100 SXM in Lightning's table: 67 TFLOP/s, 495
    with TF32 matmuls, against 989 for bf16). Extend its lookup by our plugins (their half dtype; fp32
    at O0). Wrapped, not replaced: other plugins get Lightning's answer."""
    from lightning.pytorch.callbacks import throughput_monitor

    lightnings = getattr(throughput_monitor, "_plugin_to_compute_dtype", None)
    if lightnings is None or getattr(lightnings, "_lightning_amp", False):
        return

    def compute_dtype(plugin: Any) -> torch.dtype:
        return plugin.properties.dtype if isinstance(plugin, AmpPrecision) else lightnings(plugin)

    compute_dtype._lightning_amp = True  # type: ignore[attr-defined]
    throughput_monitor._plugin_to_compute_dtype = compute_dtype


_report_compute_dtype_to_throughput_monitor()


__all__ = ["AmpPrecision", "AmpO0Plugin", "AmpO1Plugin", "AmpO2Plugin", "AmpO3Plugin", "main_params",
           "make_scheduler_skip_aware", "OVERFLOW_WARN_AFTER"]
