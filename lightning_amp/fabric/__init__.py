"""Lightning Fabric glue: ``Fabric(plugins=[AmpO2Precision()])``, ``Fabric(strategy="tp_fused")``."""
from lightning_amp.amp.gate import make_scheduler_skip_aware
from lightning_amp.fabric.precision import AmpO0Precision, AmpO1Precision, AmpO2Precision, AmpO3Precision, AmpPrecision
from lightning_amp.fabric.strategy import TensorParallelStrategy

__all__ = ["AmpPrecision", "AmpO0Precision", "AmpO1Precision", "AmpO2Precision", "AmpO3Precision",
           "TensorParallelStrategy", "make_scheduler_skip_aware"]
