"""The benchmark chart: one column per model; rows of bars per level.

Rows: speed-up against fp32 and against Lightning's ``bf16-mixed`` (higher is better), peak-memory ratio
against both (lower is better), then the absolute step time (ms) and peak memory (MiB). A dashed line
marks 1.0 on the ratio rows. Runs whose loss did not fall below chance (``learned`` false) are hatched
and their level is marked with ``*`` on the axis. Level names are set vertically so they never overlap; the
title and the run's metadata (date, commit, device, threads, versions, steps) are wrapped to the
figure's width.
"""
from __future__ import annotations

import os
import textwrap
from typing import Optional, Sequence

from lightning_amp.bench.report import compare, peer_for

LEVEL_COLOURS = {"fp32": "#7f7f7f", "O0": "#bcbd22", "O1": "#1f77b4", "O2": "#2ca02c", "O3": "#d62728",
                 "32-true": "#c7c7c7", "bf16-mixed": "#ff7f0e", "16-mixed": "#ffbb78", "bf16-true": "#8c564b",
                 "16-true": "#c49c94"}
#: (attribute of Comparison or record key, axis label, which way is better, is a ratio)
ROWS = (
    ("speedup", "speed-up vs fp32", "higher is better", True),
    ("speedup_vs_mixed", "speed-up vs bf16-mixed", "higher is better", True),
    ("memory_ratio", "peak memory / fp32", "lower is better", True),
    ("memory_vs_mixed", "peak memory / bf16-mixed", "lower is better", True),
    ("step_time_ms", "step time (ms)", "lower is better", False),
    ("peak_mem_mb", "peak memory (MiB)", "lower is better", False),
)


def draw_chart(records: Sequence[dict], path: str, title: str = "lightning-amp bench",
               run: Optional[dict] = None) -> int:
    """Write the chart of :func:`build_figure` as a PNG to ``path``; returns the number of bars drawn."""
    import matplotlib.pyplot as plt

    figure, bars = build_figure(records, title, run)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return bars


def build_figure(records: Sequence[dict], title: str = "lightning-amp bench", run: Optional[dict] = None):
    """The chart as a matplotlib figure (Agg backend) and the number of bars drawn.

    Failed runs are left out, and so is a ratio whose baseline run is missing. ``run`` is the run's
    metadata (:func:`lightning_amp.bench.meta.run_metadata`), printed at the bottom. Raises ValueError
    when no run succeeded.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparisons = [c for c in compare(records) if not c.record.get("error")]
    if not comparisons:
        raise ValueError("no successful run to chart")
    models = list(dict.fromkeys(c.record["model"] for c in comparisons))
    width = max(8.0, 4.4 * len(models))
    figure, axes = plt.subplots(len(ROWS), len(models), figsize=(width, 2.3 * len(ROWS) + 1.6), squeeze=False)
    bars = 0
    for column, model in enumerate(models):
        runs = [c for c in comparisons if c.record["model"] == model]
        peer = peer_for(records, model)
        for row, (key, label, better, ratio) in enumerate(ROWS):
            axis = axes[row][column]
            shown = [c for c in runs if _value(c, key) is not None]
            ticks = [c.record["level"] + ("" if c.record.get("learned", True) else "*") for c in shown]
            values = [_value(c, key) for c in shown]
            drawn = axis.bar(range(len(shown)), values, color=[LEVEL_COLOURS.get(c.record["level"], "#9467bd")
                                                                for c in shown])
            for bar, c in zip(drawn, shown):
                if not c.record.get("learned", True):
                    bar.set_hatch("//")
                    bar.set_edgecolor("black")
            bars += len(drawn)
            if values:
                axis.bar_label(drawn, fmt="%.2f" if ratio else ("%.0f" if max(values) >= 100 else "%.1f"), fontsize=7)
            if ratio:
                axis.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            axis.set_xticks(range(len(shown)), ticks, rotation=90, fontsize=8)
            if peer is not None:
                label = label.replace("bf16-mixed", peer["level"])
            axis.set_ylabel(f"{label}\n({better})", fontsize=8)
            axis.margins(y=0.18)
            if row == 0:
                first = runs[0].record
                axis.set_title(f"{model} ({first.get('size', '')}, batch {first.get('batch_size', '?')}, "
                               f"{first['device']})", fontsize=10)
    chars = int(width * 11)
    heading = "\n".join(textwrap.wrap(title, chars))
    notes = "* hatched: loss not below 0.9 x chance (the run did not learn; its speed still counts)."
    if run is not None:
        from lightning_amp.bench.meta import describe

        notes = describe(run) + ". " + notes
    figure.suptitle(heading, fontsize=12)
    figure.text(0.5, 0.005, "\n".join(textwrap.wrap(notes, int(width * 14))), ha="center", va="bottom", fontsize=8)
    figure.tight_layout(rect=(0, 0.045, 1, 0.97))
    return figure, bars


def _value(comparison, key: str) -> Optional[float]:
    return getattr(comparison, key) if hasattr(comparison, key) else comparison.record.get(key)
