"""Lightning Trainer glue: ``Trainer(plugins=[AmpO2Precision()])``, ``Trainer(strategy="tp_fused")``.

The mirror of :mod:`lightning_amp.fabric`: each file maps the Trainer's hooks onto the framework-free runtimes
(:class:`~lightning_amp.amp.runtime.AmpRuntime`, :class:`~lightning_amp.parallel.runtime.TensorParallelRuntime`)
through what both frameworks' glue shares (:mod:`lightning_amp.plugin_base`, :mod:`lightning_amp.strategy_base`).
"""
from lightning_amp.trainer.precision import (AmpAutoPrecision, AmpO0Precision, AmpO1Precision, AmpO2Precision,
                                             AmpO3Precision, AmpPrecision, main_params)
from lightning_amp.trainer.strategy import TensorParallelStrategy

__all__ = ["AmpPrecision", "AmpAutoPrecision", "AmpO0Precision", "AmpO1Precision", "AmpO2Precision", "AmpO3Precision",
           "TensorParallelStrategy", "main_params"]
