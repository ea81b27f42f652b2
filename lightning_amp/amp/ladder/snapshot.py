"""Rollback points of the precision ladder: copies of a run's state, in host memory or in files, framework-free.

A snapshot is the ``state_dict()`` of every object handed in (the model, each optimizer, each LR scheduler:
anything with ``state_dict``/``load_state_dict``), its tensors copied to host memory (on a GPU each copy
waits for the device: one wait per snapshot). The store holds two: the *good* one, the rollback point, and
the newest *candidate*, which becomes the good one only once :meth:`SnapshotStore.promote` is called for
it (after ``snapshot_every`` further steps in which no rule fired): a diverging state never replaces the
good one. Cost: twice the model and optimizer state in host memory (:attr:`SnapshotStore.nbytes`).

With a ``directory`` each snapshot goes to a file instead (``torch.save`` of ``{"step": int, "states":
{name: state_dict}}``, tensors on the CPU; it loads with ``torch.load(path, weights_only=False)``):
``ladder-rank{R}-good.pt`` and ``ladder-rank{R}-candidate.pt``, R the process's rank (0 without
``torch.distributed``: each process writes and restores its own files). A file is written to ``<name>.tmp``
and then renamed over its name (``os.replace``, atomic), so a process killed mid-write leaves the previous
file whole; a candidate is written to its own file and becomes the good one by a rename, never by a write.
Cost: the same bytes on disk as in memory, one write per snapshot (host memory: one snapshot's copy while
it is written, none between).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Mapping, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

PathLike = Union[str, "os.PathLike[str]"]


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


def snapshot_dir_path(directory: Optional[PathLike]) -> Optional[str]:
    """``directory`` as an absolute path (None stays None); TypeError or ValueError naming ``snapshot_dir`` for a
    value that is not a folder path."""
    if directory is None:
        return None
    if not isinstance(directory, (str, os.PathLike)) or not isinstance(os.fspath(directory), str):
        raise TypeError(f"`snapshot_dir` must be a folder path (str or os.PathLike) or None for snapshots in host "
                        f"memory; got {type(directory).__name__}")
    if not os.fspath(directory):
        raise ValueError("`snapshot_dir` must be a folder path or None; got an empty string")
    return os.path.abspath(os.fspath(directory))


def check_snapshot_dir(directory: Optional[PathLike]) -> Optional[str]:
    """:func:`snapshot_dir_path`, the folder created and checked writable (a probe file written and removed);
    ValueError naming the path when it cannot be created or written."""
    path = snapshot_dir_path(directory)
    if path is None:
        return None
    probe = os.path.join(path, f".ladder-probe-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb") as file:
            file.write(b"0")
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"`snapshot_dir` = {path!r} cannot hold the ladder's snapshots: it cannot be created or "
                         f"written ({type(err).__name__}: {err})") from None
    return path


class Snapshot(NamedTuple):
    step: int  #: optimizer steps taken when it was copied
    states: Optional[Dict[str, Any]]  #: name -> the object's state_dict, on the host (None: it is in ``path``)
    path: Optional[str] = None  #: the file holding it (None: in host memory)


class SnapshotStore:
    """The good snapshot and the newest candidate (see the module docstring), in host memory, or in files under
    ``directory`` (validated by :func:`check_snapshot_dir`)."""

    def __init__(self, directory: Optional[PathLike] = None) -> None:
        self.directory = check_snapshot_dir(directory)
        self.good: Optional[Snapshot] = None
        self.candidate: Optional[Snapshot] = None

    def _path(self, kind: str) -> str:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return os.path.join(self.directory, f"ladder-rank{rank}-{kind}.pt")

    def take(self, step: int, objects: Mapping[str, Any], good: bool = False) -> None:
        """Copy the state of ``objects`` (name -> object) as the candidate (as the good snapshot with ``good``:
        the run's starting state). RuntimeError naming the file when it cannot be written (the good one is
        left as it was)."""
        self._keep(step, {name: to_host(obj.state_dict()) for name, obj in objects.items()}, good)

    def _keep(self, step: int, states: Dict[str, Any], good: bool) -> None:
        if self.directory is None:
            snapshot = Snapshot(step, states)
        else:
            snapshot = Snapshot(step, None, self._path("good" if good else "candidate"))
            _write(snapshot.path, {"step": step, "states": states})
        if good:
            self.drop_candidate()
            if self.directory is not None:  # a write killed by an earlier process is never read: removed
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._path("candidate") + ".tmp")
            self.good = snapshot
        else:
            self.candidate = snapshot

    def promote(self) -> None:
        """The candidate becomes the rollback point (on disk: its file is renamed over the good one's)."""
        candidate = self.candidate
        if candidate is None:
            return
        if candidate.path is not None:
            good_path = self._path("good")
            try:
                os.replace(candidate.path, good_path)
            except OSError as err:
                raise RuntimeError(f"lightning_amp ladder: renaming the snapshot {candidate.path!r} to {good_path!r} "
                                   f"failed ({type(err).__name__}: {err})") from err
            candidate = candidate._replace(path=good_path)
        self.good, self.candidate = candidate, None

    def drop_candidate(self) -> None:
        if self.candidate is not None and self.candidate.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.candidate.path)
        self.candidate = None

    def restore(self, objects: Mapping[str, Any]) -> int:
        """Load the good snapshot into ``objects`` (the same names as when taken); its step. RuntimeError when
        there is none, its file is missing or unreadable, or any object fails to load it: a run never trains on
        from a half-restored state."""
        good = self.good
        if good is None:
            raise RuntimeError("lightning_amp ladder: no rollback point was taken; cannot restore")
        states = good.states if good.path is None else _read(good.path, good.step)
        if set(objects) != set(states):
            raise RuntimeError(f"lightning_amp ladder: the rollback point holds {sorted(states)} but the run now "
                               f"has {sorted(objects)}; cannot restore it")
        for name, obj in objects.items():
            try:  # an optimizer may keep the tensors it loads: in memory, it gets a copy
                obj.load_state_dict(to_host(states[name]) if name != "model" and good.path is None else states[name])
            except Exception as err:  # noqa: BLE001  (any failure must stop the run)
                raise RuntimeError(f"lightning_amp ladder: restoring {name!r} from the rollback point of step "
                                   f"{good.step} failed ({type(err).__name__}: {err}); the run cannot go on "
                                   "from a partly restored state") from err
        return good.step

    def state_dict(self) -> Dict[str, Any]:
        """The rollback point and the candidate (each ``{"step", "states"}`` on the host, or None), for a checkpoint:
        a resumed run rolls back where the straight one would (the checkpoint holds up to twice the model and
        optimizer state more)."""
        return {kind: None if snap is None else
                {"step": snap.step, "states": snap.states if snap.path is None else _read(snap.path, snap.step)}
                for kind, snap in (("good", self.good), ("candidate", self.candidate))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Hold the snapshots of :meth:`state_dict` (written to this store's files when it has a directory)."""
        self.drop_candidate()
        self.good = None
        for kind in ("good", "candidate"):
            saved = state.get(kind)
            if saved is not None:
                self._keep(int(saved["step"]), saved["states"], good=kind == "good")

    @property
    def nbytes(self) -> int:
        """Host bytes the stored snapshots hold (0 with a ``directory``: they are in files)."""
        return sum(_nbytes(s.states) for s in (self.good, self.candidate) if s is not None)


def _write(path: str, payload: Dict[str, Any]) -> None:
    """``payload`` saved to ``path`` through ``path + ".tmp"`` and an atomic rename (flushed to the disk first)."""
    temp = path + ".tmp"
    try:
        with open(temp, "wb") as file:
            torch.save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except Exception as err:  # noqa: BLE001  (a snapshot that is not on disk must stop the run)
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise RuntimeError(f"lightning_amp ladder: writing the snapshot of step {payload['step']} to {path!r} failed "
                           f"({type(err).__name__}: {err})") from err


def _read(path: str, step: int) -> Dict[str, Any]:
    """The states of the snapshot of ``step`` in ``path``; RuntimeError naming the file when it is missing,
    unreadable, or holds another step."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)  # a file this store wrote
        if not isinstance(payload, dict) or payload.get("step") != step or not isinstance(payload.get("states"), dict):
            raise ValueError(f"it does not hold the snapshot of step {step}")
    except Exception as err:  # noqa: BLE001  (any failure must stop the run)
        raise RuntimeError(f"lightning_amp ladder: reading the rollback point of step {step} from {path!r} failed "
                           f"({type(err).__name__}: {err}); the run cannot go on") from err
    return payload["states"]
