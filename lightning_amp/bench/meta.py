"""What a benchmark run was: date, commit, versions, device, threads and steps, for bench.json, the table and the chart."""
from __future__ import annotations

import datetime
import os
import subprocess
from typing import Sequence


def commit() -> str:
    """The source checkout's short commit (with "+dirty" for local changes to tracked files), or "unknown"."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def cpu_bf16_flags() -> str:
    """Which bf16 instruction sets the CPU reports (bf16 GEMMs beat fp32 by far only with AMX)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return ", ".join(f"{flag}={'yes' if flag in flags else 'no'}" for flag in ("avx512_bf16", "amx_bf16", "amx_tile"))


def run_metadata(records: Sequence[dict], command: str, started: datetime.datetime,
                 finished: datetime.datetime, source: str) -> dict:
    """The run-level facts every figure depends on. ``source``: :func:`commit` read when the run started.
    ``steps``/``warmup_steps``/``threads``/``sizes`` map model -> value (from the successful records)."""
    import lightning
    import torch

    import lightning_amp
    from lightning_amp import ops

    ok = [r for r in records if not r.get("error")]
    device_type = ok[0]["device"] if ok else "unknown"
    return {
        "date": f"{started:%Y-%m-%d %H:%M} UTC",
        "duration_s": round((finished - started).total_seconds(), 1),
        "commit": source,
        "command": command,
        "lightning_amp": lightning_amp.__version__,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "device": ok[0]["device_name"] if ok else "unknown device",
        "device_type": device_type,
        "backend": ops.backend(device_type) if device_type in ("cpu", "cuda") else "unknown",
        "cpu_bf16": cpu_bf16_flags(),
        "steps": {r["model"]: r["steps"] for r in ok},
        "warmup_steps": {r["model"]: r.get("warmup_steps") for r in ok},
        "threads": {r["model"]: r.get("threads") for r in ok},
        "sizes": {r["model"]: f"{r.get('size')}, batch {r.get('batch_size')}" for r in ok},
    }


def describe(run: dict) -> str:
    """One line naming the run: date, commit, device, versions and steps."""
    steps = ", ".join(f"{model} {n}" for model, n in run["steps"].items())
    return (f"{run['date']}, commit {run['commit']}, {run['device']} [{run['cpu_bf16']}], torch {run['torch']}, "
            f"Lightning {run['lightning']}, backend {run['backend']}; timed steps: {steps}")
