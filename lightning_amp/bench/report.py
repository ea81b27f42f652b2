"""The benchmark's results as a rich table, a Markdown table and ``bench.json``.

Ratios compare each level with the same model's ``fp32`` run (``O0`` when no fp32 run exists):
speed-up = baseline step time / step time; memory ratio = peak memory / baseline peak memory;
loss difference = (final loss - baseline final loss) / |baseline final loss|.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from rich.table import Table

BASELINE_LEVELS = ("fp32", "O0")
JSON_KEYS = ("model", "level", "dtype", "device", "steps", "step_time_ms", "samples_per_s", "peak_mem_mb",
             "final_loss", "loss_curve")


@dataclass(frozen=True)
class Comparison:
    """One record against its model's baseline; ratios are None where no baseline (or no figure) exists."""

    record: dict
    speedup: Optional[float]
    memory_ratio: Optional[float]
    loss_difference: Optional[float]


def baseline_for(records: Sequence[dict], model: str) -> Optional[dict]:
    """The successful fp32 (else O0) record of ``model``, or None."""
    for level in BASELINE_LEVELS:
        for record in records:
            if record["model"] == model and record["level"] == level and not record.get("error"):
                return record
    return None


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def compare(records: Sequence[dict]) -> list[Comparison]:
    """Each record with its speed-up, memory ratio and relative loss difference against its baseline."""
    comparisons = []
    for record in records:
        base = baseline_for(records, record["model"])
        if base is None or record.get("error"):
            comparisons.append(Comparison(record, None, None, None))
            continue
        loss_diff = None
        if record["final_loss"] is not None and base["final_loss"]:
            loss_diff = (record["final_loss"] - base["final_loss"]) / abs(base["final_loss"])
        comparisons.append(Comparison(
            record,
            speedup=_ratio(base["step_time_ms"], record["step_time_ms"]),
            memory_ratio=_ratio(record["peak_mem_mb"], base["peak_mem_mb"]),
            loss_difference=loss_diff,
        ))
    return comparisons


HEADERS = ("model", "level", "dtype", "step ms", "samples/s", "speed-up", "peak MiB", "mem ratio", "final loss", "Δ loss")


def _cells(c: Comparison) -> tuple[str, ...]:
    r = c.record
    if r.get("error"):
        return (r["model"], r["level"], "-", "failed", "-", "-", "-", "-", "-", r["error"][:60])
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (
        r["model"], r["level"], r["dtype"], fmt(r["step_time_ms"], ".1f"), fmt(r["samples_per_s"], ".1f"),
        fmt(c.speedup, ".2f") + ("x" if c.speedup is not None else ""),
        fmt(r["peak_mem_mb"], ".0f"), fmt(c.memory_ratio, ".2f"), fmt(r["final_loss"], ".4f"),
        fmt(None if c.loss_difference is None else 100 * c.loss_difference, "+.2f") + ("%" if c.loss_difference is not None else ""),
    )


def rich_table(records: Sequence[dict], title: str = "lightning-amp bench") -> Table:
    """A rich Table, one row per record."""
    table = Table(title=title)
    for header in HEADERS:
        table.add_column(header, justify="left" if header in ("model", "level", "dtype") else "right")
    for comparison in compare(records):
        table.add_row(*_cells(comparison))
    return table


def markdown_table(records: Sequence[dict]) -> str:
    """The same table in Markdown (for docs and the README)."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" if i < 3 else "---:" for i in range(len(HEADERS))) + "|"]
    for comparison in compare(records):
        lines.append("| " + " | ".join(_cells(comparison)) + " |")
    return "\n".join(lines) + "\n"


def _strict_json(value):
    """Non-finite floats (a diverged loss) become ``null``: strict JSON has no NaN/Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(item) for item in value]
    return value


def write_json(records: Sequence[dict], path: str) -> None:
    """Write the records as a strict JSON list (every record has at least :data:`JSON_KEYS`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as out:
        json.dump(_strict_json(list(records)), out, indent=1, allow_nan=False)
