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

``opt_level="auto"`` runs the precision ladder (:class:`~lightning_amp.amp.ladder.ladder.AmpLadder`, ``amp.ladder``)
inside the same calls: :meth:`step` snapshots before and decides after each step of the first optimizer, and a
move rolls back :meth:`rollback_objects` (the model, every optimizer, :attr:`rollback_extras`). A loop that runs
its forward and backward inside the step (the Trainer's closure) calls :meth:`begin_step` first::

    amp = AmpRuntime("auto", dtype="float16")           # the float16 ladder: O2/128 -> O1/128 -> O1/dynamic
    amp.rollback_extras["scheduler"] = scheduler        # what else a rollback restores
    ... as above; amp.log_loss(loss) feeds the loss-spike rule ...

O2's op policy (:mod:`~lightning_amp.amp.o2.policy`) is registered process-wide while held:
``prepare(module, hold_policy=True)`` holds it until :meth:`release` (a Trainer run);
``hold_policy=False`` holds it for each forward context only (Fabric, which has no end of run); a
recomputing backward holds it for its own duration either way.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.nn import Module

from lightning_amp.amp import forward as amp_forward
from lightning_amp.amp.engine import AmpEngine
from lightning_amp.amp.fsdp2 import fsdp2_half_compute_, is_fsdp2
from lightning_amp.amp.ladder.ladder import AmpLadder, Move
from lightning_amp.amp.ladder.rules import LadderRules
from lightning_amp.amp.levels import AmpProperties, LossScaleSpec, resolve_properties
from lightning_amp.amp.module_cast import (cast_floating, cast_module_, cast_outputs_hook, default_dtype,
                                           prepare_o2_module_)
from lightning_amp.amp.o2 import stream_watch
from lightning_amp.amp.o2.policy import PolicyHold, held as held_o2_policy, hold as hold_o2_policy
from lightning_amp.amp.recompute import recompute_context
from lightning_amp.amp.release import release_module_
from lightning_amp.amp.scaler import SCALER_DEFAULTS, LossScaler, check_scaler_keywords, checked_scaler_options
from lightning_amp.amp.step import OptimizerStep


def named_params(module: Module) -> Dict[Tensor, List[str]]:
    """Every param of ``module`` -> all of its names (shared params have several): for messages."""
    names: Dict[Tensor, List[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return names


def is_auto(opt_level: Any) -> bool:
    """Whether ``opt_level`` asks for the precision ladder (``"auto"``, any case)."""
    return isinstance(opt_level, str) and opt_level.strip().lower() == "auto"


def casts_batch(props: AmpProperties) -> bool:
    """Whether the batch's floating tensors are cast to half before forward: the pure half model (O3)."""
    return props.cast_model and not props.autocast


class AmpRuntime:
    """One opt level's runtime (see the module docstring).

    Args:
        opt_level: "O0".."O3", or "auto": the precision ladder, starting on the first rung of ``ladder``.
        dtype, loss_scale, keep_batchnorm_fp32, master_weights, cast_model_outputs, half_buffers,
            norm_policy: the level and its overrides (:func:`~lightning_amp.amp.levels.resolve_properties`);
            with "auto" ``loss_scale`` is set per rung.
        scaler_kwargs: the dynamic :class:`LossScaler` keywords (:data:`~lightning_amp.amp.scaler.SCALER_DEFAULTS`
            for those left out); with "auto" they configure the ladder's dynamic rungs (its static rungs ignore them).
        combine_grad, fused_update: as :class:`~lightning_amp.amp.step.OptimizerStep`.
        device_type: where the model computes ("cpu", "cuda", ...); None: "cuda" when available, else "cpu".
        warn: how warnings are issued (the Lightning plugins pass a rank-zero warn).
        ladder, ladder_rules: with "auto": the rungs and the :class:`~lightning_amp.amp.ladder.rules.LadderRules`
            (:class:`~lightning_amp.amp.ladder.ladder.AmpLadder`; None: the defaults).
        warn_on_fp32_stream: O2: one :class:`~lightning_amp.amp.o2.stream_watch.Fp32StreamWarning` the first time
            an fp32 activation promotes the half stream, from :meth:`prepare` to :meth:`release` (True or False).

    Raises ValueError (TypeError for an unknown scaler keyword) naming the argument for any invalid option, at
    construction.
    """

    def __init__(self, opt_level: str = "O1", dtype: Union[str, torch.dtype] = "auto",
                 loss_scale: Optional[LossScaleSpec] = None, keep_batchnorm_fp32: Optional[bool] = None,
                 master_weights: Optional[bool] = None, cast_model_outputs: Optional[Union[str, torch.dtype]] = None,
                 half_buffers: Optional[bool] = None, norm_policy: Optional[str] = None,
                 scaler_kwargs: Optional[Dict[str, Any]] = None, combine_grad: bool = False,
                 fused_update: bool = True, device_type: Optional[str] = None,
                 warn: Callable[[str], Any] = warnings.warn, ladder: Optional[Sequence[Any]] = None,
                 ladder_rules: Optional[LadderRules] = None, warn_on_fp32_stream: bool = True) -> None:
        for name, value in (("combine_grad", combine_grad), ("fused_update", fused_update)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False; got {value!r}")
        if not isinstance(warn_on_fp32_stream, bool):
            raise TypeError(f"`warn_on_fp32_stream` must be True or False; got {warn_on_fp32_stream!r}")
        #: O2: warn once when an fp32 activation promotes the half stream (:mod:`~lightning_amp.amp.o2.stream_watch`)
        self.warn_on_fp32_stream = warn_on_fp32_stream
        checked_scaler_options(**(scaler_kwargs or {}))
        #: the precision ladder of ``opt_level="auto"`` (None at a fixed level)
        self.ladder: Optional[AmpLadder] = None
        if is_auto(opt_level):
            if loss_scale is not None:
                raise ValueError('`loss_scale` is set per rung with opt_level="auto": pass '
                                 '`ladder=[(opt_level, loss_scale), ...]`, e.g. [("O2", 128.0), ("O1", "dynamic")]')
            self.ladder = AmpLadder(ladder, ladder_rules, warn=warn)
            opt_level, loss_scale = self.ladder.rung
        elif ladder is not None or ladder_rules is not None:
            raise ValueError(f'`ladder` and `ladder_rules` are for opt_level="auto"; got opt_level={opt_level!r}')
        #: the level as asked for (None: the level's default), resolved per device by :meth:`resolve_for`
        self.request: Dict[str, Any] = dict(opt_level=opt_level, dtype=dtype, loss_scale=loss_scale,
                                            keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
                                            cast_model_outputs=cast_model_outputs, half_buffers=half_buffers,
                                            norm_policy=norm_policy)
        self.scaler_kwargs: Dict[str, Any] = {**SCALER_DEFAULTS, **(scaler_kwargs or {})}
        self.combine_grad, self.fused_update, self.warn = combine_grad, fused_update, warn
        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        self.properties = self._resolve(self.device_type)
        self.engine = AmpEngine(self.new_scaler, self.check_optimizer, combine_grad, fused_update, warn=warn)
        #: with "auto": more objects a rollback restores (name -> object with ``state_dict``/``load_state_dict``),
        #: e.g. ``{"scheduler": scheduler}`` (:meth:`rollback_objects`)
        self.rollback_extras: Dict[str, Any] = {}
        self.module: Optional[Module] = None  # the model prepare() cast, until release()
        self._policy: Optional[PolicyHold] = None  # O2's op policy held from prepare() to release()
        self._policy_per_forward = False
        self._fsdp2_checked = False  # see _half_params_by_fsdp2
        self._watched_gate: Any = None  # the gate whose flags go to the ladder (the first optimizer's)
        if self.ladder is not None:
            self._check_ladder()

    # ---- the level ---------------------------------------------------------------------

    def _resolve(self, device_type: str) -> AmpProperties:
        props = resolve_properties(**self.request, device_type=device_type)
        if self.ladder is None:  # with the ladder they configure its dynamic rungs
            check_scaler_keywords(props, self.request["loss_scale"], self.scaler_kwargs, self.warn)
        return props

    def resolve_for(self, device_type: str) -> None:
        """The model computes on ``device_type``: dtype "auto" and the level's defaults resolve for it."""
        if device_type != self.device_type:
            self.device_type = device_type
            self.properties = self._resolve(device_type)
            if self.ladder is not None:
                self._check_ladder()

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
        if self.warn_on_fp32_stream and amp_forward.uses_o2_policy(props):
            stream_watch.arm(module)
        return module

    def release(self) -> None:
        """End of a run: the prepared model handed back plain (:func:`~lightning_amp.amp.release.release_module_`),
        O2's op policy unregistered. Idempotent; :meth:`prepare` makes the model ready again."""
        module, self.module = self.module, None
        if module is not None:
            release_module_(module, self.properties)
            stream_watch.disarm()
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
        if self.ladder is not None:
            self.ladder.note_forward()
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

    def begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer step begins: call before its closure where the loop runs the forward and backward inside
        the step (the Trainer); :meth:`step` calls it too (idempotent). With the ladder and the first optimizer,
        its rollback points (:meth:`AmpLadder.before_step`)."""
        if self._laddered(optimizer):
            self._watch_first_gate()
            self.ladder.before_step(self.rollback_objects, self._ladder_device())

    def step(self, optimizer: torch.optim.Optimizer, after_unscale: Callable[[], None] = lambda: None,
             grads_read: bool = False, after_step: Callable[[], None] = lambda: None, **step_kwargs: Any) -> None:
        """Unscale (or only check), agree on inf/nan across ranks, ``after_unscale()``, then step or skip on
        the device (:meth:`AmpEngine.step`), then ``after_step()`` (e.g. log :meth:`metrics`: the level and scale
        this step ran at); with the ladder and the first optimizer, the snapshot before and the decision after all
        that (a move rolls back :meth:`rollback_objects` and changes the level)."""
        laddered = self._laddered(optimizer)
        if laddered:
            self.begin_step(optimizer)
        self.engine.step(optimizer, after_unscale, grads_read, **step_kwargs)
        after_step()
        if laddered:
            move = self.ladder.after_step(self._ladder_device())
            if move is not None:
                self._apply_move(move)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s grads by their loss scale now (idempotent until the next backward)."""
        self.engine.state_of(optimizer).unscale()

    # ---- the ladder (opt_level="auto") -------------------------------------------------

    def _laddered(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s steps drive the ladder: the first optimizer connected (the others' steps are
        rolled back with it)."""
        return self.ladder is not None and self.engine.state_of(optimizer) is self.engine.states[0]

    def _check_ladder(self) -> None:
        """The ladder's rungs checked against the options and the device (ValueError naming the rung), the level
        that of its current rung."""
        def props_of(rung: Any) -> AmpProperties:
            return resolve_properties(**{**self.request, "opt_level": rung.opt_level, "loss_scale": rung.loss_scale},
                                      device_type=self.device_type)

        self.ladder.check_rungs(self.properties.dtype, props_of)
        self._go_to_rung(self.ladder.index)

    def _go_to_rung(self, index: int) -> None:
        rung = self.ladder.rungs[index]
        if (self.properties.opt_level, self.request["loss_scale"]) != (rung.opt_level, rung.loss_scale):
            self.change_level(rung.opt_level, rung.loss_scale)

    def _apply_move(self, move: Move) -> None:
        """A decision of the ladder applied, the one place that does it, in this order: the flags still on their way
        settle on the old state (deferred scheduler calls included); at a step, the rollback point restored; the
        level of the new rung (fresh scalers: at a resume the checkpoint's are loaded after this); the step that
        moved marked skipped (an LR scheduler call after it is void); the ladder told."""
        for state in self.engine.states:
            state.gate.poll(wait=True)
        names = list(self.engine.last_nonfinite_params)
        skipped = [state.skipped for state in self.engine.states]  # the run's, never rolled back
        if move.rollback_to is not None:
            self.ladder.rollback(self.rollback_objects())  # (Fabric's optimizers carry their scaler in their state)
        self._go_to_rung(move.rung)
        for state, count in zip(self.engine.states, skipped):
            state.skipped = count
        if move.rollback_to is not None:
            for state in self.engine.states:
                state.gate.last_skipped = True
            self.ladder.moved(move, names)

    def _watch_first_gate(self) -> None:
        """The first optimizer's step flags go to the ladder as they land (its gate is new after each change of
        level: watched once)."""
        state = self.engine.states[0]
        if state.gate is self._watched_gate:
            return
        ladder, scaler = self.ladder, state.scaler
        floor = scaler.min_loss_scale if scaler.dynamic else None

        def landed(skipped: bool, payload: Optional[Any]) -> None:
            ladder.landed(skipped, float(payload[0]) if payload is not None else scaler.scale, floor)

        state.gate.watchers.append(landed)
        self._watched_gate = state.gate

    def _ladder_device(self) -> torch.device:
        """Where the ranks agree on the ladder's verdicts: where the first loss scale lives."""
        return self.engine.states[0].scaler.device if self.engine.states else torch.device("cpu")

    def rollback_objects(self) -> Dict[str, Any]:
        """What a ladder's rollback restores: ``"model"`` (the prepared model), ``"optimizer_0"``, ... (every
        connected optimizer) and :attr:`rollback_extras` (the Trainer plugin puts its LR schedulers there)."""
        objects: Dict[str, Any] = {"model": self.module}
        objects.update((f"optimizer_{index}", state.optimizer) for index, state in enumerate(self.engine.states))
        objects.update(self.rollback_extras)
        return objects

    def log_loss(self, loss: Tensor) -> None:
        """A training loss for the ladder's loss-spike rule (copied to the host without waiting); nothing without
        the ladder. The Trainer plugin passes the losses of its logging steps."""
        if self.ladder is not None:
            self.ladder.log_loss(loss)

    # ---- what the run shows ------------------------------------------------------------

    def connected(self, optimizer: torch.optim.Optimizer) -> Optional[OptimizerStep]:
        """The step of ``optimizer`` if it is connected, else None (nothing is connected by asking)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return next((state for state in self.engine.states if state.optimizer is optimizer), None)

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        """The connected optimizers, in order."""
        return [state.optimizer for state in self.engine.states]

    @property
    def scalers(self) -> List[LossScaler]:
        """The LossScaler of every connected optimizer, in order."""
        return list(self.engine.scalers)

    @property
    def loss_scales(self) -> List[float]:
        """Current loss scale of every connected optimizer, in order."""
        return [scaler.scale for scaler in self.engine.scalers]

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite grads so far, all optimizers, across ladder moves and resumes
        (waits for the flags still on their way to the host)."""
        return self.engine.skipped_steps

    @property
    def settled_skipped_steps(self) -> int:
        """:attr:`skipped_steps` whose flags have reached the host (no wait)."""
        return self.engine.settled_skipped_steps

    @property
    def last_nonfinite_params(self) -> List[str]:
        """Names of the params whose grads were non-finite at the last skipped step (this rank's view)."""
        return self.engine.last_nonfinite_params

    @property
    def drivers(self) -> List[str]:
        """Who runs each connected optimizer's update: "kernel", "protocol" or "host" (:class:`OptimizerStep`)."""
        return [state.driver for state in self.engine.states]

    def metrics(self) -> Dict[str, Union[float, Tensor]]:
        """What a logger shows of the run, read without a host sync: ``amp/loss_scale`` (the first optimizer's
        scale: a float when static, else a device tensor), ``amp/skipped_steps`` (settled so far); with the ladder
        ``amp/level`` (the opt level's number) and ``amp/rung_changes``."""
        values: Dict[str, Union[float, Tensor]] = {}
        if self.engine.scalers:
            scaler = self.engine.scalers[0]
            values["amp/loss_scale"] = (scaler.static_scale if scaler.static_scale is not None
                                        else scaler.scale_tensor.clone())
        values["amp/skipped_steps"] = float(self.settled_skipped_steps)
        if self.ladder is not None:
            values["amp/level"] = float(self.properties.opt_level[1])
            values["amp/rung_changes"] = float(self.ladder.changes)
        return values

    # ---- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The loss scalers and skipped-step counts of every optimizer; with the ladder its rung, moves and step."""
        state = {"opt_level": self.properties.opt_level, **self.engine.state_dict()}
        if self.ladder is not None:
            state["ladder"] = self.ladder.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the ladder's rung first (the scalers belong to it), then the scalers
        (applied when the optimizers connect, if they have not yet)."""
        if self.ladder is not None and "ladder" in state_dict:
            self._apply_move(self.ladder.load_state_dict(state_dict["ladder"]))
        self.engine.load_state_dict(dict(state_dict))
