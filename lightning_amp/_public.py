"""The package's public names (``lightning_amp/__init__.py`` imports them all, or in the ``lightning-amp``
command on first use: :mod:`lightning_amp._command`). Importing this module registers ``strategy="tp_fused"``
with Lightning's Trainer and Fabric and loads (or builds) the compiled core."""
import torch as _torch

from lightning_amp._torch_support import warn_if_untested as _warn_if_untested

_warn_if_untested(_torch.__version__)  # a torch outside the tested range: one warning naming it, no refusal

from lightning_amp.amp.casts import (float_function, half_function, promote_function,  # noqa: E402
                                      register_float_function, register_half_function, register_promote_function)
from lightning_amp.amp.ladder.rules import LadderRules  # noqa: E402
from lightning_amp.amp.runtime import AmpRuntime  # noqa: E402
from lightning_amp.amp.scaler import LossScaler  # noqa: E402
from lightning_amp.optimizers import FusedAdadelta, FusedAdam, FusedLAMB, FusedSGD  # noqa: E402
from lightning_amp.parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from lightning_amp.trainer.strategy import TensorParallelStrategy  # noqa: E402  (registers "tp_fused")
from lightning_amp.trainer.precision import (AmpAutoPlugin, AmpAutoPrecision, AmpO0Plugin, AmpO0Precision,  # noqa: E402
                                     AmpO1Plugin, AmpO1Precision, AmpO2Plugin, AmpO2Precision, AmpO3Plugin,
                                     AmpO3Precision, AmpPrecision, main_params)
from lightning_amp.fabric.strategy import TensorParallelStrategy as _FabricTensorParallelStrategy  # noqa: E402,F401  (registers "tp_fused" for Fabric)
from lightning_amp import plugin_kinds as _plugin_kinds  # noqa: E402,F401  (a plugin given to the other Lightning refused)

__all__ = [
    "AmpPrecision", "AmpAutoPrecision", "AmpO0Precision", "AmpO1Precision", "AmpO2Precision", "AmpO3Precision",
    "AmpAutoPlugin", "AmpO0Plugin", "AmpO1Plugin", "AmpO2Plugin", "AmpO3Plugin",  # former names, the same classes
    "TensorParallelStrategy", "LadderRules", "LossScaler", "AmpRuntime", "main_params",
    "FusedAdadelta", "FusedAdam", "FusedLAMB", "FusedSGD", "ColumnParallelLinear", "RowParallelLinear",
    "float_function", "half_function", "promote_function", "register_float_function", "register_half_function",
    "register_promote_function",
]
