"""The ``path`` fixture of the optimizer tests: each runs on the compiled extension and on the fallback."""
import pytest

from lightning_amp import ops


@pytest.fixture(params=["ext", "fallback"])
def path(request, monkeypatch):
    """The compiled extension (skipped if not built) or the pure-PyTorch fallback."""
    if request.param == "ext":
        if ops.backend("cpu") != "cpu-ext":
            pytest.skip("compiled extension not built")
    else:
        monkeypatch.setattr(ops._ext, "_EXT", None)
    return request.param
