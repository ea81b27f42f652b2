"""AmpLadder: ``opt_level="auto"``, a run that moves one rung down its ladder when it stops converging.

Framework-free; the plugins call it from their hooks::

    ladder = AmpLadder(ladder=None, rules=LadderRules())   # the default ladder of the dtype
    ladder.resolve(runtime)                                # the runtime on the current rung
    # per optimizer step of the first optimizer:
    ladder.before_step(runtime, objects)                   # rollback points, every rules.snapshot_every steps
    ... runtime.step(optimizer) ...
    ladder.after_step(runtime, objects)                    # a rule fired: roll back, go one rung down

``objects`` (name -> object with ``state_dict``/``load_state_dict``) is what a rollback restores: the model
under the name ``"model"``, each optimizer, each LR scheduler. What the rules read costs no host sync: each
optimizer step's non-finite flag and loss scale reach the host through the step's own
:class:`~lightning_amp.amp.gate.StepGate` (its ``watchers``), at once on the CPU and some steps later on a
GPU, and the decision is taken when they land; the training loss is read on logged steps only
(:meth:`AmpLadder.log_loss`, a non-blocking copy read once landed).

A move (:meth:`AmpLadder.move`): the flags on their way are waited for, the good snapshot is restored
(:class:`~lightning_amp.amp.ladder.snapshot.SnapshotStore`; the run's data goes on: the batches since then
are not replayed), the runtime changes level (:meth:`AmpRuntime.change_level`: the model re-prepared
without new Parameters, fresh scalers at the new rung's scale), and a warning names the rule, the step,
the params the overflow forensics named, and the old and new rung. Under several processes every rank
moves together: on every ``rules.decide_every``-th step the ranks agree on the verdict (one all-reduce) and
only then move, and they agree whether a candidate snapshot may become the rollback point (one all-reduce per
``snapshot_every`` steps); a single process decides on every step.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_amp.amp.ladder.rules import RUNG_ORDER, LadderRules, Rung, RungWatch, check_ladder, rung_height
from lightning_amp.amp.ladder.snapshot import SnapshotStore
from lightning_amp.amp.levels import resolve_properties

_STATE_VERSION = 1


class _HostScalars:
    """Scalars copied to the host without waiting, each with a tag; :meth:`landed` gives the (tag, value) pairs
    whose copy has finished."""

    def __init__(self) -> None:
        self._pending: List[Tuple[Any, Tensor, Any]] = []

    def push(self, tag: Any, value: Tensor) -> None:
        cuda = value.device.type == "cuda"
        host = torch.empty((), dtype=torch.float32, pin_memory=cuda)
        host.copy_(value.detach().reshape(()).float(), non_blocking=True)
        event = torch.cuda.Event() if cuda else None
        if event is not None:
            event.record()
        self._pending.append((tag, host, event))

    def landed(self) -> List[Tuple[Any, float]]:
        values = []
        while self._pending and (self._pending[0][2] is None or self._pending[0][2].query()):
            tag, host, _ = self._pending.pop(0)
            values.append((tag, float(host)))
        return values


def _several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _any_rank(flag: bool, runtime: Any) -> bool:
    """Whether ``flag`` is set on any rank: one all-reduce (MAX) of a one-element tensor where the loss scale lives."""
    states = runtime.engine.states
    device = states[0].scaler.device if states else torch.device("cpu")
    if dist.get_backend() == "gloo":
        device = torch.device("cpu")
    tensor = torch.tensor([float(flag)], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


class AmpLadder:
    """The ladder of one run (see the module docstring).

    Args:
        ladder: the rungs, ``[("O2", 128.0), ("O1", 128.0), ("O1", "dynamic")]`` style (levels O0-O2; a loss scale
            for float16 only; None: :data:`~lightning_amp.amp.ladder.rules.FP16_LADDER` or ``BF16_LADDER``).
        rules: :class:`~lightning_amp.amp.ladder.rules.LadderRules` (None: the defaults).
        warn: how warnings are issued (the plugins pass a rank-zero warn).
    """

    def __init__(self, ladder: Optional[Sequence[Any]] = None, rules: Optional[LadderRules] = None,
                 warn: Callable[[str], Any] = warnings.warn) -> None:
        if rules is not None and not isinstance(rules, LadderRules):
            raise TypeError(f"`ladder_rules` must be a lightning_amp LadderRules; got {type(rules).__name__}")
        self.requested = ladder
        self.rungs: Tuple[Rung, ...] = check_ladder(ladder, None)
        self.rules = rules or LadderRules()
        self.warn = warn
        self.index = 0  #: the current rung
        self.changes = 0  #: moves so far
        self.reason: Optional[str] = None  #: the rule of the last move
        self.moved_at: Optional[int] = None  #: the step of the last move
        self.snapshot_step: Optional[int] = None  #: the step the last move rolled back to
        self.steps = 0  #: optimizer steps of the first optimizer so far
        self._forward_state = 0  # the steps taken before the last forward (the state it ran on)
        self._before_step_of: Optional[int] = None  # the step count before_step last ran for
        self.snapshots = SnapshotStore(self.rules.snapshot_dir)
        self._watch = RungWatch(self.rules)
        self._watched: Any = None  # the gate watched
        self._watcher: Optional[Callable[[bool, Optional[Any]], None]] = None  # what it calls
        self._losses = _HostScalars()
        self._bottom_warned = False

    @property
    def rung(self) -> Rung:
        return self.rungs[self.index]

    # ---- setup -------------------------------------------------------------------------

    def resolve(self, runtime: Any) -> None:
        """Validate the ladder for the runtime's dtype and options (ValueError naming the rung) and put the
        runtime on the current rung."""
        self.rungs = check_ladder(self.requested, runtime.properties.dtype)
        if self.index >= len(self.rungs):
            raise ValueError(f"the run is on rung {self.index} but `ladder` has {len(self.rungs)} rungs")
        above: Optional[Tuple[int, int, float]] = None
        for index, rung in enumerate(self.rungs):
            try:
                props = resolve_properties(**{**runtime.request, "opt_level": rung.opt_level,
                                              "loss_scale": rung.loss_scale}, device_type=runtime.device_type)
            except ValueError as err:
                raise ValueError(f"`ladder[{index}]` = {tuple(rung)} does not fit the other options: {err}") from None
            height = rung_height(props.opt_level, props.loss_scale)
            if above is not None and height >= above:
                how = "repeats" if height == above else "stands above"
                raise ValueError(f"`ladder[{index}]` = {tuple(rung)} ({props.opt_level}, loss scale {props.loss_scale!r} "
                                 f"with {props.dtype}) {how} `ladder[{index - 1}]` = {tuple(self.rungs[index - 1])}: "
                                 f"{RUNG_ORDER}")
            above = height
        rung = self.rung
        if (runtime.properties.opt_level, runtime.request["loss_scale"]) != (rung.opt_level, rung.loss_scale):
            runtime.change_level(rung.opt_level, rung.loss_scale)

    def attach(self, engine: Any) -> None:
        """Watch the flags of the engine's first optimizer (idempotent; again after a move renews its step)."""
        if not engine.states or engine.states[0].gate is self._watched:
            return
        state = engine.states[0]
        self._watched = state.gate
        scaler = state.scaler
        floor = scaler.min_loss_scale if scaler.dynamic else None
        watch = self._watch
        next_state = [self.steps]  # the flags land in order: the next one is of the step taken on this state

        def landed(skipped: bool, payload: Optional[Any]) -> None:
            watch.step(skipped, float(payload[0]) if payload is not None else scaler.scale, floor, next_state[0])
            next_state[0] += 1

        self._watcher = landed
        state.gate.watchers.append(landed)

    def _restart_watch(self, engine: Any) -> None:
        """The rules start afresh (a new rung, or a rule that fired on the last one): the old watcher is detached."""
        if self._watched is not None and self._watcher in self._watched.watchers:
            self._watched.watchers.remove(self._watcher)
        self._watch, self._watched, self._watcher = RungWatch(self.rules), None, None
        self.attach(engine)

    # ---- per step ----------------------------------------------------------------------

    def before_step(self, runtime: Any, objects: Callable[[], Mapping[str, Any]]) -> None:
        """Before an optimizer step (its optimizer connected): its flags are watched from now on; the run's first
        state is the rollback point; every ``snapshot_every`` steps the previous candidate becomes it if no rule
        fired since, and the state now is the new candidate. Once per step: called again before the step is taken
        (the runtime calls it before the closure and again at the step), it does nothing."""
        self.attach(runtime.engine)
        if self._before_step_of == self.steps:
            return
        self._before_step_of = self.steps
        if self.snapshots.good is None:
            self.snapshots.take(self.steps, objects(), good=True)
        elif self.steps % self.rules.snapshot_every == 0 and (self.snapshots.candidate is None
                                                              or self.snapshots.candidate.step != self.steps):
            ok = self._promotable()
            if ok if not _several_ranks() else not _any_rank(not ok, runtime):
                self.snapshots.promote()
            self.snapshots.take(self.steps, objects())

    def _promotable(self) -> bool:
        """Whether the candidate may become the rollback point: no rule fired and no streak is under way on this
        rung, the candidate's state lay outside every streak (a state taken while losses spiked or steps
        overflowed is never promoted, even if the streak ended without firing), and the flag of the step taken on
        it has landed (a device behind the host: decided at the next boundary instead)."""
        candidate, watch = self.snapshots.candidate, self._watch
        if candidate is None:
            return False
        landed = watch.flags_through is not None and watch.flags_through >= candidate.step
        return watch.calm and landed and watch.quiet_at(candidate.step)

    def note_forward(self) -> None:
        """A forward begins: the losses logged next were computed on the state after :attr:`steps` steps."""
        self._forward_state = self.steps

    def log_loss(self, loss: Tensor) -> None:
        """A logged step's training loss, of the last forward (:meth:`note_forward`): copied to the host without
        waiting, judged once landed."""
        self._losses.push(self._forward_state, loss)
        for state, value in self._losses.landed():
            self._watch.loss(value, state)

    def after_step(self, runtime: Any, objects: Callable[[], Mapping[str, Any]]) -> bool:
        """After an optimizer step: move one rung down if a rule fired (see the module docstring); under several
        processes only on every ``decide_every``-th step, all ranks together. Whether the run moved."""
        self.steps += 1
        self.attach(runtime.engine)
        reason = self._watch.verdict()
        if _several_ranks():
            if self.steps % self.rules.decide_every or not _any_rank(reason is not None, runtime):
                return False
            reason = reason or "a rule fired on another rank"
        if reason is None:
            return False
        if self.index + 1 >= len(self.rungs):
            if not self._bottom_warned:
                self.warn(f"lightning_amp ladder: {reason} at step {self.steps}, but the run is on the last rung "
                          f"({self.rung}): it goes on there")
                self._bottom_warned = True
            self._restart_watch(runtime.engine)
            return False
        self.move(runtime, objects(), reason)
        return True

    def move(self, runtime: Any, objects: Mapping[str, Any], reason: str) -> None:
        """Roll back to the good snapshot and go on one rung down (see the module docstring)."""
        engine = runtime.engine
        for state in engine.states:
            state.gate.poll(wait=True)  # deferred scheduler calls run on the old state, then it is replaced
        names = list(engine.last_nonfinite_params)
        old = self.rung
        self.snapshot_step = self.snapshots.restore(objects)
        self.snapshots.drop_candidate()
        self.index += 1
        runtime.change_level(self.rung.opt_level, self.rung.loss_scale)
        for state in engine.states:
            state.gate.last_skipped = True  # the step that moved was rolled back: an LR scheduler call after it is void
        self.changes += 1
        self.reason, self.moved_at = reason, self.steps
        self._restart_watch(engine)
        shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
        self.warn(f"lightning_amp ladder: {reason} at step {self.steps}; rolled back to step {self.snapshot_step} "
                  f"and moved from rung {self.index - 1} ({old}) to rung {self.index} ({self.rung}); non-finite grads "
                  f"last in: {shown or 'none named'}")

    # ---- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return {"version": _STATE_VERSION, "rung": self.index, "rungs": [tuple(r) for r in self.rungs],
                "changes": self.changes, "reason": self.reason, "moved_at": self.moved_at,
                "snapshot_step": self.snapshot_step, "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any], runtime: Any) -> None:
        """Continue on the saved rung (the runtime changes level; the loss scalers are loaded after this) and say so."""
        rungs = [tuple(r) for r in self.rungs]
        if [tuple(r) for r in state["rungs"]] != rungs:
            raise ValueError(f"the checkpoint's ladder {state['rungs']} differs from this run's `ladder` {rungs}; "
                             "resume with the same ladder")
        self.index, self.changes = int(state["rung"]), int(state["changes"])
        self.reason, self.moved_at, self.snapshot_step = state["reason"], state["moved_at"], state["snapshot_step"]
        self.steps = int(state["steps"])
        self._before_step_of = None
        self.snapshots = SnapshotStore(self.rules.snapshot_dir)
        rung = self.rung
        if (runtime.properties.opt_level, runtime.request["loss_scale"]) != (rung.opt_level, rung.loss_scale):
            runtime.change_level(rung.opt_level, rung.loss_scale)
        self._restart_watch(runtime.engine)
        if self.changes:
            self.warn(f"lightning_amp ladder: resuming on rung {self.index} ({rung}), reached at step {self.moved_at} "
                      f"after {self.reason} (rolled back to step {self.snapshot_step})")
