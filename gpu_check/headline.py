"""The headline GPU benchmark: BERT-base at seq 128, each precision in a fresh process, timed to a steady state.

    python -m gpu_check.headline --json OUT [--batch-size 256] [--max-steps 400] [--accelerator cuda]

``make gpu-check``'s part ``bench``. Trains ``lightning-amp bench``'s BERT example (size ``base``, its GPU
batch; :func:`lightning_amp.bench.worker.run`) once per entry of :data:`RUNS`, in this order: ``32-true``
(TF32), ``bf16-mixed``, ``bf16-true``, O2 + FusedAdam, O1, and O2 + FusedAdam with torch's autocast lists
(``norm_policy="fp32"``, the op-policy comparison). The runs are processes forked from one server
(:func:`lightning_amp.bench.runner.run_isolated`), so each has its own allocator and memory peak.

Step time is measured, not guessed: :class:`SteadyWindow` records a CUDA event at the end of every step
(no host sync; the wall clock on a CPU), reads the events the device has completed, and finds where the
step times settle (:func:`steady_start`: three consecutive windows of :data:`WINDOW` steps whose
means lie within :data:`TOLERANCE` of one another). A run stops once it has timed three such windows
after that point and has trained its ``min_steps`` (300 where the final loss is compared, as the loss
target says); the step time is the mean from the steady point to the end, ``steady_after`` says how many
steps were needed, and a run that never settles within ``--max-steps`` says ``"steady": false`` (its
speed verdicts then FAIL). OUT gets ``{"records": [...], ...}`` rewritten after every run, so a part
stopped at its timeout keeps the runs it finished.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import lightning as L
import torch

from lightning_amp.bench.timing import clock_for

#: steps per window, and how close (relative) the medians of three consecutive windows must be
WINDOW, TOLERANCE = 10, 0.03
#: steps trained where the final loss is judged ("final loss vs TF32 after 300 steps")
LOSS_STEPS = 300
FORWARDS = ("half", "fp32")


@dataclass(frozen=True)
class HeadlineRun:
    """One run: a level, the optimizer (``example`` or ``fused-adam``), O2's forward (``half``, shipped,
    or ``fp32``: torch's autocast lists) and the steps it must train at least."""

    level: str
    optimizer: str = "example"
    o2_forward: str = "half"
    min_steps: int = 0


RUNS = (HeadlineRun("32-true", min_steps=LOSS_STEPS), HeadlineRun("bf16-mixed"), HeadlineRun("bf16-true"),
        HeadlineRun("O2", "fused-adam", min_steps=LOSS_STEPS), HeadlineRun("O1"),
        HeadlineRun("O2", "fused-adam", o2_forward="fp32"))


def settles_at(times: list, start: int, window: int = WINDOW, tolerance: float = TOLERANCE) -> bool:
    """Whether the three windows of ``window`` step times from ``start`` have means within ``tolerance``
    (relative) of their common mean (means, not medians: one cold step must move the steady point past it)."""
    means = [statistics.fmean(times[start + i * window:start + (i + 1) * window]) for i in range(3)]
    mean = statistics.fmean(means)
    return mean > 0 and all(abs(m - mean) <= tolerance * mean for m in means)


def steady_start(times: list, window: int = WINDOW, tolerance: float = TOLERANCE, first: int = 0) -> Optional[int]:
    """The first step index (from ``first``) at which the step times settle (:func:`settles_at`); None
    when there is no such point yet."""
    return next((s for s in range(first, len(times) - 3 * window + 1) if settles_at(times, s, window, tolerance)),
                None)


class SteadyWindow(L.Callback):
    """Times every step of a fit and stops it once the step time has settled (see the module's doc).

    ``device_type`` "cuda" (events, no host sync) or "cpu" (wall clock); ``min_steps``: steps to train at
    least; the Trainer's ``max_steps`` caps the run."""

    def __init__(self, device_type: str, min_steps: int = 0, window: int = WINDOW, tolerance: float = TOLERANCE):
        if min_steps < 0 or window < 1 or not tolerance > 0:
            raise ValueError(f"need min_steps >= 0, window >= 1, tolerance > 0; got {min_steps}, {window}, {tolerance}")
        self.clock = clock_for(device_type)
        self.min_steps, self.window, self.tolerance = min_steps, window, tolerance
        self._marks: list = []
        self._losses: list[torch.Tensor] = []
        self._times: list[float] = []  # seconds of the steps whose end mark the device has reached
        self._steady: Optional[int] = None
        self._searched = 0  # steps before this one cannot be the steady point (their windows are complete)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._marks:
            self._marks.append(self.clock.mark())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._losses.append(loss.detach().float().reshape(()))
        self._marks.append(self.clock.mark())
        self._read_completed()
        if self._steady is None:
            self._steady = steady_start(self._times, self.window, self.tolerance, first=self._searched)
            self._searched = max(self._searched, len(self._times) - 3 * self.window + 1)
        if self._steady is not None and len(self._losses) >= self.min_steps:
            trainer.should_stop = True

    def _read_completed(self) -> None:
        """Append the times of the steps whose end the device has reached, without waiting for any."""
        while len(self._times) + 1 < len(self._marks):
            start, end = self._marks[len(self._times)], self._marks[len(self._times) + 1]
            if hasattr(end, "query") and not end.query():
                return
            self._times.append(self.clock.seconds(start, end))

    def step_times(self) -> list:
        """Every step's seconds (waits for the device once)."""
        if len(self._marks) > 1 and hasattr(self._marks[-1], "synchronize"):
            self._marks[-1].synchronize()
        self._read_completed()
        return list(self._times)

    def summary(self) -> dict:
        """``steps``, ``steady``, ``steady_after`` (steps before the steady point), ``timed_steps``,
        ``step_time_ms`` (mean from the steady point; over the second half of the run when it never settled)."""
        times = self.step_times()
        if not times:
            raise RuntimeError("no step was timed")
        start = steady_start(times, self.window, self.tolerance)
        first = start if start is not None else len(times) // 2
        timed = times[first:]
        return {"steps": len(times), "steady": start is not None, "steady_after": start, "timed_steps": len(timed),
                "step_time_ms": 1000.0 * sum(timed) / len(timed),
                "step_times_ms": [round(1000.0 * t, 4) for t in times]}

    def seconds_per_step(self) -> float:
        return self.summary()["step_time_ms"] / 1000.0

    def losses(self) -> list[float]:
        return torch.stack(self._losses).cpu().tolist() if self._losses else []


