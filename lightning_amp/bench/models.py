"""The benchmarked models: the three scripts in ``examples/``, loaded by file path.

Each example module exposes ``build_example(size, seed, batch_size, lr) -> Example`` (module,
endless synthetic dataloader, samples per step). The examples live next to the package in a source
checkout (``<repo>/examples``); set ``LIGHTNING_AMP_EXAMPLES`` to point elsewhere.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Sequence


@dataclass(frozen=True)
class BenchModel:
    """A benchmarked example: its script and its default size, batch and timed steps per device type.

    CPU defaults keep ``make bench`` short on 2 cores: tiny models, yet enough steps that the fp32 loss
    falls clearly below chance. GPU defaults fill the device (BERT-base at seq 128, batch 256: at batch
    32-64 an H100 is launch-bound and idles ~60% of the step) and train long enough to compare final
    losses of learned models.
    """

    name: str
    script: str
    cpu_steps: int
    gpu_steps: int
    gpu_batch: int
    cpu_size: str = "tiny"
    gpu_size: str = "base"

    def defaults(self, device_type: str) -> dict:
        """``size``, ``batch_size`` (None: the example's own) and ``steps`` for "cpu" or "cuda"."""
        if device_type == "cuda":
            return dict(size=self.gpu_size, batch_size=self.gpu_batch, steps=self.gpu_steps)
        return dict(size=self.cpu_size, batch_size=None, steps=self.cpu_steps)


MODELS = {
    "feedforward": BenchModel("feedforward", "feedforward_rossmann.py", cpu_steps=60, gpu_steps=300, gpu_batch=32768),
    "unet": BenchModel("unet", "unet_segmentation.py", cpu_steps=150, gpu_steps=200, gpu_batch=64),
    "bert": BenchModel("bert", "bert_sentiment.py", cpu_steps=150, gpu_steps=300, gpu_batch=256),
}
SIZES = ("tiny", "small", "base")


def examples_dir() -> Path:
    """The folder holding the example scripts (``LIGHTNING_AMP_EXAMPLES`` or ``<repo>/examples``)."""
    configured = os.environ.get("LIGHTNING_AMP_EXAMPLES")
    folder = Path(configured) if configured else Path(__file__).resolve().parents[2] / "examples"
    if not (folder / MODELS["bert"].script).is_file():
        raise FileNotFoundError(
            f"example scripts not found in {folder}; run from a source checkout or set LIGHTNING_AMP_EXAMPLES"
        )
    return folder


def load_example(name: str) -> ModuleType:
    """Import ``examples/<script>`` for model ``name`` (one of :data:`MODELS`) and return the module."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {tuple(MODELS)}, got {name!r}")
    folder = examples_dir()
    module_name = f"lightning_amp_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # the examples import their sibling _common.py
    spec = importlib.util.spec_from_file_location(module_name, folder / MODELS[name].script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def chance_loss(batches: Sequence) -> float:
    """The loss of the best constant prediction on ``batches`` (each a tuple whose last item is the target).

    Integer targets (classes): the entropy of the class frequencies, i.e. the cross-entropy of always
    predicting those frequencies (ln 2 for balanced binary labels). Float targets: their variance, the
    mean squared error of always predicting their mean. A model whose loss is not well below this has
    not learned anything yet, and agreement of untrained models says nothing about convergence.
    """
    import torch  # here: the command line reads this module's tables without importing torch

    targets = torch.cat([batch[-1].reshape(-1).cpu() for batch in batches])
    if targets.is_floating_point():
        return float(targets.double().var(unbiased=False))
    counts = torch.bincount(targets.long()).double()
    freq = counts[counts > 0] / counts.sum()
    return float(-(freq * freq.log()).sum())
