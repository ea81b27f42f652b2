"""AmpPrecision and AmpO0Precision..AmpO3Precision (formerly AmpO0Plugin..AmpO3Plugin): the thin Lightning
Trainer adapter over ``lightning_amp.amp``.

The plugin is a Trainer ``Precision`` (Lightning's ``Precision(FabricPrecision, CheckpointHooks)``) whose
hooks call the :class:`~lightning_amp.amp.runtime.AmpRuntime` it holds as ``plugin.amp``; its options and
read-only properties are :class:`~lightning_amp.plugin_base.AmpPluginBase`'s, shared with the Fabric plugin.

Hook order: ``convert_module`` (cast the model in place; under master weights (O2) the params stay
fp32, :func:`~lightning_amp.amp.module_cast.prepare_o2_module_`, and O2's op policy is registered
until ``teardown``, :mod:`lightning_amp.amp.o2.policy`) -> ``connect`` (the
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
from typing import Any, Callable, Dict, List, Union

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

from lightning_amp.amp.engine import OVERFLOW_WARN_AFTER
from lightning_amp.amp.gate import make_scheduler_skip_aware
from lightning_amp.amp.param_views import optimizer_params
from lightning_amp.amp.runtime import named_params
from lightning_amp.amp.process_state import ProcessChange
from lightning_amp.group_exit import destroy_group_at_exit
from lightning_amp.plugin_base import (CONNECTORS_CHANGE, THROUGHPUT_CHANGE, AmpPluginBase, former_name, level_classes,
                                       plugin_name)
from lightning_amp.unsupported import refuse_strategy


def main_params(optimizer: Optimizer) -> Generator[Tensor, None, None]:
    """The params ``optimizer`` steps on (the module's own params at every level; kept for callers
    of the former design, where O2's optimizer held private masters)."""
    yield from optimizer_params(optimizer)


def _unwrap(model: Module) -> Module:
    """The LightningModule inside a strategy wrapper (DDP, ...)."""
    while not isinstance(model, pl.LightningModule) and isinstance(getattr(model, "module", None), Module):
        model = model.module
    return model


class AmpPrecision(AmpPluginBase, Precision):
    """Apex-style mixed precision (opt levels O0-O3) as a Lightning Trainer precision plugin.

    The arguments and properties are :class:`~lightning_amp.plugin_base.AmpPluginBase`'s; each hook calls
    the plugin's :class:`~lightning_amp.amp.runtime.AmpRuntime` (``self.amp``), see the module docstring.
    """

    kind = "trainer"
    lightning_changes = (CONNECTORS_CHANGE, THROUGHPUT_CHANGE)

    def convert_module(self, module: Module) -> Module:
        """Cast the model in place and hook its outputs (:meth:`AmpRuntime.prepare`); O2's op policy is
        registered until ``teardown``."""
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            fabric_name = plugin_name("fabric", self.fixed_opt_level)
            raise TypeError(
                f"{type(self).__name__} is a Lightning Trainer plugin and got a module without a Trainer (Lightning "
                f"Fabric?). With Fabric use lightning_amp.fabric.{fabric_name}(...): "
                f"`Fabric(plugins=[{fabric_name}()])`."
            )
        refuse_strategy(self, trainer.strategy)
        self.hold_lightning_changes()
        destroy_group_at_exit()  # a gloo group of Lightning's DDP/FSDP2 strategies: Lightning destroys NCCL's only
        self.amp.resolve_for(trainer.strategy.root_device.type)
        self.amp.prepare(module, fsdp2=isinstance(trainer.strategy, ModelParallelStrategy))
        if self.properties.cast_model and not self.properties.fp32_params:
            for sub in module.modules():  # Lightning's own record of the module's dtype
                if isinstance(sub, _DeviceDtypeModuleMixin):
                    sub._dtype = self.properties.dtype
        return module

    def convert_input(self, data: Any) -> Any:
        """O3: floating tensors of the batch become the half dtype, saturating at its range (an fp32
        ``finfo.min`` mask stays finite); other levels leave it alone (O2's autocast casts where an op
        needs it, as ``bf16-mixed``)."""
        return self.amp.convert_input(data)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The level's forward: see :func:`lightning_amp.amp.forward.forward_context`."""
        return self.amp.forward_context()

    def connect(self, model: Module, optimizers: List[Optimizer], lr_schedulers: List[Any]) -> tuple:
        """Give each optimizer a scaler and an OptimizerStep, make step schedulers skip-aware (and, with "auto",
        rolled back with the weights)."""
        self.amp.connect(optimizers, named_params(_unwrap(model)))
        self.amp.rollback_extras = {f"scheduler_{index}": config.scheduler for index, config in enumerate(lr_schedulers)}
        for config in lr_schedulers:
            if getattr(config, "interval", "step") == "step":
                make_scheduler_skip_aware(config.scheduler)
        return model, optimizers, lr_schedulers

    def backward(self, tensor: Tensor, model: "pl.LightningModule", *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Lightning's backward; forwards re-run inside it (activation checkpointing) see the level's
        forward dtypes (:mod:`lightning_amp.amp.recompute`)."""
        with self.amp.backward_context():
            super().backward(tensor, model, *args, **kwargs)

    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        """Multiply the loss by the current loss scale (computed in fp32) before the backward hooks."""
        return super().pre_backward(self.amp.scale_loss(tensor), module)

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
        self.amp.state_of(optimizer)  # an optimizer not seen at connect is checked (LBFGS) and gets a scaler
        if isinstance(optimizer, LBFGS):  # allowed only without scaling: needs its closure
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self.amp.begin_step(optimizer)  # with "auto": the rollback point is the state before this step's forward
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            self._after_closure(model, optimizer)  # backward was skipped (training_step returned None)
            return None
        logging = self._logging_step(model)
        if logging and isinstance(closure_result, Tensor):
            self.amp.log_loss(closure_result)  # with "auto": the loss-spike rule reads the logged steps' losses
        # closure=: as Lightning's bf16-mixed hands it to optimizer.step (a patched step or a step hook may read
        # it), dropped where the loss is scaled, as 16-mixed's GradScaler.step drops it (amp/step.py); it has run
        # already (the grads must exist before the overflow check) and returns its result
        self.amp.step(optimizer, lambda: self._after_closure(model, optimizer), self._grads_read_before_step(model),
                      after_step=lambda: logging and self._log_metrics(model), closure=lambda: closure_result,
                      **kwargs)
        return closure_result

    def _log_metrics(self, model: "pl.LightningModule") -> None:
        """Log :meth:`AmpRuntime.metrics` (the level and scale the step ran at) unless ``log_metrics=False``."""
        if self.log_metrics:
            for name, value in self.amp.metrics().items():
                model.log(name, value, on_step=True, on_epoch=False, logger=True, batch_size=1)

    @staticmethod
    def _logging_step(model: "pl.LightningModule") -> bool:
        """Whether this step writes to the Trainer's logger (``log_every_n_steps``, a logger, not barebones): the
        plugin logs ``amp/loss_scale``, ``amp/skipped_steps`` (with "auto" also ``amp/level`` and
        ``amp/rung_changes``, :meth:`AmpRuntime.metrics`) then, unless ``log_metrics=False``, and with "auto" the
        step's training loss goes to the ladder's spike rule on those steps either way."""
        trainer = model._trainer
        if trainer is None or trainer.barebones or model._current_fx_name is None or trainer._results is None:
            return False
        return trainer.logger is not None and trainer._logger_connector.should_update_logs

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the (fp32 under O2) grads after making sure they are unscaled; fused optimizers too."""
        if clip_val and clip_val > 0:
            self.amp.unscale(optimizer)
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Divide ``optimizer``'s grads by their loss scale now (idempotent until the next backward)."""
        self.amp.unscale(optimizer)

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        """Under master weights the checkpoint's params are already the fp32 Parameters; its half buffers
        are upcast to fp32 there, so it loads into a plain fp32 model as it is."""
        if not self.properties.fp32_params:
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


level_classes(AmpPrecision, globals())  # AmpO0Precision .. AmpO3Precision, AmpAutoPrecision (and the former names)
AmpAutoPrecision: type[AmpPrecision]
AmpO0Precision: type[AmpPrecision]
AmpO1Precision: type[AmpPrecision]
AmpO2Precision: type[AmpPrecision]
AmpO3Precision: type[AmpPrecision]
AmpAutoPlugin: type[AmpPrecision]  # the former names: the same classes (AmpO2Plugin is AmpO2Precision)
AmpO0Plugin: type[AmpPrecision]
AmpO1Plugin: type[AmpPrecision]
AmpO2Plugin: type[AmpPrecision]
AmpO3Plugin: type[AmpPrecision]

_LEVELS = ("O0", "O1", "O2", "O3", "auto")
#: the keys a checkpoint may hold this plugin's state under: the class names, and the former ones (AmpO2Plugin)
_PLUGIN_NAMES = (plugin_name("trainer"), *(plugin_name("trainer", level) for level in _LEVELS),
                 *(former_name("trainer", level) for level in _LEVELS))


def _wrap_throughput_monitor_lookup() -> Any:
    """Lightning's ``ThroughputMonitor`` reads the peak FLOP/s of the compute dtype it derives from the
    precision plugin through a fixed list of Lightning's own plugins, any other counting as fp32: the
    MFU it logged for O1-O3 was against the fp32 peak (an H100 SXM in Lightning's table: 67 TFLOP/s, 495
    with TF32 matmuls, against 989 for bf16). Extend its lookup by our plugins (their half dtype; fp32
    at O0). Wrapped, not replaced: other plugins get Lightning's answer. What it was, for the undo."""
    from lightning.pytorch.callbacks import throughput_monitor

    lightnings = getattr(throughput_monitor, "_plugin_to_compute_dtype", None)
    if lightnings is None:
        return None

    def compute_dtype(plugin: Any) -> torch.dtype:
        return plugin.properties.dtype if isinstance(plugin, AmpPrecision) else lightnings(plugin)

    throughput_monitor._plugin_to_compute_dtype = compute_dtype
    return lightnings


def _unwrap_throughput_monitor_lookup(lightnings: Any) -> None:
    if lightnings is not None:
        from lightning.pytorch.callbacks import throughput_monitor

        throughput_monitor._plugin_to_compute_dtype = lightnings


#: held by every Trainer plugin from its construction to its teardown (:meth:`AmpPluginBase.hold_lightning_changes`)
WRAPPED_THROUGHPUT_LOOKUP = ProcessChange(THROUGHPUT_CHANGE, _wrap_throughput_monitor_lookup,
                                          _unwrap_throughput_monitor_lookup)


__all__ = ["AmpPrecision", "AmpAutoPrecision", "AmpO0Precision", "AmpO1Precision", "AmpO2Precision", "AmpO3Precision",
           "AmpAutoPlugin", "AmpO0Plugin", "AmpO1Plugin", "AmpO2Plugin", "AmpO3Plugin", "main_params",
           "make_scheduler_skip_aware", "OVERFLOW_WARN_AFTER"]
