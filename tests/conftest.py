"""Shared fixtures.

``flag_timing``: runs a test twice, with each optimizer step's overflow flag reaching the host at
once (``"immediate"``, what the CPU does) and with a device running behind the host (``"late"``:
a flag lands only when waited for or ``LATE_STEPS`` steps later, through
``LIGHTNING_AMP_SIMULATE_DEVICE_LAG``, see :mod:`lightning_amp.amp.gate`). The variable is in the
environment, so processes a test spawns (DDP ranks) run late too. On CUDA the flags of real
device steps land late anyway; the simulation only holds them back further.
"""
import pytest

from lightning_amp.amp.gate import LAG_ENV

LATE_STEPS = 2


@pytest.fixture(params=["immediate", "late"])
def flag_timing(request, monkeypatch):
    monkeypatch.setenv(LAG_ENV, "0" if request.param == "immediate" else str(LATE_STEPS))
    return request.param
