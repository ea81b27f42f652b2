"""One benchmark run: train one example at one precision level and measure it.

Meant to run in a fresh process (the runner forks one per (model, level)); also usable by hand::

    python -m lightning_amp.bench --model bert --level O2 --size tiny --steps 5 --accelerator cpu

which prints the JSON record. Levels: ``fp32`` (Lightning ``32-true``, no plugin), lightning-amp's
``O0``-``O3``, and Lightning's own precisions ``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``,
``16-true`` (the peers a user already has). The ``warmup + steps`` batches are drawn before training and
placed on the device (distinct ones up to :data:`BATCH_BUDGET_MIB`, then cycled), so data generation
and host-to-device copies stay out of the timing. Timing: one window over the ``steps`` steps after the
``warmup`` ones, with no sync per step (see :mod:`lightning_amp.bench.timing`). ``final_loss``: mean
training loss of the last ``FINAL_LOSS_WINDOW`` steps; ``peak_mem_mb``: the peak the run added, less
the pre-drawn batches (``batches_mib``), measured as ``peak_mem_method`` says; ``chance_loss``: the loss of the best constant
prediction on the same batches; ``learned``: final loss below ``LEARNED_FRACTION`` of chance.
On GPU, fp32 matmuls use TF32 (``torch.set_float32_matmul_precision("high")``) at every level.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import platform
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_amp.bench.choices import ACCELERATORS, AMP_LEVELS, DTYPES, LEVELS, LIGHTNING_LEVELS  # noqa: F401
from lightning_amp.bench.memory import PeakMemory
from lightning_amp.bench.models import MODELS, SIZES, chance_loss, load_example
from lightning_amp.bench.optimizers import OPTIMIZERS, use_optimizer
from lightning_amp.bench.timing import StepWindow, clock_for

FINAL_LOSS_WINDOW = 5
LEARNED_FRACTION = 0.9
BATCH_BUDGET_MIB = 1024.0  # pre-drawn batches held on the device; beyond it the run cycles through them


@dataclass(frozen=True)
class RunSpec:
    """What to run: model name, precision level, half dtype (lightning-amp levels), size and batch
    (``batch_size=None``: the example's default), timed steps after ``warmup`` untimed ones."""

    model: str
    level: str
    dtype: str = "auto"
    size: str = "tiny"
    steps: int = 10
    warmup: int = 2
    seed: int = 0
    accelerator: str = "auto"
    threads: Optional[int] = None  # torch CPU threads; None keeps torch's default
    batch_size: Optional[int] = None
    optimizer: str = "example"  # one of OPTIMIZERS: the example's own, or FusedAdam in its place

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {tuple(MODELS)}, got {self.model!r}")
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {self.size!r}")
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {self.accelerator!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {self.batch_size}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={self.steps}, warmup={self.warmup}")


def resolve_device(accelerator: str) -> str:
    """"cuda" or "cpu" for an ``--accelerator`` value; "cuda" without a CUDA device is an error."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("accelerator='cuda' but torch sees no CUDA device")
    return "cuda" if accelerator != "cpu" and torch.cuda.is_available() else "cpu"


def precision_arguments(level: str, dtype: str, common) -> dict:
    """Trainer keyword arguments for a level: Lightning's ``precision`` flag, or lightning-amp's plugin."""
    if level in LIGHTNING_LEVELS:
        return dict(precision=level)
    return dict(plugins=common.precision_plugins(level, dtype))


def draw_batches(loader, count: int, device: torch.device, budget_mib: float = BATCH_BUDGET_MIB) -> list:
    """The first ``count`` batches of ``loader`` on ``device``, or fewer: drawing stops once they hold
    ``budget_mib`` (at least one batch is drawn)."""
    def to_device(item):
        if isinstance(item, torch.Tensor):
            return item.to(device)
        return type(item)(to_device(x) for x in item)
    batches, held = [], 0
    for batch in itertools.islice(iter(loader), count):
        batches.append(to_device(batch))
        held += _nbytes(batches[-1:])
        if held >= budget_mib * 2**20:
            break
    return batches


def _as_is(batch):
    return batch


def _nbytes(batches: list) -> int:
    return sum(t.numel() * t.element_size() for batch in batches for t in batch)


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer class and, for torch's, which implementation was asked for (fused/foreach)."""
    flags = [f"{key}={optimizer.defaults[key]}" for key in ("fused", "foreach") if key in optimizer.defaults]
    return f"{type(optimizer).__name__}({', '.join(flags)})" if flags else type(optimizer).__name__


STEPPED_BY = {"kernel": "lightning-amp kernels", "protocol": "optimizer, in-kernel unscale",
              "host": "optimizer.step()"}


def stepped_by(trainer: L.Trainer) -> str:
    """Who ran the update: lightning-amp's kernels (a plain torch Adam/AdamW/SGD under the plugin), the
    optimizer with in-kernel unscaling (FusedAdam, ``fused=True``), or the optimizer's own ``step()``."""
    amp = getattr(trainer.precision_plugin, "amp", None)  # lightning-amp's plugins only
    drivers = amp.drivers if amp is not None else []
    return STEPPED_BY[drivers[0]] if drivers else STEPPED_BY["host"]


def resolved_dtype_name(level: str, dtype: str, device_type: str) -> str:
    """The dtype a level computes in: "float32" for fp32/O0, else the resolved half dtype's name."""
    if level in ("fp32", "O0", "32-true"):
        return "float32"
    if level in LIGHTNING_LEVELS:
        return "bfloat16" if level.startswith("bf16") else "float16"
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


def run(spec: RunSpec, window: Optional[L.Callback] = None) -> dict:
    """Train ``spec.warmup + spec.steps`` steps in this process and return the result record.

    ``window``: the timing callback (default: a :class:`~lightning_amp.bench.timing.StepWindow` over the
    ``spec.steps`` steps after the warm-up); any callback with ``seconds_per_step()`` and ``losses()``."""
    import lightning_amp  # noqa: F401  (registers lightning-amp's strategy; imports the plugins)

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    device_type = resolve_device(spec.accelerator)
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # the fp32 baseline on GPU is TF32, as people run it
    example_module = load_example(spec.model)
    common = sys.modules["_common"]  # the examples' shared helper, imported by load_example as their sibling
    total = spec.warmup + spec.steps

    memory = PeakMemory(device_type)
    memory.start()
    example = example_module.build_example(size=spec.size, seed=spec.seed, batch_size=spec.batch_size)
    use_optimizer(example.module, spec.optimizer)
    batches = draw_batches(example.train_dataloader, total, torch.device(device_type))
    batches_mib = _nbytes(batches) / 2**20  # held for the whole run; not part of the level's footprint
    window = window or StepWindow(clock_for(device_type), first=spec.warmup, steps=spec.steps)
    trainer = L.Trainer(
        accelerator="gpu" if device_type == "cuda" else "cpu", devices=1, max_steps=total, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[window],
        **precision_arguments(spec.level, spec.dtype, common),
    )
    loader = DataLoader(list(itertools.islice(itertools.cycle(batches), total)), batch_size=None,
                        collate_fn=_as_is)
    trainer.fit(example.module, train_dataloaders=loader)
    step_s = window.seconds_per_step()
    peak = max(0.0, memory.peak_mib() - batches_mib)

    losses = window.losses()
    tail = losses[-FINAL_LOSS_WINDOW:]
    final = sum(tail) / len(tail)
    chance = chance_loss(batches)
    return {
        "model": spec.model,
        "level": spec.level,
        "dtype": resolved_dtype_name(spec.level, spec.dtype, device_type),
        "device": device_type,
        "steps": spec.steps,
        "step_time_ms": 1000.0 * step_s,
        "samples_per_s": example.batch_size / step_s,
        "peak_mem_mb": peak,
        "peak_mem_method": memory.method,
        "peak_mem_clamped": memory.clamped,
        "final_loss": final,
        "loss_curve": losses,
        "chance_loss": chance,
        "learned": math.isfinite(final) and final < LEARNED_FRACTION * chance,
        "optimizer": describe_optimizer(trainer.optimizers[0]),
        "stepped_by": stepped_by(trainer),
        "threads": torch.get_num_threads(),
        "precision_plugin": type(trainer.precision_plugin).__name__,
        "size": spec.size,
        "batch_size": example.batch_size,
        "warmup_steps": spec.warmup,
        "distinct_batches": len(batches),
        "batches_mib": batches_mib,
        "timing": "cuda events over the window, one sync" if device_type == "cuda" else "wall clock over the window",
        "device_name": device_description(device_type),
        "params": sum(p.numel() for p in example.module.parameters()),
        "finite": all(math.isfinite(x) for x in losses),
    }


def failure_record(spec: RunSpec, error: str) -> dict:
    """The record of a run that raised: the spec's identity, no figures, and the error text."""
    return {"model": spec.model, "level": spec.level, "dtype": None, "device": None, "steps": 0,
            "step_time_ms": None, "samples_per_s": None, "peak_mem_mb": None, "final_loss": None,
            "loss_curve": [], "size": spec.size, "error": error}


def run_to_file(spec: RunSpec, result_path: str, log_path: Optional[str] = None, measure=None) -> None:
    """Process entry point: run ``spec`` and write its record (or a failure record) as JSON to ``result_path``.

    stdout and stderr go to ``log_path`` (when given) so the parent's progress display stays clean.
    ``measure(spec) -> record`` replaces :func:`run` (e.g. a run with another timing window).
    """
    if log_path:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    try:
        record = (measure or run)(spec)
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
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="example")
    args = parser.parse_args(argv)
    record = run(RunSpec(**vars(args)))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
