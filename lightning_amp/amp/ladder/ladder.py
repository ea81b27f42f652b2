"""AmpLadder: ``opt_level="auto"``, a run that moves one rung down its ladder when it stops converging.

The ladder is a client of the runtime (:class:`~lightning_amp.amp.runtime.AmpRuntime`, which drives it): it is
told what happens and returns decisions, and keeps no reference to the runtime or its engine::

    ladder = AmpLadder(ladder=None, rules=LadderRules())   # the default ladder of the dtype
    ladder.check_rungs(dtype, props_of)                    # the rungs validated against the run's options
    # per optimizer step of the first optimizer:
    ladder.before_step(objects, device)                    # rollback points, every rules.snapshot_every steps
    ... the step; each step's flag and scale, when they land: ladder.landed(skipped, scale, floor) ...
    move = ladder.after_step(device)                       # None (stay) or a Move: go to rung K, rolled back to P
    # the runtime applies a Move in one place (AmpRuntime._apply_move): the flags on their way settled,
    # ladder.rollback(objects), the rung's level (fresh scalers), then ladder.moved(move, names)
    # at resume: move = ladder.load_state_dict(state, dtype), applied the same way, before the scalers load

``objects`` (name -> object with ``state_dict``/``load_state_dict``) is what a rollback restores: the model
under the name ``"model"``, each optimizer, each LR scheduler. What the rules read costs no host sync: each
optimizer step's non-finite flag and loss scale reach the host through the step's own
:class:`~lightning_amp.amp.gate.StepGate`, at once on the CPU and some steps later on a GPU, and the runtime hands
them on (:meth:`AmpLadder.landed`); the decision is taken when they land; the training loss is read on logged
steps only (:meth:`AmpLadder.log_loss`, a non-blocking copy read once landed).

The books (:meth:`AmpLadder.state_dict`): the rung, the moves, the run's own step count (never restarted: the
steps named in warnings, ``moved_at``, ``snapshot_step`` and the rollback points count the run's optimizer steps
across moves and resumes), the rollback point and its candidate, and what the rules have seen on the rung, so a
resumed run goes on exactly as the straight one. A move drops the candidate taken on the failing rung: it is
never promoted.

Under several processes every rank moves together: on every ``rules.decide_every``-th step the ranks agree on the
verdict (one all-reduce) and only then move, and they agree whether a candidate snapshot may become the rollback
point (one all-reduce per ``snapshot_every`` steps); a single process decides on every step.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_amp.amp.ladder.rules import RUNG_ORDER, LadderRules, Rung, RungWatch, check_ladder, rung_height
from lightning_amp.amp.ladder.snapshot import SnapshotStore
from lightning_amp.amp.levels import AmpProperties

_STATE_VERSION = 2  # 2: the step count's books, the rules' streaks, the snapshots and the dtype


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


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank: one all-reduce (MAX) of a one-element tensor on ``device`` (where the
    loss scale lives; the CPU under gloo)."""
    if dist.get_backend() == "gloo":
        device = torch.device("cpu")
    tensor = torch.tensor([float(flag)], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


class Move(NamedTuple):
    """A decision of the ladder, applied by the runtime: go on at ``rung``, after restoring the rollback point of step
    ``rollback_to`` (None at a resume: the checkpoint's state is the run's)."""

    rung: int
    rollback_to: Optional[int]
    reason: Optional[str]


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
        self.dtype: Optional[torch.dtype] = None  #: the half dtype the rungs were checked for
        self.rules = rules or LadderRules()
        self.warn = warn
        self.index = 0  #: the current rung
        self.changes = 0  #: moves so far
        self.reason: Optional[str] = None  #: the rule of the last move
        self.moved_at: Optional[int] = None  #: the step of the last move
        self.snapshot_step: Optional[int] = None  #: the step the last move rolled back to
        self.steps = 0  #: optimizer steps of the first optimizer so far (the run's own count: never restarted)
        self._landed = 0  # the steps taken before the step whose flag lands next (flags land in order)
        self._forward_state = 0  # the steps taken before the last forward (the state it ran on)
        self._before_step_of: Optional[int] = None  # the step count before_step last ran for
        self.snapshots = SnapshotStore(self.rules.snapshot_dir)
        self._watch = RungWatch(self.rules)
        self._losses = _HostScalars()
        self._bottom_warned = False

    @property
    def rung(self) -> Rung:
        return self.rungs[self.index]

    # ---- setup -------------------------------------------------------------------------

    def check_rungs(self, dtype: torch.dtype, props_of: Callable[[Rung], AmpProperties]) -> None:
        """Validate the ladder for ``dtype`` and the run's other options: ``props_of(rung)`` resolves a rung with
        them (ValueError when they do not fit); ValueError naming the rung for one that does not fit or stands out
        of order. The runtime then goes on at :attr:`rung`."""
        rungs = check_ladder(self.requested, dtype)
        if self.index >= len(rungs):
            raise ValueError(f"the run is on rung {self.index} but `ladder` has {len(rungs)} rungs")
        above: Optional[Tuple[int, int, float]] = None
        for index, rung in enumerate(rungs):
            try:
                props = props_of(rung)
            except ValueError as err:
                raise ValueError(f"`ladder[{index}]` = {tuple(rung)} does not fit the other options: {err}") from None
            height = rung_height(props.opt_level, props.loss_scale)
            if above is not None and height >= above:
                how = "repeats" if height == above else "stands above"
                raise ValueError(f"`ladder[{index}]` = {tuple(rung)} ({props.opt_level}, loss scale {props.loss_scale!r} "
                                 f"with {props.dtype}) {how} `ladder[{index - 1}]` = {tuple(rungs[index - 1])}: "
                                 f"{RUNG_ORDER}")
            above = height
        self.rungs, self.dtype = rungs, dtype

    # ---- what the ladder is told -------------------------------------------------------

    def landed(self, skipped: bool, scale: float, floor: Optional[float]) -> None:
        """The flag of the next step of the first optimizer reached the host (in step order): ``skipped`` for
        non-finite grads, ``scale`` the loss scale after its update, ``floor`` the dynamic scale's floor (None for a
        static scale)."""
        self._watch.step(skipped, scale, floor, self._landed)
        self._landed += 1

    def note_forward(self) -> None:
        """A forward begins: the losses logged next were computed on the state after :attr:`steps` steps."""
        self._forward_state = self.steps

    def log_loss(self, loss: Tensor) -> None:
        """A logged step's training loss, of the last forward (:meth:`note_forward`): copied to the host without
        waiting, judged once landed."""
        self._losses.push(self._forward_state, loss)
        for state, value in self._losses.landed():
            self._watch.loss(value, state)

    # ---- per step ----------------------------------------------------------------------

    def before_step(self, objects: Callable[[], Mapping[str, Any]], device: torch.device) -> None:
        """Before an optimizer step: the run's first state is the rollback point; every ``snapshot_every`` steps the
        previous candidate becomes it if no rule fired since, and the state now is the new candidate (``device``:
        where the ranks agree on that). Once per step: called again before the step is taken (the runtime calls it
        before the closure and again at the step), it does nothing."""
        if self._before_step_of == self.steps:
            return
        self._before_step_of = self.steps
        if self.snapshots.good is None:
            self.snapshots.take(self.steps, objects(), good=True)
        elif self.steps % self.rules.snapshot_every == 0 and (self.snapshots.candidate is None
                                                              or self.snapshots.candidate.step != self.steps):
            ok = self._promotable()
            if ok if not _several_ranks() else not _any_rank(not ok, device):
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

    def after_step(self, device: torch.device) -> Optional[Move]:
        """After an optimizer step: a :class:`Move` one rung down, back to the rollback point, if a rule fired
        (under several processes only on every ``decide_every``-th step, all ranks together, agreed on ``device``);
        None to stay. On the last rung a rule that fires is warned about once and its rules start afresh."""
        self.steps += 1
        reason = self._watch.verdict()
        if _several_ranks():
            if self.steps % self.rules.decide_every or not _any_rank(reason is not None, device):
                return None
            reason = reason or "a rule fired on another rank"
        if reason is None:
            return None
        if self.index + 1 >= len(self.rungs):
            if not self._bottom_warned:
                self.warn(f"lightning_amp ladder: {reason} at step {self.steps}, but the run is on the last rung "
                          f"({self.rung}): it goes on there")
                self._bottom_warned = True
            self._watch = RungWatch(self.rules)
            return None
        return Move(self.index + 1, self.snapshots.good.step, reason)

    def rollback(self, objects: Mapping[str, Any]) -> int:
        """Restore the rollback point into ``objects`` (part of applying a :class:`Move`) and drop the candidate,
        taken on the failing rung: it is never promoted. The step rolled back to."""
        step = self.snapshots.restore(objects)
        self.snapshots.drop_candidate()
        return step

    def moved(self, move: Move, names: Sequence[str]) -> None:
        """The runtime applied ``move`` (after a step; ``names``: the params the overflow forensics named): the books
        say so, the rules start afresh on the new rung, and a warning names the rule, the steps and the rungs."""
        old = self.rung
        self.index, self.changes = move.rung, self.changes + 1
        self.reason, self.moved_at, self.snapshot_step = move.reason, self.steps, move.rollback_to
        self._watch = RungWatch(self.rules)
        shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
        self.warn(f"lightning_amp ladder: {move.reason} at step {self.steps}; rolled back to step {move.rollback_to} "
                  f"and moved from rung {move.rung - 1} ({old}) to rung {move.rung} ({self.rung}); non-finite grads "
                  f"last in: {shown or 'none named'}")

    # ---- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The books (see the module docstring); the flags still on their way must have landed (the runtime waits
        for them first)."""
        return {"version": _STATE_VERSION, "rung": self.index, "rungs": [tuple(r) for r in self.rungs],
                "dtype": None if self.dtype is None else str(self.dtype).removeprefix("torch."),
                "changes": self.changes, "reason": self.reason, "moved_at": self.moved_at,
                "snapshot_step": self.snapshot_step, "steps": self.steps, "watch": self._watch.state_dict(),
                "snapshots": self.snapshots.state_dict(), "bottom_warned": self._bottom_warned}

    def load_state_dict(self, state: Mapping[str, Any]) -> Move:
        """Take the books of ``state`` (:meth:`state_dict`) and return the :class:`Move` to their rung, which the
        runtime applies before the loss scalers are loaded. ValueError naming what differs, before anything
        changes, for the checkpoint of another ladder (other rungs, another dtype) or of a newer version."""
        if not isinstance(state, Mapping) or not isinstance(state.get("version"), int):
            raise ValueError(f"the checkpoint's ladder state is not one this version writes; got {state!r:.200}")
        if state["version"] > _STATE_VERSION:
            raise ValueError(f"the checkpoint's ladder state has version {state['version']}; this lightning_amp reads "
                             f"versions up to {_STATE_VERSION}: upgrade lightning_amp to resume it")
        rungs = [tuple(r) for r in self.rungs]
        saved_rungs = [tuple(r) for r in state["rungs"]]
        dtype = None if self.dtype is None else str(self.dtype).removeprefix("torch.")
        differs = []
        if state.get("dtype") is not None and dtype is not None and state["dtype"] != dtype:
            differs.append(f"its dtype {state['dtype']} differs from this run's {dtype}")
        if saved_rungs != rungs:
            differs.append(f"its ladder {saved_rungs} differs from this run's `ladder` {rungs}")
        if not 0 <= int(state["rung"]) < len(self.rungs):
            differs.append(f"its rung {state['rung']} is not one of this run's {len(self.rungs)} rungs")
        if differs:
            raise ValueError("lightning_amp ladder: the checkpoint belongs to another ladder: " + "; ".join(differs)
                             + ". Resume with the dtype and `ladder` it was saved with; nothing was restored")
        self.index, self.changes = int(state["rung"]), int(state["changes"])
        self.reason, self.moved_at, self.snapshot_step = state["reason"], state["moved_at"], state["snapshot_step"]
        self.steps = self._landed = self._forward_state = int(state["steps"])
        self._before_step_of = None
        self._watch = RungWatch(self.rules)
        if "watch" in state:  # version 1 saved neither the rules' streaks nor the snapshots
            self._watch.load_state_dict(state["watch"])
        self.snapshots.load_state_dict(state.get("snapshots") or {})
        self._bottom_warned = bool(state.get("bottom_warned", False))
        if self.changes:
            self.warn(f"lightning_amp ladder: resuming on rung {self.index} ({self.rung}), reached at step {self.moved_at} "
                      f"after {self.reason} (rolled back to step {self.snapshot_step})")
        return Move(self.index, None, None)
