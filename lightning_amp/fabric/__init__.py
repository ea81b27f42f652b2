"""Lightning Fabric glue: ``Fabric(plugins=[FabricAmpO2Precision()])``, ``Fabric(strategy="tp_fused")``.

The former names ``AmpPrecision``, ``AmpO0Precision`` .. ``AmpO3Precision`` still import, with a FutureWarning.
"""
from lightning_amp.amp.gate import make_scheduler_skip_aware
from lightning_amp.fabric.precision import (FabricAmpAutoPrecision, FabricAmpO0Precision, FabricAmpO1Precision, FabricAmpO2Precision,
                                            FabricAmpO3Precision, FabricAmpPrecision, deprecated_name)
from lightning_amp.fabric.strategy import TensorParallelStrategy

__all__ = ["FabricAmpPrecision", "FabricAmpAutoPrecision", "FabricAmpO0Precision", "FabricAmpO1Precision", "FabricAmpO2Precision",
           "FabricAmpO3Precision", "TensorParallelStrategy", "make_scheduler_skip_aware"]


def __getattr__(name: str) -> type:
    return deprecated_name(__name__, name)
