"""AmpPrecision and AmpO0Precision..AmpO3Precision: the same mixed precision for Lightning Fabric.

``Fabric(plugins=[AmpO2Precision()])``: the options, the forward and the step are those of the
Trainer plugins (:class:`lightning_amp.precision.AmpPrecision`, one
:class:`~lightning_amp.amp.engine.AmpEngine`); this file only maps Fabric's hooks onto the engine.

* ``convert_module`` (in ``fabric.setup``) casts the model in place. Under master weights (O2) each
  half param becomes a new half ``Parameter`` of the module while the ``Parameter`` the user's
  optimizer holds stays fp32 and becomes its master (value: the half weight, as under the Trainer):
  the optimizer and its state are fp32 from the start, so ``fabric.load`` restores them exactly.
* Fabric never hands a precision plugin its optimizers: each optimizer is connected to the engine
  the first time the plugin sees it (``optimizer_step``, ``unscale_gradients``, i.e. the first
  ``optimizer.step()`` or ``fabric.clip_gradients``). Until then backwards run at scale 1 and, under
  O2, half grads are added into the masters' fp32 grads after each synced backward.
* ``backward`` multiplies the loss by the scale; ``post_backward`` moves O2 half grads into the fp32
  master grads (after a ``fabric.no_backward_sync`` backward the grads stay local and are averaged
  after the next synced one, as under the Trainer).
* ``optimizer.step()`` runs :meth:`AmpEngine.step`: unscale, agree on inf/nan across ranks, step or
  skip on the device. ``fabric.clip_gradients`` unscales first and clips the fp32 grads the optimizer
  steps on; with dynamic loss scaling pass ``error_if_nonfinite=False`` (overflowing steps are skipped).
* Checkpoints: the module's ``state_dict()`` holds the fp32 master values (O2) and the optimizer's
  ``state_dict()`` carries its loss scaler (``param_groups[0]["lightning_amp"]``), so
  ``fabric.save(path, {"model": model, "optimizer": optimizer})`` / ``fabric.load`` resume exactly.
* LR schedulers: Fabric does not see them; call :func:`~lightning_amp.amp.gate.make_scheduler_skip_aware`
  on a per-step scheduler so that it does not advance on skipped steps.
"""
from __future__ import annotations

from typing import Any, Dict, Generator, List, Optional

import torch
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from torch import Tensor
from torch.nn import Module, Parameter
from torch.nn.parallel import DistributedDataParallel
from torch.optim import LBFGS, Optimizer
from torch.utils._pytree import tree_leaves

from lightning_amp.amp.master import load_masters, masters_into_state_dict
from lightning_amp.amp.module_cast import cast_floating
from lightning_amp.amp.step import OptimizerStep
from lightning_amp.precision import AmpPrecision as _TrainerAmpPrecision
from lightning_amp.precision import _no_opt_level

_STATE_KEY = "lightning_amp"  # where an optimizer's state_dict carries its scaler (in param_groups[0])
_TRAINER_NAMES = {"AmpPrecision": "AmpPrecision", "AmpO0Precision": "AmpO0Plugin", "AmpO1Precision": "AmpO1Plugin",
                  "AmpO2Precision": "AmpO2Plugin", "AmpO3Precision": "AmpO3Plugin"}


