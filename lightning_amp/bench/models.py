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


@dataclass(frozen=True)
class BenchModel:
    """A benchmarked example: its script and how many timed steps the default run takes."""

    name: str
    script: str
    default_steps: int


#: name -> model; the default step counts keep `lightning-amp bench` under 5 minutes on 2 CPU cores.
MODELS = {
    "feedforward": BenchModel("feedforward", "feedforward_rossmann.py", default_steps=40),
    "unet": BenchModel("unet", "unet_segmentation.py", default_steps=8),
    "bert": BenchModel("bert", "bert_sentiment.py", default_steps=6),
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
