"""How many optimizer steps a simulated device runs behind the host in the tests' ``"late"`` flag timing.

Kept outside ``conftest.py``: a second ``conftest`` module (``tests/optimizers/conftest.py``) shares that name
in ``sys.modules``, so ``from conftest import ...`` would resolve to whichever pytest loaded first.
"""

LATE_STEPS = 2
