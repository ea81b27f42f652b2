"""lightning-amp: Apex-style mixed precision, fused optimizers and fused tensor parallelism for Lightning."""
from lightning_amp._version import version as _version

__version__ = _version()

import torch as _torch  # noqa: E402

from lightning_amp._torch_support import warn_if_untested as _warn_if_untested  # noqa: E402

_warn_if_untested(_torch.__version__)  # a torch outside the tested range: one warning naming it, no refusal

from lightning_amp.amp.casts import (  # noqa: E402
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from lightning_amp.amp.ladder_rules import LadderRules  # noqa: E402
from lightning_amp.amp.runtime import AmpRuntime  # noqa: E402
from lightning_amp.amp.scaler import LossScaler  # noqa: E402
from lightning_amp.optimizers import FusedAdadelta, FusedAdam, FusedLAMB, FusedSGD  # noqa: E402
from lightning_amp.parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from lightning_amp.parallel.strategy import TensorParallelStrategy  # noqa: E402  (registers "tp_fused")
from lightning_amp.precision import AmpAutoPlugin, AmpO0Plugin, AmpO1Plugin, AmpO2Plugin, AmpO3Plugin, AmpPrecision, main_params  # noqa: E402
from lightning_amp.fabric.strategy import TensorParallelStrategy as _FabricTensorParallelStrategy  # noqa: E402,F401  (registers "tp_fused" for Fabric)
