"""`lightning-amp bench`: the example models at each precision level, in fresh processes, as table, JSON and chart.

The names below import on first use (PEP 562): the command's argument parsing reads
:mod:`~lightning_amp.bench.choices` and :mod:`~lightning_amp.bench.models` without importing torch.
"""
import importlib

_EXPORTS = {
    "draw_chart": "chart", "MODELS": "models", "SIZES": "models", "chance_loss": "models", "load_example": "models",
    "run_metadata": "meta", "compare": "report", "markdown_table": "report", "print_results": "report",
    "rich_table": "report", "write_json": "report", "plan_runs": "runner", "run_isolated": "runner",
    "run_matrix": "runner", "StepWindow": "timing", "LEVELS": "choices", "RunSpec": "worker",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
