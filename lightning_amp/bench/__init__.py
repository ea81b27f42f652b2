"""`lightning-amp bench`: the example models at each precision level, in fresh processes, as table, JSON and chart."""
from lightning_amp.bench.chart import draw_chart
from lightning_amp.bench.models import MODELS, SIZES, chance_loss, load_example
from lightning_amp.bench.meta import run_metadata
from lightning_amp.bench.report import compare, markdown_table, print_results, rich_table, write_json
from lightning_amp.bench.runner import plan_runs, run_isolated, run_matrix
from lightning_amp.bench.timing import StepWindow
from lightning_amp.bench.worker import LEVELS, RunSpec

__all__ = [
    "LEVELS", "MODELS", "SIZES", "RunSpec", "StepWindow", "chance_loss", "compare", "draw_chart", "load_example",
    "markdown_table", "plan_runs", "print_results", "rich_table", "run_isolated", "run_matrix", "run_metadata",
    "write_json",
]
