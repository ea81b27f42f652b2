"""Timing a window of training steps with no host sync per step.

The window opens when step ``first`` starts and closes when step ``first + steps - 1`` ends; the time
per step is the window's length divided by ``steps`` (a mean, so host and device overlap across steps
the way they do in training). CUDA: an event is recorded on the current stream at each end of the
window and the host waits once, for the closing event, when the result is read. CPU: the wall clock
(work on the CPU is done when the step returns). Training losses are kept as device tensors and read
in one transfer at the end, so reading them does not sync either.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
import torch


class WallClock:
    """Host wall clock: ``mark()`` is a ``time.perf_counter()`` reading; seconds between two marks."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """CUDA events on the current stream; ``seconds`` waits for the closing event (the one sync)."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def clock_for(device_type: str):
    """The clock for ``device_type`` ("cpu" or "cuda")."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    return CudaClock() if device_type == "cuda" else WallClock()


class StepWindow(L.Callback):
    """Times steps ``first .. first + steps - 1`` (0-based) of a fit as one window; keeps every step's loss.

    Steps are counted by ``on_train_batch_end`` calls, so each call is one optimizer step (no gradient
    accumulation in the benchmark).
    """

    def __init__(self, clock, first: int, steps: int) -> None:
        if first < 0 or steps < 1:
            raise ValueError(f"need first >= 0 and steps >= 1, got first={first}, steps={steps}")
        self.clock = clock
        self.first, self.steps = first, steps
        self._done = 0
        self._start: Optional[Any] = None
        self._end: Optional[Any] = None
        self._losses: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._done == self.first:
            self._start = self.clock.mark()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._losses.append(loss.detach().float().reshape(()))
        self._done += 1
        if self._done == self.first + self.steps:
            self._end = self.clock.mark()

    def seconds_per_step(self) -> float:
        """Mean seconds per step over the window (waits for the device once); raises if it never closed."""
        if self._start is None or self._end is None:
            raise RuntimeError(f"the timing window did not close: {self._done} steps ran, "
                               f"{self.first + self.steps} needed")
        return self.clock.seconds(self._start, self._end) / self.steps

    def losses(self) -> list[float]:
        """Every step's training loss, in order (one device-to-host transfer)."""
        if not self._losses:
            return []
        return torch.stack(self._losses).cpu().tolist()
