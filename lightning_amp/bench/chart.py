"""The benchmark chart: one column per model, step time (top) and peak memory (bottom) bars per level."""
from __future__ import annotations

import os
from typing import Sequence

LEVEL_COLOURS = {"fp32": "#7f7f7f", "O0": "#bcbd22", "O1": "#1f77b4", "O2": "#2ca02c", "O3": "#d62728",
                 "32-true": "#c7c7c7", "bf16-mixed": "#ff7f0e", "16-mixed": "#ffbb78", "bf16-true": "#8c564b",
                 "16-true": "#c49c94"}


def draw_chart(records: Sequence[dict], path: str, title: str = "lightning-amp bench") -> int:
    """Write a PNG to ``path`` (matplotlib, Agg backend); returns the number of bars drawn.

    Failed runs are left out. Each bar is labelled with its value; raises ValueError when no run succeeded.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if not r.get("error")]
    if not ok:
        raise ValueError("no successful run to chart")
    models = list(dict.fromkeys(r["model"] for r in ok))
    figure, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7), squeeze=False)
    bars = 0
    for column, model in enumerate(models):
        runs = [r for r in ok if r["model"] == model]
        labels = [r["level"] for r in runs]
        colours = [LEVEL_COLOURS.get(level, "#9467bd") for level in labels]
        for row, (key, unit) in enumerate((("step_time_ms", "step time (ms)"), ("peak_mem_mb", "peak memory (MiB)"))):
            axis = axes[row][column]
            values = [r[key] for r in runs]
            drawn = axis.bar(labels, values, color=colours)
            axis.bar_label(drawn, fmt="%.0f" if max(values) >= 100 else "%.1f", fontsize=8)
            bars += len(drawn)
            axis.set_ylabel(unit)
            axis.margins(y=0.15)
            if row == 0:
                axis.set_title(f"{model} ({runs[0].get('size', '')}, {runs[0]['device']})")
    figure.suptitle(title)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return bars