class AmpPrecision(_TrainerAmpPrecision):
    """Apex-style mixed precision (opt levels O0-O3) as a Lightning Fabric precision plugin.

    Same arguments and properties (``loss_scale``, ``skipped_steps``, ``last_nonfinite_params``, ...) as
    :class:`lightning_amp.AmpPrecision`; see the module docstring for how Fabric's hooks map onto it.
    Given to a ``Trainer`` it raises TypeError naming the Trainer plugin to use.
    """

    def __init__(self, opt_level: str = "O1", **kwargs: Any) -> None:
        super().__init__(opt_level=opt_level, **kwargs)
        self._half_of: Dict[Tensor, Tensor] = {}  # O2: the optimizer's fp32 Parameter -> the module's half one
        self._masters_loaded = False

    # ---- setup -------------------------------------------------------------------------

    def convert_module(self, module: Module) -> Module:
        """Cast ``module`` in place (O2: the half params are new Parameters; see the module docstring)."""
        if getattr(module, "_trainer", None) is not None:
            name = _TRAINER_NAMES.get(type(self).__name__, "AmpPrecision")
            raise TypeError(f"{type(self).__name__} is a Lightning Fabric plugin; with the Trainer use "
                            f"lightning_amp.{name}(...): `Trainer(plugins=[{name}()])`.")
        self._convert_module(module)
        registry: Dict[Tensor, Tensor] = {}
        if self._properties.master_weights:
            for sub in module.modules():
                for key, param in list(sub._parameters.items()):
                    if param is None or param.dtype not in (torch.float16, torch.bfloat16):
                        continue
                    half = self._half_of.get(param)
                    if half is None:  # ``param`` (the user's optimizer holds it) becomes the fp32 master
                        half = Parameter(param.detach().clone(), requires_grad=param.requires_grad)
                        param.data = param.data.float()
                        self._half_of[param] = half
                        registry[half] = param
                    sub._parameters[key] = half
        names: Dict[Tensor, List[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(param, []).append(name)
        self._engine.connect([], names, registry)
        module.register_forward_pre_hook(self._find_ddp)
        if registry:
            # torch marks the hook object: a function, not a bound method
            module.register_state_dict_post_hook(lambda *args: self._masters_into_state_dict(*args))
            module.register_load_state_dict_pre_hook(lambda *args: self._masters_from_state_dict(*args))
        return module

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        """A Trainer hook: this plugin is for Fabric."""
        raise TypeError(f"{type(self).__name__} is a Lightning Fabric plugin; with the Trainer use "
                        f"lightning_amp.{_TRAINER_NAMES.get(type(self).__name__, 'AmpPrecision')}(...).")

    def _find_ddp(self, module: Module, args: Any) -> None:
        self._ddp = DistributedDataParallel._get_active_ddp_module()

    def _state(self, optimizer: Optimizer) -> OptimizerStep:
        """The engine's state of ``optimizer``, connecting it the first time (see the module docstring)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a _FabricOptimizer wraps the real one
        for state in self._engine.states:
            if state.optimizer is optimizer:
                return state
        halves = self._half_of
        for group in optimizer.param_groups:
            for master in group["params"]:
                half = halves.get(master)
                if half is not None and master.device != half.device:  # Fabric moved the module after convert
                    master.data = master.data.to(half.device)
                if half is not None and not self._masters_loaded:  # DDP broadcast rank 0's half weights
                    master.data.copy_(half.data)
            group["params"] = [halves.get(p, p) for p in group["params"]]  # the engine maps halves to masters
        if halves:
            _optimizer_to_device(optimizer, next(iter(halves.values())).device)
        saved = optimizer.param_groups[0].pop(_STATE_KEY, None) if optimizer.param_groups else None
        state = self._engine.add_optimizer(optimizer)
        if saved is not None:
            self._restore(state, saved)
        optimizer.register_state_dict_post_hook(self._scaler_into_optimizer_state)
        optimizer.register_load_state_dict_post_hook(self._scaler_from_optimizer_state)
        return state

    # ---- the step ----------------------------------------------------------------------

    def convert_input(self, data: Any) -> Any:
        """O2/O3: floating tensors become the half dtype; the autocast device follows the batch's."""
        tensor = next((t for t in tree_leaves(data) if isinstance(t, Tensor)), None)
        if tensor is not None and tensor.device.type != self._device_type:
            self._device_type = tensor.device.type
        return cast_floating(data, self._properties.dtype) if self._properties.cast_model else data

    def pre_backward(self, tensor: Tensor, module: Optional[Module]) -> Any:  # type: ignore[override]
        return None  # Fabric drops what this returns: the loss is scaled in backward()

    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Backward of the loss times the current loss scale."""
        self._scaled(tensor).backward(*args, **kwargs)

    def post_backward(self, tensor: Tensor, module: Optional[Module]) -> Any:  # type: ignore[override]
        """O2: half grads into the fp32 master grads (a ``no_backward_sync`` backward's stay local until the next)."""
        ddp = self._ddp
        synced = ddp is None or ddp.require_backward_grad_sync
        if self._engine.states:
            self._engine.move_grads_to_masters(synced, getattr(ddp, "process_group", None))
        elif synced and self._half_of:
            for master, half in self._half_of.items():
                if half.grad is not None:
                    master.grad = half.grad.float() if master.grad is None else master.grad.add_(half.grad)
                    half.grad = None
        return tensor

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """``optimizer.step()``: unscale, agree on inf/nan across ranks, step or skip on the device."""
        state = self._state(optimizer)
        if isinstance(state.optimizer, LBFGS):  # allowed only without scaling: needs its closure
            return state.optimizer.step(**kwargs)
        closure = kwargs.pop("closure", None)
        result = closure() if closure is not None else None
        self._engine.step(state.optimizer, lambda: None, clipping=False, **kwargs)
        return result

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Divide ``optimizer``'s grads by their loss scale now (``fabric.clip_gradients`` calls this first)."""
        self._state(optimizer).unscale()

    def main_params(self, optimizer: Optimizer) -> Generator[Tensor, None, None]:  # type: ignore[override]
        """The params ``optimizer`` steps on (the fp32 masters under O2)."""
        for group in self._state(optimizer).optimizer.param_groups:
            yield from group["params"]

    # ---- checkpoints -------------------------------------------------------------------

    def _masters_into_state_dict(self, module: Module, state_dict: Dict[str, Any], prefix: str, *_: Any) -> None:
        pairs = [(half, master) for master, half in self._half_of.items()]
        self._engine.report_masters(masters_into_state_dict(pairs, self._prefixed(prefix), state_dict), "saved")

    def _masters_from_state_dict(self, module: Module, state_dict: Dict[str, Any], prefix: str, *_: Any) -> None:
        holder = _Pairs([(half, master) for master, half in self._half_of.items()])
        self._engine.report_masters(load_masters(holder, self._prefixed(prefix), state_dict), "loaded")
        self._masters_loaded = True

    def _prefixed(self, prefix: str) -> Dict[Tensor, List[str]]:
        return {p: [prefix + n for n in names] for p, names in self._engine.param_names.items()}

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


class _Pairs:
    """The (half, master) pairs in the shape :func:`~lightning_amp.amp.master.load_masters` reads."""

    def __init__(self, pairs: List[Any]) -> None:
        self.pairs = pairs

    @torch.no_grad()
    def load_masters_(self, values: Dict[Tensor, Tensor]) -> None:
        for half, master in self.pairs:
            if half in values:
                master.copy_(values[half])
                half.copy_(master)


class AmpO0Precision(AmpPrecision):
    """Apex O0 for Fabric: fp32 everything (non-finite grads are still skipped)."""

    def __init__(self, **kwargs: Any) -> None:
        _no_opt_level(kwargs, "AmpO0Precision")
        super().__init__(opt_level="O0", **kwargs)


class AmpO1Precision(AmpPrecision):
    """Apex O1 for Fabric: fp32 model, forward under autocast plus the cast lists."""

    def __init__(self, **kwargs: Any) -> None:
        _no_opt_level(kwargs, "AmpO1Precision")
        super().__init__(opt_level="O1", **kwargs)


class AmpO2Precision(AmpPrecision):
    """Apex O2 for Fabric: half model (BatchNorm fp32), fp32 master weights in the optimizer."""

    def __init__(self, **kwargs: Any) -> None:
        _no_opt_level(kwargs, "AmpO2Precision")
        super().__init__(opt_level="O2", **kwargs)


class AmpO3Precision(AmpPrecision):
    """Apex O3 for Fabric: pure half."""

    def __init__(self, **kwargs: Any) -> None:
        _no_opt_level(kwargs, "AmpO3Precision")
        super().__init__(opt_level="O3", **kwargs)

