"""What the Trainer plugin (:mod:`lightning_amp.trainer.precision`) and the Fabric plugin
(:mod:`lightning_amp.fabric.precision`) share: their constructor (the options of one opt level, building the
:class:`~lightning_amp.amp.runtime.AmpRuntime` each holds as ``plugin.amp``), their read-only views of it,
their names, and the per-level classes made from :data:`~lightning_amp.amp.levels.LEVEL_DEFAULTS`.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_amp._keywords import checks_keywords
from lightning_amp.amp.ladder.ladder import AmpLadder
from lightning_amp.amp.ladder.rules import LadderRules
from lightning_amp.amp import process_state
from lightning_amp.amp.levels import (LEVEL_SUMMARIES, OPT_LEVELS, AmpProperties, DtypeName, NormPolicyName,
                                      OptLevelName, OutputDtypeName)
from lightning_amp.amp.runtime import AmpRuntime, is_auto
from lightning_amp.amp.scaler import SCALER_DEFAULTS, LossScaler

Kind = Literal["trainer", "fabric"]
_STATE_VERSION = 1
AUTO = "auto"

#: the process-wide changes of Lightning the plugins hold (:mod:`~lightning_amp.amp.process_state`), made by
#: :mod:`lightning_amp.plugin_kinds` and :mod:`lightning_amp.trainer.precision`
CONNECTORS_CHANGE = "Lightning's Fabric and Trainer connector constructors (a plugin given to the other Lightning refused)"
THROUGHPUT_CHANGE = "Lightning's ThroughputMonitor dtype lookup (our Trainer plugins' half dtype)"

def _give_back(changes: List[Any]) -> None:
    for change in changes:
        change.release()


def plugin_name(kind: Kind, opt_level: Optional[str] = None) -> str:
    """The public class name of the ``kind`` plugin of ``opt_level`` (None: the one that takes ``opt_level``):
    ``AmpPrecision``/``AmpO2Precision`` for the Trainer, ``FabricAmpPrecision``/``FabricAmpO2Precision`` for Fabric."""
    level = "" if opt_level is None else "Auto" if is_auto(opt_level) else opt_level
    return f"{'Amp' if kind == 'trainer' else 'FabricAmp'}{level}Precision"


def former_name(kind: Kind, opt_level: str) -> Optional[str]:
    """The name the ``kind`` class of ``opt_level`` had before the classes were named ``...Precision`` as Lightning's
    (``AmpO2Plugin``), kept as a subclass of it that adds nothing (so LightningCLI still finds it by its short name);
    None where the name is the same."""
    return f"Amp{'Auto' if is_auto(opt_level) else opt_level}Plugin" if kind == "trainer" else None


@checks_keywords(apex_options=True)
class AmpPluginBase:
    """Mixin of both Lightning plugins (first in their bases, before Lightning's ``Precision``).

    Args:
        opt_level: "O0" (fp32), "O1" (autocast + cast lists), "O2" (fp32 params, forward under autocast
            with norms, softmax and activations kept half, fp32 BatchNorm, fp32 grads and update),
            "O3" (pure half); case-insensitive. "auto": the precision ladder (:mod:`lightning_amp.amp.ladder`):
            the run starts on the first rung of ``ladder`` and moves one rung down, rolling back to its last good
            snapshot, when ``ladder_rules`` say it is not converging (docs/opt-levels.md).
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
        warn_on_fp32_stream: O2: one ``Fp32StreamWarning`` the first time an fp32 activation promotes the half
            residual stream to fp32, naming the op, the module and the ways out (default True; False: silent).
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
        min_loss_scale, max_loss_scale: the dynamic :class:`~lightning_amp.amp.scaler.LossScaler`.
        combine_grad: the grads of the params each optimizer steps on live as views in one flat
            buffer per (device, dtype) (:class:`~lightning_amp.amp.flat.FlatGradBuffer`); unscaling is one call per buffer.
        fused_update: a plain ``torch.optim.Adam``/``AdamW``/``SGD`` is stepped by lightning_amp's
            fused kernels (unscaled grads, skip decided on the device, one pass over params and
            state; :mod:`lightning_amp.amp.kernel_step` says which group
            options qualify). False: the optimizer's own ``step()`` runs, and the skip is decided
            on the host.
        log_metrics: the Trainer plugin logs ``amp/loss_scale`` and ``amp/skipped_steps`` through
            ``LightningModule.log`` on the Trainer's logging steps, so they appear in the logger and in
            ``trainer.logged_metrics`` (default True); False logs nothing. Fabric's plugins log nothing
            either way (Fabric hands a precision plugin no logger).
        ladder: with ``opt_level="auto"``: the rungs, ``[("O2", 128.0), ("O1", 128.0), ("O1", "dynamic")]`` style
            (levels O0-O2, a loss scale for float16 only); None: that default for float16, O2 -> O1 -> O0 for bfloat16.
        ladder_rules: with ``opt_level="auto"``: a :class:`~lightning_amp.amp.ladder.rules.LadderRules` (None: its defaults).
            The dynamic-scaler keywords then configure the ladder's dynamic rungs (its static rungs ignore them).

    Properties: ``loss_scale`` (current scale of the first optimizer), ``loss_scales`` (all),
    ``skipped_steps`` (optimizer steps skipped for non-finite grads), ``properties``; ``amp`` is the runtime.
    """

    #: the opt level a per-level class fixes (None: the class takes ``opt_level``)
    fixed_opt_level: Optional[str] = None
    #: which Lightning the plugin is for (names in messages, :func:`plugin_name`)
    kind: Kind

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
        log_metrics: bool = True,
        ladder: Optional[Sequence[Any]] = None,
        ladder_rules: Optional[LadderRules] = None,
        warn_on_fp32_stream: bool = True,
    ) -> None:
        if not isinstance(log_metrics, bool):
            raise TypeError(f"`log_metrics` must be True or False; got {log_metrics!r}")
        super().__init__()
        #: whether the Trainer plugin logs ``amp/loss_scale`` and ``amp/skipped_steps``
        self.log_metrics = log_metrics
        scaler_kwargs = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                             growth_interval=growth_interval, hysteresis=hysteresis,
                             min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale)
        #: the runtime of the level (and of the ladder with "auto"): prepare, forward context, backward, step, release
        self.amp = AmpRuntime(opt_level, dtype, loss_scale, keep_batchnorm_fp32, master_weights, cast_model_outputs,
                              half_buffers, norm_policy, scaler_kwargs, combine_grad, fused_update, warn=rank_zero_warn,
                              ladder=ladder, ladder_rules=ladder_rules, warn_on_fp32_stream=warn_on_fp32_stream)
        self.hold_lightning_changes()

    @property
    def ladder(self) -> Optional[AmpLadder]:
        """The precision ladder of ``opt_level="auto"`` (its rung, moves, snapshots), None at a fixed level."""
        return self.amp.ladder

    @property
    def precision(self) -> str:  # type: ignore[override]
        """Lightning's name of the nearest of its own precisions: "32-true" (O0), "bf16-mixed"/"16-mixed"
        (O1, O2), "bf16-true"/"16-true" (O3)."""
        props = self.amp.properties
        half = "bf16" if props.dtype == torch.bfloat16 else "16"
        if props.opt_level == "O0":
            return "32-true"
        return f"{half}-true" if props.opt_level == "O3" else f"{half}-mixed"

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """Tensors created inside (``Trainer.init_module``) have the dtype of the level's params: half at O3,
        as under Lightning's ``bf16-true``/``16-true`` (the default dtype, restored on exit); fp32 otherwise."""
        return self.amp.init_context()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """A module created inside (``Fabric.init_module``) gets the level's param dtype: :meth:`tensor_init_context`."""
        return self.tensor_init_context()

    @property
    def properties(self) -> AmpProperties:
        """The resolved opt-level properties (dtype "auto" is resolved for the model's device at setup)."""
        return self.amp.properties

    @property
    def combine_grad(self) -> bool:
        return self.amp.combine_grad

    @property
    def fused_update(self) -> bool:
        return self.amp.fused_update

    @property
    def loss_scale(self) -> float:
        """Current loss scale of the first optimizer (the initial scale before setup): the factor its grads
        carry after a backward (a float16 loss caps it at 2**15, :meth:`~lightning_amp.amp.scaler.LossScaler.cap`),
        so ``p.grad / plugin.loss_scale`` between backward and step is the true gradient."""
        return self.amp.loss_scale

    @property
    def loss_scales(self) -> List[float]:
        """Current loss scale of every optimizer, in the order they were connected."""
        return self.amp.loss_scales

    @property
    def scalers(self) -> List[LossScaler]:
        """The LossScaler of every optimizer."""
        return self.amp.scalers

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because of non-finite gradients (all optimizers, across the ladder's
        moves and resumes; waits for the flags of steps still on their way to the host)."""
        return self.amp.skipped_steps

    @property
    def last_nonfinite_params(self) -> List[str]:
        """Names of the params whose grads were non-finite at the last skipped step (this rank's view)."""
        return self.amp.last_nonfinite_params

    def state_dict(self) -> Dict[str, Any]:
        """Scaler state of every optimizer and the skipped-step counts (with "auto": the ladder's rung, reason and
        snapshot step): :meth:`AmpRuntime.state_dict`."""
        return {"version": _STATE_VERSION, **self.amp.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "loss_scalers" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: `state_dict` must come from an AmpPrecision plugin "
                f"(with a 'loss_scalers' list); got keys {sorted(state_dict) if isinstance(state_dict, dict) else state_dict!r}"
            )
        self.amp.load_state_dict(state_dict)

    def teardown(self) -> None:
        """End of a run: the model handed back as a plain module (:meth:`AmpRuntime.release`), the changes of
        Lightning given back (:meth:`hold_lightning_changes`); the next setup prepares it again."""
        self.amp.release()
        self.give_back_lightning_changes()
        super().teardown()  # type: ignore[misc]

    # ---- the changes of Lightning a plugin holds ---------------------------------------

    #: names of the process-wide changes (:data:`CONNECTORS_CHANGE`, ...) a plugin of this class holds
    lightning_changes: Tuple[str, ...] = (CONNECTORS_CHANGE,)

    def hold_lightning_changes(self) -> None:
        """Hold :attr:`lightning_changes` (:mod:`~lightning_amp.amp.process_state`: the first holder wraps Lightning's
        objects, the last one puts them back): from the plugin's construction, and again when it is set up after a
        teardown or unpickled in a spawned process, until :meth:`teardown` or until the plugin is collected."""
        if getattr(self, "_lightning_hold", None) is not None and self._lightning_hold.alive:
            return
        changes = [process_state.CHANGES[name] for name in self.lightning_changes]
        for change in changes:
            change.acquire()
        self._lightning_hold = weakref.finalize(self, _give_back, changes)

    def given_to_lightning(self, connector: Any) -> None:
        """Lightning built the connector of a Trainer or Fabric given this plugin (:mod:`lightning_amp.plugin_kinds`):
        nothing here; Fabric's plugin checks the strategy."""

    def give_back_lightning_changes(self) -> None:
        hold = getattr(self, "_lightning_hold", None)
        if hold is not None:
            hold()  # once: a finalizer runs at most once

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        hold = state.pop("_lightning_hold", None)
        state["_lightning_held"] = hold is not None and hold.alive
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        held = state.pop("_lightning_held", False)
        self.__dict__.update(state)
        if held:
            self.hold_lightning_changes()

    def __repr__(self) -> str:
        """The options as asked: ``opt_level='auto'`` with the rung the run is on now, else the level's loss scale."""
        props = self.properties
        if self.ladder is not None:
            return f"{type(self).__name__}(opt_level='auto', dtype={props.dtype}, rung='{self.ladder.rung}')"
        return f"{type(self).__name__}(opt_level={props.opt_level!r}, dtype={props.dtype}, loss_scale={props.loss_scale!r})"


class _FixedLevel:
    """The constructor of a per-level class: every option but ``opt_level``, which the class fixes."""

    fixed_opt_level: str
    kind: Kind

    def __init__(self, **kwargs: Any) -> None:
        if "opt_level" in kwargs:
            raise TypeError(f"{type(self).__name__} fixes the opt level; use {plugin_name(self.kind)}(opt_level=...) "
                            "to choose one")
        super().__init__(opt_level=self.fixed_opt_level, **kwargs)  # type: ignore[call-arg]


def level_classes(base: type, namespace: Dict[str, Any]) -> None:
    """Define ``base``'s class of every opt level in ``namespace`` (a module's globals), named by
    :func:`plugin_name` (and bound to its :func:`former_name` too) and documented from
    :data:`~lightning_amp.amp.levels.LEVEL_SUMMARIES`."""
    for level in OPT_LEVELS + (AUTO,):
        name = plugin_name(base.kind, level)
        summary = LEVEL_SUMMARIES.get(level, "the precision ladder (``opt_level=\"auto\"``): starts on its first rung "
                                             "and moves one rung down, with a rollback, when the run is not converging.")
        doc = (f"Apex {level} for {'Lightning Fabric' if base.kind == 'fabric' else 'the Lightning Trainer'}: "
               f"{summary} Same keyword arguments as :class:`{base.__module__}.{base.__name__}` but ``opt_level``.")
        namespace[name] = type(name, (_FixedLevel, base), {
            "fixed_opt_level": level, "__doc__": doc, "__module__": namespace["__name__"], "__qualname__": name})
        former = former_name(base.kind, level)
        if former:  # a subclass, not the same object: LightningCLI resolves a short name by the class's own name
            namespace[former] = type(former, (namespace[name],), {
                "__doc__": f"The former name of :class:`{name}` (the same plugin; {name} is the name to use).",
                "__module__": namespace["__name__"], "__qualname__": former})
