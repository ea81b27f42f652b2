"""Runs the benchmark matrix, one fresh process per (model, level), with a rich progress display.

Processes come from a ``multiprocessing`` fork server that has imported torch, Lightning and
torchmetrics once, so each run starts clean (its own interpreter state, allocator and memory
high-water mark) without paying the few seconds of imports again. Every run trains on the same
seed and data, so losses are comparable across levels.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
from typing import Callable, Iterable, Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lightning_amp.bench.choices import DEFAULT_WARMUP
from lightning_amp.bench.models import MODELS
from lightning_amp.bench.worker import RunSpec, failure_record, resolve_device, run_to_file

PRELOAD = ["lightning_amp.bench.worker", "torchmetrics", "lightning_amp"]
RUN_TIMEOUT_S = 1800.0

#: torch CPU threads per run when none are asked for: on CPU 1, because a run with one thread per core
#: slows down 10-15x whenever another process takes a core (measured on a shared 2-core machine)
DEFAULT_THREADS = {"cpu": 1, "cuda": None}


def plan_runs(models: Sequence[str], levels: Sequence[str], dtype: str = "auto", size: Optional[str] = None,
              steps: Optional[int] = None, warmup: Optional[int] = None, seed: int = 0, accelerator: str = "auto",
              threads: Optional[int] = None, batch_size: Optional[int] = None,
              optimizer: str = "example") -> list[RunSpec]:
    """The specs in run order (model-major). ``size``, ``steps``, ``batch_size`` and ``warmup`` left as None
    take each model's defaults for the device ``accelerator`` resolves to (:meth:`BenchModel.defaults`);
    a ``size`` given without a ``batch_size`` uses the example's own batch for that size; ``threads=None``
    takes :data:`DEFAULT_THREADS`; ``optimizer`` is one of :data:`~lightning_amp.bench.optimizers.OPTIMIZERS`."""
    device_type = resolve_device(accelerator)
    specs = []
    for m in models:
        defaults = MODELS[m].defaults(device_type)
        specs += [RunSpec(model=m, level=lv, dtype=dtype, size=size or defaults["size"],
                          steps=steps or defaults["steps"],
                          warmup=DEFAULT_WARMUP[device_type] if warmup is None else warmup, seed=seed,
                          accelerator=accelerator, threads=threads or DEFAULT_THREADS[device_type],
                          batch_size=batch_size or (None if size else defaults["batch_size"]), optimizer=optimizer)
                  for lv in levels]
    return specs


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        return context
    return multiprocessing.get_context("spawn")


def run_isolated(spec: RunSpec, workdir: str, context=None, child: Callable = run_to_file, name: str = "") -> dict:
    """Run one spec in a fresh process; returns its record (a failure record if the process died).

    ``child(spec, result_path, log_path)`` (a picklable callable, default
    :func:`~lightning_amp.bench.worker.run_to_file`) runs in that process and writes the record as JSON to
    ``result_path``; ``name`` tells runs of one spec apart in ``workdir``."""
    context = context or _context()
    stem = os.path.join(workdir, f"{spec.model}-{spec.level}{name}")
    result_path, log_path = stem + ".json", stem + ".log"
    process = context.Process(target=child, args=(spec, result_path, log_path), name=f"bench-{spec.model}-{spec.level}")
    process.start()
    process.join(RUN_TIMEOUT_S)
    if process.is_alive():
        process.terminate()
        process.join()
        return failure_record(spec, f"timed out after {RUN_TIMEOUT_S:.0f} s")
    if os.path.exists(result_path):
        with open(result_path) as result:
            return json.load(result)
    tail = ""
    if os.path.exists(log_path):
        with open(log_path) as log:
            tail = log.read()[-500:]
    return failure_record(spec, f"process exited with code {process.exitcode}: {tail}")


def run_matrix(specs: Iterable[RunSpec], console: Optional[Console] = None) -> list[dict]:
    """Run every spec in its own process, in order, showing progress; returns the records in the same order."""
    specs = list(specs)
    console = console or Console(stderr=True)
    context = _context()
    records: list[dict] = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    with tempfile.TemporaryDirectory(prefix="lightning-amp-bench-") as workdir, \
            Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("benchmark", total=len(specs))
        for spec in specs:
            progress.update(task, description=f"{spec.model:<11} {spec.level:<10} ({spec.size}, {spec.steps} steps)")
            record = run_isolated(spec, workdir, context)
            records.append(record)
            if record.get("error"):
                progress.console.print(f"[red]{spec.model} {spec.level} failed:[/red] {record['error']}")
            else:
                progress.console.print(f"{spec.model:<11} {spec.level:<4} {record['step_time_ms']:9.1f} ms/step  "
                                       f"peak {record['peak_mem_mb']:8.1f} MiB  loss {record['final_loss']:.4f}")
            progress.advance(task)
        progress.update(task, description="done")
    return records
