"""What ``lightning-amp bench`` takes: levels, dtypes, accelerators, optimizers, default warm-up.

Imports no torch, so that the command's argument parsing and ``--help`` import none (the models and their
per-device defaults: :mod:`lightning_amp.bench.models`, torch-free at import as well).
"""
from lightning_amp._dtype_names import AUTO, HALF_DTYPES

AMP_LEVELS = ("fp32", "O0", "O1", "O2", "O3")
LIGHTNING_LEVELS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
LEVELS = AMP_LEVELS + LIGHTNING_LEVELS
#: the half dtype of a run, by its torch name; the command line takes the plugins' other names of each too
DTYPES = (AUTO, *sorted(HALF_DTYPES))
ACCELERATORS = ("auto", "cpu", "cuda")
OPTIMIZERS = ("example", "fused-adam")
#: untimed steps before the window, per device type (cuDNN/cuBLAS heuristics and the allocator settle on GPU)
DEFAULT_WARMUP = {"cpu": 2, "cuda": 10}
