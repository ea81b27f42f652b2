"""The ``path`` fixture of the optimizer tests: each runs on the compiled extension (our kernels forced, and
torch's fused kernels forced wherever the choice table, lightning_amp/ops/_choice.py, may take them) and on
the fallback."""
import pytest

from lightning_amp import ops
from lightning_amp.ops import _choice


@pytest.fixture(params=["ext", "ext-torch", "fallback"])
def path(request, monkeypatch):
    """The compiled extension (skipped if not built) with our kernels or torch's, or the pure-PyTorch fallback."""
    if request.param.startswith("ext"):
        if ops.backend("cpu") != "cpu-ext":
            pytest.skip("compiled extension not built")
        monkeypatch.setattr(_choice, "forced", _choice.TORCH if request.param == "ext-torch" else _choice.OURS)
    else:
        monkeypatch.setattr(ops._ext, "_EXT", None)
    return request.param
