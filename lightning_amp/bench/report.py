"""The benchmark's results as a rich table, a Markdown table and ``bench.json``.

Each level is compared with the same model's fp32 run (``fp32``, else ``32-true``, else ``O0``) and with
Lightning's mixed precision run (``bf16-mixed``, else ``16-mixed``), the peer a user already has:
speed-up = that run's step time / step time; memory ratio = peak memory / that run's peak memory.
Loss difference = (final loss - fp32 final loss) / |fp32 final loss|; it only says something about
convergence when the fp32 run has learned (final loss well below the chance loss), and the table marks
it "(untrained)" otherwise.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from rich.console import Console
from rich.table import Table

BASELINE_LEVELS = ("fp32", "32-true", "O0")
PEER_LEVELS = ("bf16-mixed", "16-mixed")
JSON_KEYS = ("model", "level", "dtype", "device", "steps", "step_time_ms", "samples_per_s", "peak_mem_mb",
             "peak_mem_method", "final_loss", "chance_loss", "learned", "optimizer", "loss_curve")


@dataclass(frozen=True)
class Comparison:
    """One record against its model's fp32 baseline and mixed-precision peer; None where either (or a
    figure) is missing. ``baseline_learned`` is the baseline's ``learned`` flag (None without one)."""

    record: dict
    speedup: Optional[float]
    memory_ratio: Optional[float]
    loss_difference: Optional[float]
    speedup_vs_mixed: Optional[float] = None
    memory_vs_mixed: Optional[float] = None
    baseline_learned: Optional[bool] = None


def _first_ok(records: Sequence[dict], model: str, levels: Sequence[str]) -> Optional[dict]:
    for level in levels:
        for record in records:
            if record["model"] == model and record["level"] == level and not record.get("error"):
                return record
    return None


def baseline_for(records: Sequence[dict], model: str) -> Optional[dict]:
    """The successful fp32 (else 32-true, else O0) record of ``model``, or None."""
    return _first_ok(records, model, BASELINE_LEVELS)


def peer_for(records: Sequence[dict], model: str) -> Optional[dict]:
    """The successful bf16-mixed (else 16-mixed) record of ``model``, or None."""
    return _first_ok(records, model, PEER_LEVELS)


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def compare(records: Sequence[dict]) -> list[Comparison]:
    """Each record with its speed-ups, memory ratios and relative loss difference."""
    comparisons = []
    for record in records:
        if record.get("error"):
            comparisons.append(Comparison(record, None, None, None))
            continue
        base, peer = baseline_for(records, record["model"]), peer_for(records, record["model"])
        loss_diff = None
        if base is not None and record["final_loss"] is not None and base["final_loss"]:
            loss_diff = (record["final_loss"] - base["final_loss"]) / abs(base["final_loss"])
        comparisons.append(Comparison(
            record,
            speedup=_ratio(base and base["step_time_ms"], record["step_time_ms"]),
            memory_ratio=_ratio(record["peak_mem_mb"], base and base["peak_mem_mb"]),
            loss_difference=loss_diff,
            speedup_vs_mixed=_ratio(peer and peer["step_time_ms"], record["step_time_ms"]),
            memory_vs_mixed=_ratio(record["peak_mem_mb"], peer and peer["peak_mem_mb"]),
            baseline_learned=None if base is None else base.get("learned"),
        ))
    return comparisons


HEADERS = ("model", "level", "dtype", "optimizer", "stepped by", "step ms", "samples/s", "speed-up", "vs mixed", "peak MiB",
           "mem ratio", "mem vs mixed", "final loss", "loss/chance", "Δ loss")
_LEFT = ("model", "level", "dtype", "optimizer", "stepped by")


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _cells(c: Comparison) -> tuple[str, ...]:
    r = c.record
    if r.get("error"):
        return (r["model"], r["level"], "-", "-", "-", "failed") + ("-",) * (len(HEADERS) - 7) + (r["error"][:60],)
    loss_over_chance = _ratio(r["final_loss"], r.get("chance_loss"))
    delta = _fmt(None if c.loss_difference is None else 100 * c.loss_difference, "+.2f", "%")
    if c.loss_difference is not None and not c.baseline_learned:
        delta += " (untrained)"
    return (
        r["model"], r["level"], r["dtype"], r.get("optimizer", "-"), r.get("stepped_by", "-"), _fmt(r["step_time_ms"], ".1f"),
        _fmt(r["samples_per_s"], ".1f"), _fmt(c.speedup, ".2f", "x"), _fmt(c.speedup_vs_mixed, ".2f", "x"),
        _fmt(r["peak_mem_mb"], ".0f"), _fmt(c.memory_ratio, ".2f"), _fmt(c.memory_vs_mixed, ".2f"),
        _fmt(r["final_loss"], ".4f"), _fmt(loss_over_chance, ".2f"), delta,
    )


def rich_table(records: Sequence[dict], title: str = "lightning-amp bench") -> Table:
    """A rich Table, one row per record."""
    table = Table(title=title)
    for header in HEADERS:
        table.add_column(header, justify="left" if header in _LEFT else "right")
    for comparison in compare(records):
        table.add_row(*_cells(comparison))
    return table


def markdown_table(records: Sequence[dict]) -> str:
    """The same table in Markdown (for docs and the README)."""
    lines = ["| " + " | ".join(HEADERS) + " |",
             "|" + "|".join("---" if h in _LEFT else "---:" for h in HEADERS) + "|"]
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


def write_json(records: Sequence[dict], path: str, run: Optional[dict] = None) -> None:
    """Write ``{"run": run, "records": [...]}`` as strict JSON (every successful record has at least
    :data:`JSON_KEYS`; ``run`` is :func:`lightning_amp.bench.meta.run_metadata`, or null)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as out:
        json.dump(_strict_json({"run": run, "records": list(records)}), out, indent=1, allow_nan=False)


def print_results(records: Sequence[dict], title: str, console: Console) -> None:
    """The table on ``console``: a rich table on a terminal, else (piped, captured) the Markdown table at
    full width, so no cell is cut to fit a terminal that is not there."""
    if console.is_terminal:
        console.print(rich_table(records, title=title))
    else:
        console.file.write(f"{title}\n\n{markdown_table(records)}")
