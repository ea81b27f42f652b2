"""Rollback points of the precision ladder: copies of a run's state in host memory, framework-free.

A snapshot is the ``state_dict()`` of every object handed in (the model, each optimizer, each LR scheduler:
anything with ``state_dict``/``load_state_dict``), its tensors copied to host memory (on a GPU each copy
waits for the device: one wait per snapshot). The store holds two: the *good* one, the rollback point, and
the newest *candidate*, which becomes the good one only once :meth:`SnapshotStore.promote` is called for
it (after ``snapshot_every`` further steps in which no rule fired): a diverging state never replaces the
good one. Cost: twice the model and optimizer state in host memory (:attr:`SnapshotStore.nbytes`).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, NamedTuple, Optional

from torch import Tensor


def to_host(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every tensor copied to host memory, detached."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: to_host(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(value) for value in obj)
    return obj


def _nbytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(value) for value in obj)
    return 0


class Snapshot(NamedTuple):
    step: int  #: optimizer steps taken when it was copied
    states: Dict[str, Any]  #: name -> the object's state_dict, on the host


class SnapshotStore:
    """The good snapshot and the newest candidate (see the module docstring)."""

    def __init__(self) -> None:
        self.good: Optional[Snapshot] = None
        self.candidate: Optional[Snapshot] = None

    def take(self, step: int, objects: Mapping[str, Any], good: bool = False) -> None:
        """Copy the state of ``objects`` (name -> object) as the candidate (as the good snapshot with ``good``:
        the run's starting state)."""
        snapshot = Snapshot(step, {name: to_host(obj.state_dict()) for name, obj in objects.items()})
        if good:
            self.good, self.candidate = snapshot, None
        else:
            self.candidate = snapshot

    def promote(self) -> None:
        """The candidate becomes the rollback point."""
        if self.candidate is not None:
            self.good, self.candidate = self.candidate, None

    def drop_candidate(self) -> None:
        self.candidate = None

    def restore(self, objects: Mapping[str, Any]) -> int:
        """Load the good snapshot into ``objects`` (the same names as when taken); its step. RuntimeError when
        there is none or any object fails to load it: a run never trains on from a half-restored state."""
        good = self.good
        if good is None:
            raise RuntimeError("lightning_amp ladder: no rollback point was taken; cannot restore")
        if set(objects) != set(good.states):
            raise RuntimeError(f"lightning_amp ladder: the rollback point holds {sorted(good.states)} but the run now "
                               f"has {sorted(objects)}; cannot restore it")
        for name, obj in objects.items():
            try:
                obj.load_state_dict(to_host(good.states[name]) if name != "model" else good.states[name])
            except Exception as err:  # noqa: BLE001  (any failure must stop the run)
                raise RuntimeError(f"lightning_amp ladder: restoring {name!r} from the rollback point of step "
                                   f"{good.step} failed ({type(err).__name__}: {err}); the run cannot go on "
                                   "from a partly restored state") from err
        return good.step

    @property
    def nbytes(self) -> int:
        """Host bytes the stored snapshots hold."""
        return sum(_nbytes(s.states) for s in (self.good, self.candidate) if s is not None)

