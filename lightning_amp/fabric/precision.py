"""FabricAmpPrecision and FabricAmpO0Precision..FabricAmpO3Precision: the same mixed precision for Lightning Fabric.

``Fabric(plugins=[FabricAmpO2Precision()])``: a Fabric ``Precision`` with the options of the Trainer plugins
(:class:`~lightning_amp.plugin_base.AmpPluginBase`) holding the same runtime
(:class:`~lightning_amp.amp.runtime.AmpRuntime`, ``plugin.amp``); this file only maps Fabric's hooks onto it.

* ``convert_module`` (in ``fabric.setup``) casts the model in place as the Trainer plugin does (O2:
  the Parameters stay fp32 and forward runs under autocast with O2's op policy,
  :mod:`lightning_amp.amp.forward`), so the optimizer the user built over ``model.parameters()`` steps
  the module's own fp32 params. Fabric has no end of run: O2's op policy
  (:mod:`lightning_amp.amp.o2.policy`) is registered for each forward context (and a recomputing
  backward) only, so nothing stays registered between them.
* Fabric never hands a precision plugin its optimizers: each optimizer is connected to the engine
  the first time the plugin sees it (``optimizer_step``, ``unscale_gradients``, i.e. the first
  ``optimizer.step()`` or ``fabric.clip_gradients``). Until then backwards run at scale 1.
* ``convert_input``/``convert_output``: a forward's floating inputs become the half dtype and its floating
  outputs fp32, as Fabric's own ``bf16-mixed``/``bf16-true`` make them.
* ``backward`` multiplies the loss by the scale (Fabric drops what ``pre_backward`` returns).
* ``optimizer.step()`` runs :meth:`AmpRuntime.step`: unscale, agree on inf/nan across ranks, step or
  skip on the device. ``fabric.clip_gradients`` unscales first and clips the fp32 grads the optimizer
  steps on; with dynamic loss scaling pass ``error_if_nonfinite=False`` (overflowing steps are skipped).
* Checkpoints: the module's ``state_dict()`` holds its fp32 params, and the optimizer's
  ``state_dict()`` carries its loss scaler (``param_groups[0]["lightning_amp"]``), so
  ``fabric.save(path, {"model": model, "optimizer": optimizer})`` / ``fabric.load`` resume exactly.
* Strategies: under ``strategy="tp_fused"`` (:mod:`lightning_amp.fabric.strategy`) the strategy sets
  ``prepared_by_strategy`` and calls :meth:`FabricAmpPrecision.prepare` after converting the model's layers; under
  DeepSpeed, ``Fabric(...)`` raises TypeError when it is built (:mod:`lightning_amp.unsupported`, checked where
  :mod:`lightning_amp.plugin_kinds` sees the strategy Fabric made).
* ``opt_level="auto"`` (``FabricAmpAutoPrecision``): the ladder (:mod:`lightning_amp.amp.ladder`) snapshots
  before and decides after each step of the first optimizer; a rollback restores the model, the optimizers
  and what ``plugin.rollback_extras`` holds (LR schedulers: Fabric does not show them to the plugin). The
  loss-spike rule reads what ``plugin.amp.log_loss(loss)`` is given (Fabric has no logging steps).
* LR schedulers: Fabric does not see them; call :func:`~lightning_amp.amp.gate.make_scheduler_skip_aware`
  on a per-step scheduler so that it does not advance on skipped steps.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Generator, Optional

import torch
from lightning.fabric.plugins.precision import Precision
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from torch.utils._pytree import tree_leaves

from lightning_amp.amp.module_cast import cast_floating
from lightning_amp.amp.runtime import named_params
from lightning_amp.amp.step import OptimizerStep
from lightning_amp.group_exit import destroy_group_at_exit
from lightning_amp.plugin_base import AmpPluginBase, level_classes, plugin_name
from lightning_amp.unsupported import refuse_strategy

_STATE_KEY = "lightning_amp"  # where an optimizer's state_dict carries its scaler (in param_groups[0])


class FabricAmpPrecision(AmpPluginBase, Precision):
    """Apex-style mixed precision (opt levels O0-O3) as a Lightning Fabric precision plugin.

    Same arguments and properties (``loss_scale``, ``skipped_steps``, ``last_nonfinite_params``, ...) as
    :class:`lightning_amp.AmpPrecision` (:class:`~lightning_amp.plugin_base.AmpPluginBase`); see the module
    docstring for how Fabric's hooks map onto its :class:`~lightning_amp.amp.runtime.AmpRuntime` (``self.amp``).
    Given to a ``Trainer`` it raises TypeError naming the Trainer plugin to use.
    """

    kind = "fabric"

    #: True while a strategy that converts the model's layers first (``tp_fused``) has taken the model's
    #: preparation over: ``convert_module`` then leaves the model alone and the strategy calls :meth:`prepare`
    prepared_by_strategy = False

    @property
    def rollback_extras(self) -> Dict[str, Any]:
        """With "auto": more objects a rollback restores (name -> object with ``state_dict``/``load_state_dict``),
        e.g. ``plugin.rollback_extras["scheduler"] = scheduler``: Fabric does not show its precision plugin the LR
        schedulers (:attr:`AmpRuntime.rollback_extras`)."""
        return self.amp.rollback_extras

    @rollback_extras.setter
    def rollback_extras(self, extras: Dict[str, Any]) -> None:
        self.amp.rollback_extras = extras

    # ---- setup -------------------------------------------------------------------------

    def convert_module(self, module: Module) -> Module:
        """Cast ``module`` in place (:meth:`prepare`); under ``strategy="tp_fused"`` the strategy does it
        after converting the layers."""
        if getattr(module, "_trainer", None) is not None:
            name = plugin_name("trainer", self.fixed_opt_level)
            raise TypeError(f"{type(self).__name__} is a Lightning Fabric plugin; with the Trainer use "
                            f"lightning_amp.{name}(...): `Trainer(plugins=[{name}()])`.")
        self.hold_lightning_changes()
        destroy_group_at_exit()  # a gloo group of Fabric's DDP strategies: Lightning destroys NCCL's only
        if not self.prepared_by_strategy:
            self.prepare(module)
        return module

    def given_to_lightning(self, connector: Any) -> None:
        """``Fabric(...)`` built its connector with this plugin: a strategy it cannot run under (DeepSpeed; FSDP and
        the like with "auto") is refused now, before ``fabric.setup`` casts anything (Fabric hands a precision plugin
        no strategy later)."""
        refuse_strategy(self, connector.strategy)

    def prepare(self, module: Module) -> Module:
        """Cast ``module`` in place for the level (:meth:`AmpRuntime.prepare`; O2's op policy is held per
        forward context, Fabric having no end of run) and learn its param names for messages."""
        self.amp.prepare(module, hold_policy=False)
        self.amp.connect([], named_params(module))
        return module

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        """A Trainer hook: this plugin is for Fabric."""
        raise TypeError(f"{type(self).__name__} is a Lightning Fabric plugin; with the Trainer use "
                        f"lightning_amp.{plugin_name('trainer', self.fixed_opt_level)}(...).")

    def _state(self, optimizer: Optimizer) -> OptimizerStep:
        """The runtime's step of ``optimizer``, connecting it the first time (see the module docstring)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a _FabricOptimizer wraps the real one
        state = self.amp.connected(optimizer)
        if state is not None:
            return state
        saved = optimizer.param_groups[0].pop(_STATE_KEY, None) if optimizer.param_groups else None
        state = self.amp.add_optimizer(optimizer)
        if saved is not None:
            self._restore(state, saved)
        optimizer.register_state_dict_post_hook(self._scaler_into_optimizer_state)
        optimizer.register_load_state_dict_post_hook(self._scaler_from_optimizer_state)
        return state

    # ---- the step ----------------------------------------------------------------------

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The level's forward (:func:`lightning_amp.amp.forward.forward_context`), O2's op policy held for it."""
        return self.amp.forward_context()

    def convert_input(self, data: Any) -> Any:
        """O1-O3: the forward's floating inputs become the half dtype, as under Fabric's ``bf16-mixed``/``16-mixed``
        (O1, O2) and ``bf16-true``/``16-true`` (O3), saturating at its range (an fp32 ``finfo.min`` mask stays
        finite, where Fabric's make it ``-inf``); the autocast device follows the inputs'."""
        tensor = next((t for t in tree_leaves(data) if isinstance(t, Tensor)), None)
        if tensor is not None:
            self.amp.device_type = tensor.device.type
        return self.amp.convert_input(data, cast_mixed=True)

    def convert_output(self, data: Any) -> Any:
        """Floating outputs become torch's default dtype (fp32), as under every Fabric precision but
        ``32-true``: the loss a loop computes from them is fp32 at O1 as under ``bf16-mixed``, at O3 as
        under ``bf16-true`` (O2 casts them already). An explicit ``cast_model_outputs`` is kept."""
        if self.amp.request["cast_model_outputs"] is not None:
            return data
        return cast_floating(data, torch.get_default_dtype())

    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        """Backward of the loss times the current loss scale (recomputed forwards see the level's dtypes)."""
        with self.amp.backward_context():
            self.amp.scale_loss(tensor).backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``: unscale, agree on inf/nan across ranks, step or skip on the device (with "auto",
        the ladder's snapshot before and its decision after the first optimizer's step)."""
        state = self._state(optimizer)
        if isinstance(state.optimizer, LBFGS):  # allowed only without scaling: needs its closure
            return state.optimizer.step(**kwargs)
        self.amp.begin_step(state.optimizer)  # with "auto": the rollback point is the state before the closure
        closure = kwargs.pop("closure", None)
        result = closure() if closure is not None else None
        if closure is not None:  # handed on already run (dropped where the loss is scaled, as GradScaler.step does)
            kwargs["closure"] = lambda: result
        self.amp.step(state.optimizer, **kwargs)
        return result

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Divide ``optimizer``'s grads by their loss scale now (``fabric.clip_gradients`` calls this first)."""
        self._state(optimizer).unscale()

    def main_params(self, optimizer: Optimizer) -> Generator[Tensor, None, None]:
        """The params ``optimizer`` steps on (the module's own params at every level)."""
        for group in self._state(optimizer).optimizer.param_groups:
            yield from group["params"]

    # ---- checkpoints -------------------------------------------------------------------

    def _scaler_into_optimizer_state(self, optimizer: Optimizer, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        state = self._state(optimizer)
        if state_dict["param_groups"]:
            state_dict["param_groups"][0] = {**state_dict["param_groups"][0],
                                             _STATE_KEY: {"scaler": state.scaler.state_dict(), "skipped": state.skipped}}
        return state_dict

    def _scaler_from_optimizer_state(self, optimizer: Optimizer) -> None:
        saved = optimizer.param_groups[0].pop(_STATE_KEY, None) if optimizer.param_groups else None
        if saved is not None:
            self._restore(self._state(optimizer), saved)

    @staticmethod
    def _restore(state: OptimizerStep, saved: Dict[str, Any]) -> None:
        state.scaler.load_state_dict(saved["scaler"])
        state.skipped = int(saved["skipped"])


level_classes(FabricAmpPrecision, globals())  # FabricAmpO0Precision .. FabricAmpO3Precision, FabricAmpAutoPrecision
FabricAmpAutoPrecision: type[FabricAmpPrecision]
FabricAmpO0Precision: type[FabricAmpPrecision]
FabricAmpO1Precision: type[FabricAmpPrecision]
FabricAmpO2Precision: type[FabricAmpPrecision]
FabricAmpO3Precision: type[FabricAmpPrecision]


_DEPRECATED_NAMES = {"AmpPrecision": FabricAmpPrecision, "AmpO0Precision": FabricAmpO0Precision,
                     "AmpO1Precision": FabricAmpO1Precision, "AmpO2Precision": FabricAmpO2Precision,
                     "AmpO3Precision": FabricAmpO3Precision}


def deprecated_name(module: str, name: str) -> type:
    """The class a former name of a Fabric plugin stands for, with a FutureWarning (for ``module``'s
    ``__getattr__``): the Fabric plugins were renamed ``Fabric...`` because ``AmpPrecision`` named both a
    Trainer and a Fabric class, which LightningCLI's ``--trainer.plugins AmpPrecision`` could not resolve."""
    cls = _DEPRECATED_NAMES.get(name)
    if cls is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"lightning_amp.fabric.{name} is deprecated: use lightning_amp.fabric.{cls.__name__} (same class; "
                  "renamed so that LightningCLI tells the Fabric plugins from the Trainer's)", FutureWarning,
                  stacklevel=3)
    return cls


def __getattr__(name: str) -> type:
    return deprecated_name(__name__, name)
