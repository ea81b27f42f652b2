"""One benchmark run: train one example at one precision level and measure it.

Meant to run in a fresh process (the runner forks one per (model, level)); also usable by hand::

    python -m lightning_amp.bench --model bert --level O2 --size tiny --steps 5

which prints the JSON record. The record holds ``model, level, dtype, device, steps, step_time_ms,
samples_per_s, peak_mem_mb, final_loss, loss_curve`` plus ``size, batch_size, warmup_steps,
device_name, params``. Timing: wall time from ``on_train_batch_start`` to ``on_train_batch_end``
(forward, backward, optimizer step; data generation excluded), median over the steps after the
``warmup`` ones. ``final_loss``: mean training loss of the last ``FINAL_LOSS_WINDOW`` steps.
On GPU, fp32 matmuls use TF32 (``torch.set_float32_matmul_precision("high")``) at every level.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

import lightning as L
import torch

from lightning_amp.bench.memory import PeakMemory
from lightning_amp.bench.models import MODELS, SIZES, load_example

LEVELS = ("fp32", "O0", "O1", "O2", "O3")
DTYPES = ("auto", "bfloat16", "float16")
FINAL_LOSS_WINDOW = 5


@dataclass(frozen=True)
class RunSpec:
    """What to run: model name, precision level, half dtype, timed steps after ``warmup`` untimed ones."""

    model: str
    level: str
    dtype: str = "auto"
    size: str = "small"
    steps: int = 10
    warmup: int = 2
    seed: int = 0
    accelerator: str = "auto"
    threads: Optional[int] = None  # torch CPU threads; None keeps torch's default

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {tuple(MODELS)}, got {self.model!r}")
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {self.size!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={self.steps}, warmup={self.warmup}")


class StepRecorder(L.Callback):
    """Wall time (seconds) and training loss of every optimizer step."""

    def __init__(self, synchronize_cuda: bool) -> None:
        self.synchronize_cuda = synchronize_cuda
        self.step_seconds: list[float] = []
        self.losses: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.synchronize_cuda:
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.synchronize_cuda:
            torch.cuda.synchronize()
        self.step_seconds.append(time.perf_counter() - self._start)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach().float()))


def resolved_dtype_name(level: str, dtype: str, device_type: str) -> str:
    """The dtype a level computes in: "float32" for fp32/O0, else the resolved half dtype's name."""
    if level in ("fp32", "O0"):
        return "float32"
    from lightning_amp.amp.levels import resolve_dtype

    return str(resolve_dtype(dtype, device_type)).replace("torch.", "")


def device_description(device_type: str) -> str:
    """A readable name of the device: the GPU's name, or the CPU model and core count."""
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def run(spec: RunSpec) -> dict:
    """Train ``spec.warmup + spec.steps`` steps in this process and return the result record."""
    import lightning_amp  # noqa: F401  (registers lightning-amp's strategy; imports the plugins)

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    use_cuda = spec.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    device_type = "cuda" if use_cuda else "cpu"
    if use_cuda:
        torch.set_float32_matmul_precision("high")  # the fp32 baseline on GPU is TF32, as people run it
    example_module = load_example(spec.model)
    common = sys.modules["_common"]  # the examples' shared helper, imported by load_example as their sibling

    memory = PeakMemory(device_type)
    memory.start()
    example = example_module.build_example(size=spec.size, seed=spec.seed)
    recorder = StepRecorder(synchronize_cuda=use_cuda)
    trainer = common.make_trainer(spec.level, spec.dtype, spec.warmup + spec.steps,
                                  accelerator="gpu" if use_cuda else "cpu", callbacks=[recorder])
    trainer.fit(example.module, train_dataloaders=example.train_dataloader)
    peak = memory.peak_mib()

    timed = recorder.step_seconds[spec.warmup:]
    step_ms = 1000.0 * statistics.median(timed)
    losses = recorder.losses
    window = losses[-FINAL_LOSS_WINDOW:]
    return {
        "model": spec.model,
        "level": spec.level,
        "dtype": resolved_dtype_name(spec.level, spec.dtype, device_type),
        "device": device_type,
        "steps": len(timed),
        "step_time_ms": step_ms,
        "samples_per_s": example.batch_size / (step_ms / 1000.0),
        "peak_mem_mb": peak,
        "final_loss": sum(window) / len(window),
        "loss_curve": losses,
        "size": spec.size,
        "batch_size": example.batch_size,
        "warmup_steps": spec.warmup,
        "device_name": device_description(device_type),
        "params": sum(p.numel() for p in example.module.parameters()),
        "finite": all(math.isfinite(x) for x in losses),
    }


def failure_record(spec: RunSpec, error: str) -> dict:
    """The record of a run that raised: the spec's identity, no figures, and the error text."""
    return {"model": spec.model, "level": spec.level, "dtype": None, "device": None, "steps": 0,
            "step_time_ms": None, "samples_per_s": None, "peak_mem_mb": None, "final_loss": None,
            "loss_curve": [], "size": spec.size, "error": error}


def run_to_file(spec: RunSpec, result_path: str, log_path: Optional[str] = None) -> None:
    """Process entry point: run ``spec`` and write its record (or a failure record) as JSON to ``result_path``.

    stdout and stderr go to ``log_path`` (when given) so the parent's progress display stays clean.
    """
    if log_path:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    try:
        record = run(spec)
    except Exception:  # noqa: BLE001 - any failure becomes a failure record, the benchmark goes on
        traceback.print_exc()
        record = failure_record(spec, traceback.format_exc(limit=3).strip().splitlines()[-1])
    sys.stdout.flush()
    sys.stderr.flush()
    with open(result_path, "w") as result:
        json.dump(record, result)


def main(argv=None) -> int:
    """``python -m lightning_amp.bench``: run one spec in this process and print its JSON record."""
    parser = argparse.ArgumentParser(prog="python -m lightning_amp.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), required=True)
    parser.add_argument("--level", choices=LEVELS, required=True)
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    record = run(RunSpec(**vars(args)))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
