"""The precision ladder's rungs and the rules that move a run one rung down, framework-free.

A *rung* is an (opt level, loss scale) pair; a *ladder* an ordered, non-empty list of rungs, tried top to
bottom (:class:`~lightning_amp.amp.ladder.ladder.AmpLadder` does the moving). Defaults, apex's recipe:

* float16: ``O2`` at a static 128 -> ``O1`` at 128 -> ``O1`` with the dynamic scale (:data:`FP16_LADDER`);
* bfloat16: ``O2`` -> ``O1`` -> ``O0`` (:data:`BF16_LADDER`): bf16 has fp32's exponent range, no scale is involved.

Levels are O0, O1 and O2 only: each keeps one set of fp32 Parameters, so a move needs no new weights (O3's
params are half).

:class:`LadderRules` holds the thresholds; :class:`RungWatch` applies them to what the host learns of each
optimizer step (its non-finite flag and the loss scale after it, landed without a host sync) and of each
logged training loss, and says which rule fired (:meth:`RungWatch.verdict`).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from lightning_amp._keywords import checks_keywords
from lightning_amp.amp.ladder.snapshot import PathLike, snapshot_dir_path
from lightning_amp.amp.levels import LossScaleSpec, check_loss_scale

LADDER_LEVELS = ("O0", "O1", "O2")


class Rung(NamedTuple):
    """One rung: an opt level and its loss scale (None: the level's default for the dtype)."""

    opt_level: str
    loss_scale: Optional[LossScaleSpec] = None

    def __str__(self) -> str:
        return self.opt_level if self.loss_scale is None else f"{self.opt_level}/{self.loss_scale}"


FP16_LADDER: Tuple[Rung, ...] = (Rung("O2", 128.0), Rung("O1", 128.0), Rung("O1", "dynamic"))
BF16_LADDER: Tuple[Rung, ...] = (Rung("O2"), Rung("O1"), Rung("O0"))

_ALLOWED_RUNGS = ('("O0"|"O1"|"O2", loss_scale) pairs or level names; loss_scale a positive number, "dynamic" '
                  "or None (float16 only: bfloat16 rungs take None)")


def check_ladder(ladder: Optional[Sequence[Any]], dtype: Optional[torch.dtype]) -> Tuple[Rung, ...]:
    """The validated rungs of ``ladder`` for ``dtype`` (None: the dtype is not known yet, levels only).

    ``ladder`` None is the default of the dtype (:data:`FP16_LADDER`, :data:`BF16_LADDER`). Raises ValueError
    naming ``ladder`` and the allowed values for an empty ladder, an unknown level, a bad scale, or a bfloat16
    rung with a loss scale."""
    if ladder is None:
        return BF16_LADDER if dtype == torch.bfloat16 else FP16_LADDER
    if isinstance(ladder, (str, bytes)) or not isinstance(ladder, Sequence) or len(ladder) == 0:
        raise ValueError(f"`ladder` must be a non-empty list of rungs: {_ALLOWED_RUNGS}; got {ladder!r}")
    rungs = []
    for index, item in enumerate(ladder):
        level, scale = (item, None) if isinstance(item, str) else (tuple(item) + (None,))[:2] \
            if isinstance(item, (tuple, list)) and 1 <= len(item) <= 2 else (None, None)
        if not isinstance(level, str) or level.strip().upper() not in LADDER_LEVELS:
            raise ValueError(f"`ladder[{index}]` = {item!r}: the level must be one of {LADDER_LEVELS} (O3 has half "
                             f"params, which a move cannot keep); allowed rungs: {_ALLOWED_RUNGS}")
        level = level.strip().upper()
        if scale is not None:
            try:
                scale = check_loss_scale(scale, f"ladder[{index}] loss_scale")
            except ValueError as err:
                raise ValueError(f"`ladder[{index}]` = {item!r}: {err}; allowed rungs: {_ALLOWED_RUNGS}") from None
            if dtype == torch.bfloat16:
                raise ValueError(f"`ladder[{index}]` = {item!r}: a bfloat16 rung takes no loss scale (bfloat16 has "
                                 f"fp32's range); allowed rungs: {_ALLOWED_RUNGS}")
        rungs.append(Rung(level, scale))
    return tuple(rungs)


def rung_height(opt_level: str, loss_scale: LossScaleSpec) -> Tuple[int, int, float]:
    """Where a resolved rung (its level and effective loss scale) stands on a ladder, higher first: by opt level,
    then a static scale above the dynamic one, then the larger static scale above the smaller. Each rung of a
    ladder must stand strictly lower than the one before it (:meth:`AmpLadder.resolve` refuses it otherwise):
    a move goes to a more conservative setting, never back up, and never to the same one."""
    static = loss_scale != "dynamic"
    return int(opt_level[1]), int(static), float(loss_scale) if static else 0.0


RUNG_ORDER = ("each rung must stand below the one before it: a lower opt level (O2 > O1 > O0), or at the same level "
              "the dynamic scale after a static one, or a smaller static scale after a larger one")

_MOST = 2**62  # the largest count a rule takes (a bound a run cannot reach)


def _written(number: float) -> str:
    """``number`` as a person writes it: 2**62, 1, 0.5 (not 4611686018427387904, 1.0)."""
    if number >= 2**20 and float(number).is_integer() and int(number) & (int(number) - 1) == 0:
        return f"2**{int(number).bit_length() - 1}"
    return f"{number:g}"


def _check(name: str, value: Any, kind: type, low: float, high: float, low_open: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` is a ``kind`` from ``low`` (excluded when ``low_open``) to ``high``
    (``math.inf``: unbounded), the range written as a person writes it ("an integer from 1 to 2**62")."""
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high and math.isfinite(value)
    if not ok:
        noun = "an integer" if kind is int else "a number"
        if high == math.inf:
            bounds = f"a finite number {'>' if low_open else '>='} {_written(low)}"
        elif low_open:
            bounds = f"{noun} in ({_written(low)}, {_written(high)}]"
        else:
            bounds = f"{noun} from {_written(low)} to {_written(high)}"
        raise ValueError(f"`{name}` must be {bounds}, or None to switch the rule off; got {value!r}")


@checks_keywords
@dataclass(frozen=True)
class LadderRules:
    """When a run moves one rung down, and how often a rollback point is taken (docs/opt-levels.md
    justifies the defaults). A rule set to None is off; ValueError naming the option for a value out of range.

    Args:
        nonfinite_in_a_row: K, non-finite grads on K optimizer steps in a row (>= 1). 20 lets a dynamic scale
            back off from 2**16 to 2**-4 of that (16 halvings) before it counts as a failure.
        max_skip_rate: X, the fraction of skipped steps over the last ``skip_window`` steps above which the run
            moves (in (0, 1]).
        skip_window: W, steps the skip rate is measured over (>= 1); judged once W steps ran on the rung.
        floor_patience: overflows in a row with a dynamic scale at its floor (``min_loss_scale``) (>= 1).
        spike_factor: F, a logged training loss above F x the running median of the earlier ones is a spike (> 1).
        spike_steps: S, spikes on S logged steps in a row move the run (>= 1); a non-finite loss counts as a spike.
        spike_history: logged losses the running median is taken over (>= 3); judged once that many were seen.
        snapshot_every: N, optimizer steps between rollback points (>= 1).
        decide_every: several processes only: the ranks agree on the verdict every so many steps (one
            all-reduce each time) and move together (>= 1).
        snapshot_dir: None: rollback points in host memory; a folder path: in files there, one pair per rank
            (:mod:`~lightning_amp.amp.ladder.snapshot`); TypeError naming it for a value that is not a path, and
            the ladder's construction creates the folder (ValueError naming the path if it cannot be written).
    """

    nonfinite_in_a_row: Optional[int] = 20
    max_skip_rate: Optional[float] = 0.5
    skip_window: int = 100
    floor_patience: Optional[int] = 3
    spike_factor: Optional[float] = 10.0
    spike_steps: int = 3
    spike_history: int = 20
    snapshot_every: int = 100
    decide_every: int = 10
    snapshot_dir: Optional[PathLike] = None

    def __post_init__(self) -> None:
        for name, kind, low, high, low_open in (
                ("nonfinite_in_a_row", int, 1, _MOST, False), ("max_skip_rate", float, 0.0, 1.0, True),
                ("floor_patience", int, 1, _MOST, False), ("spike_factor", float, 1.0, math.inf, True)):
            if getattr(self, name) is not None:
                _check(name, getattr(self, name), kind, low, high, low_open)
        for name, low in (("skip_window", 1), ("spike_steps", 1), ("spike_history", 3), ("snapshot_every", 1),
                           ("decide_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}; got {value!r}")
        snapshot_dir_path(self.snapshot_dir)


class RungWatch:
    """The rules of :class:`LadderRules` applied to one rung's steps (host values only: no tensor is read).

    Feed it :meth:`step` for every optimizer step whose flag has landed (in order) and :meth:`loss` for every
    logged training loss; :meth:`verdict` is the reason to move (a sentence naming the rule), or None.

    Each event names the *state* it was computed on (the number of optimizer steps taken before its forward), so
    the watch knows which states lay inside a streak of non-finite steps or spiking losses (:meth:`quiet_at`): a
    rollback point taken inside a streak is never promoted, even when the streak ends without firing a rule.
    """

    def __init__(self, rules: LadderRules) -> None:
        self.rules = rules
        self.in_a_row = 0  # non-finite steps in a row
        self.at_floor_in_a_row = 0
        self.window: Deque[bool] = deque(maxlen=rules.skip_window)
        self.history: Deque[float] = deque(maxlen=rules.spike_history)
        self.spikes_in_a_row = 0
        self._reasons: List[str] = []
        self.streaks: List[List[Optional[int]]] = []  # [first state, first state after it (None: going on)]
        self._open = {"nonfinite": None, "spike": None}  # the streak of each kind going on now
        self.flags_through: Optional[int] = None  # the last state whose step's flag has landed

    def state_dict(self) -> Dict[str, Any]:
        """What the rules have seen on this rung (host values only), for a checkpoint: a resumed run fires where the
        straight one would have."""
        return {"in_a_row": self.in_a_row, "at_floor_in_a_row": self.at_floor_in_a_row, "window": list(self.window),
                "history": list(self.history), "spikes_in_a_row": self.spikes_in_a_row, "reasons": list(self._reasons),
                "streaks": [list(streak) for streak in self.streaks],
                "open": {kind: None if streak is None else self.streaks.index(streak)
                         for kind, streak in self._open.items()},
                "flags_through": self.flags_through}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.in_a_row, self.at_floor_in_a_row = int(state["in_a_row"]), int(state["at_floor_in_a_row"])
        self.window.clear()
        self.window.extend(bool(skipped) for skipped in state["window"])
        self.history.clear()
        self.history.extend(float(loss) for loss in state["history"])
        self.spikes_in_a_row, self._reasons = int(state["spikes_in_a_row"]), list(state["reasons"])
        self.streaks = [list(streak) for streak in state["streaks"]]
        self._open = {kind: None if index is None else self.streaks[index] for kind, index in state["open"].items()}
        self.flags_through = state["flags_through"]

    def _streak(self, kind: str, inside: bool, state: Optional[int]) -> None:
        if state is None:
            return
        streak = self._open[kind]
        if inside and streak is None:
            self._open[kind] = streak = [state, None]
            self.streaks.append(streak)
        elif not inside and streak is not None:
            streak[1] = state
            self._open[kind] = None

    def quiet_at(self, state: int) -> bool:
        """Whether the state after ``state`` optimizer steps lay outside every streak seen on this rung (events
        without a state are not placed)."""
        return not any(start <= state and (end is None or state < end) for start, end in self.streaks)

    def step(self, skipped: bool, scale: float, floor: Optional[float], state: Optional[int] = None) -> None:
        """One optimizer step landed: ``skipped`` for non-finite grads, ``scale`` the loss scale after its update,
        ``floor`` the dynamic scale's floor (None for a static scale), ``state`` the steps taken before it."""
        rules = self.rules
        self._streak("nonfinite", skipped, state)
        if state is not None:
            self.flags_through = state
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.at_floor_in_a_row = self.at_floor_in_a_row + 1 if skipped and floor is not None and scale <= floor else 0
        self.window.append(skipped)
        if rules.nonfinite_in_a_row is not None and self.in_a_row >= rules.nonfinite_in_a_row:
            self._reasons.append(f"nonfinite_in_a_row: non-finite grads on {self.in_a_row} steps in a row "
                                 f"(nonfinite_in_a_row={rules.nonfinite_in_a_row})")
        if rules.floor_patience is not None and self.at_floor_in_a_row >= rules.floor_patience:
            self._reasons.append(f"floor_patience: {self.at_floor_in_a_row} overflows in a row with the loss scale at "
                                 f"its floor {floor} (floor_patience={rules.floor_patience})")
        if rules.max_skip_rate is not None and len(self.window) == rules.skip_window:
            rate = sum(self.window) / rules.skip_window
            if rate > rules.max_skip_rate:
                self._reasons.append(f"max_skip_rate: {rate:.0%} of the last {rules.skip_window} steps skipped "
                                     f"(max_skip_rate={rules.max_skip_rate})")

    def loss(self, value: float, state: Optional[int] = None) -> None:
        """One logged training loss (a host float), of a forward on the state after ``state`` optimizer steps."""
        rules = self.rules
        if rules.spike_factor is None:
            return
        full = len(self.history) == rules.spike_history
        median = statistics.median(self.history) if full else None
        spike = not math.isfinite(value) or (median is not None and median > 0 and value > rules.spike_factor * median)
        self._streak("spike", bool(spike and (full or not math.isfinite(value))), state)
        if spike and (full or not math.isfinite(value)):
            self.spikes_in_a_row += 1
            if self.spikes_in_a_row >= rules.spike_steps:
                shown = "a non-finite value" if not math.isfinite(value) else f"{value:.4g} > {rules.spike_factor} x " \
                        f"median {median:.4g}"
                self._reasons.append(f"spike_factor: logged loss spiked on {self.spikes_in_a_row} logged steps in a "
                                     f"row ({shown}; spike_factor={rules.spike_factor}, spike_steps={rules.spike_steps})")
            return
        self.spikes_in_a_row = 0
        self.history.append(value)

    def verdict(self) -> Optional[str]:
        """The first rule that fired since this watch began, or None."""
        return self._reasons[0] if self._reasons else None

    @property
    def calm(self) -> bool:
        """No rule fired and no streak is under way: a state taken now may become the rollback point."""
        return not self._reasons and self.in_a_row == 0 and self.spikes_in_a_row == 0