def use_forward(forward: str) -> None:
    """Make the O2 plugins built in this process default to ``norm_policy=forward`` (one of
    :data:`FORWARDS`; for the rest of the process)."""
    from lightning_amp.trainer import precision

    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
    shipped = precision.AmpO2Precision.__init__

    def init(self, **kwargs):
        kwargs.setdefault("norm_policy", forward)
        shipped(self, **kwargs)

    precision.AmpO2Precision.__init__ = init  # the former name, AmpO2Plugin, is a subclass: it inherits this


def measure(entry: HeadlineRun, spec) -> dict:
    """Train ``spec`` (a :class:`~lightning_amp.bench.worker.RunSpec`) as ``entry`` says in this process;
    the worker's record with the steady-state figures and tokens per second."""
    from lightning_amp.bench.worker import resolve_device, run

    if entry.level == "O2" and entry.o2_forward != "half":
        use_forward(entry.o2_forward)
    window = SteadyWindow(resolve_device(spec.accelerator), min_steps=entry.min_steps)
    record = run(spec, window=window)
    summary = window.summary()
    tokens = record["batch_size"] * seq_len(spec.size)
    return dict(record, **summary, o2_forward=entry.o2_forward if entry.level == "O2" else None,
                samples_per_s=1000.0 * record["batch_size"] / summary["step_time_ms"],
                tokens_per_s=1000.0 * tokens / summary["step_time_ms"])


def seq_len(size: str) -> int:
    """The BERT example's sequence length at ``size``."""
    from lightning_amp.bench.models import load_example

    return load_example("bert").SIZES[size].seq_len


def _describe(entry: HeadlineRun) -> str:
    return entry.level + (" + FusedAdam" if entry.optimizer == "fused-adam" else "") + \
        (f" (norm_policy={entry.o2_forward})" if entry.o2_forward != "half" else "")


def run_all(runs, out: Path, batch_size: Optional[int], max_steps: int, accelerator: str) -> list:
    """Run ``runs`` in order, each in a fresh process; rewrite ``out`` after each; return the records."""
    from lightning_amp.bench.runner import _context, plan_runs, run_isolated
    from lightning_amp.bench.worker import run_to_file

    context, records, started = _context(), [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-headline-") as workdir:
        for i, entry in enumerate(runs):
            spec = plan_runs(["bert"], [entry.level], steps=max_steps, warmup=0, accelerator=accelerator,
                             batch_size=batch_size, optimizer=entry.optimizer)[0]
            child = functools.partial(run_to_file, measure=functools.partial(measure, entry))
            record = run_isolated(spec, workdir, context, child=child, name=f"-{i}")
            record.setdefault("optimizer", "FusedAdam" if entry.optimizer == "fused-adam" else entry.optimizer)
            record.setdefault("o2_forward", entry.o2_forward if entry.level == "O2" else None)
            records.append(dict(record, run=_describe(entry)))
            out.write_text(json.dumps({"records": records, "batch_size": spec.batch_size, "max_steps": max_steps,
                                       "window": WINDOW, "tolerance": TOLERANCE,
                                       "seconds": time.monotonic() - started}, indent=1))
            print(f"{_describe(entry):<34} " + (f"error: {record['error']}" if record.get("error") else
                  f"{record['step_time_ms']:8.2f} ms/step, steady after {record['steady_after']} of "
                  f"{record['steps']} steps, {record['tokens_per_s']:9.0f} tokens/s, peak {record['peak_mem_mb']:.0f} MiB"),
                  flush=True)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_check.headline", description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="file for the records")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per step (default: the GPU batch, 256)")
    parser.add_argument("--max-steps", type=int, default=400, help="most steps a run trains (default: 400)")
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    if args.max_steps < LOSS_STEPS or (args.batch_size is not None and args.batch_size < 1):
        parser.error(f"--max-steps must be >= {LOSS_STEPS} and --batch-size >= 1, got {args.max_steps}, {args.batch_size}")
    records = run_all(RUNS, Path(args.json), args.batch_size, args.max_steps, args.accelerator)
    return 0 if all(not r.get("error") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
