"""The warning after every ``OVERFLOW_WARN_AFTER`` overflows in a row is issued every so many, not once (issue 35).

2N+1 overflowing steps in a row give exactly two warnings (at N and 2N in a row) naming the count; a clean step
restarts the count. With the flags landing at once and late (``flag_timing``: the count is that step's own).
"""
import pytest
import torch

from lightning_amp.amp.engine import OVERFLOW_WARN_AFTER, AmpEngine
from lightning_amp.amp.scaler import LossScaler

N = OVERFLOW_WARN_AFTER


def _train(overflows):
    """One step per entry of ``overflows`` (True: an inf grad); returns the warnings issued."""
    warnings = []
    engine = AmpEngine(lambda: LossScaler("dynamic"), warn=warnings.append)
    weight = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    optimizer = torch.optim.SGD([weight], lr=1e-3)
    engine.connect([optimizer], {weight: ["layer.weight"]})
    gen = torch.Generator().manual_seed(1)
    for overflow in overflows:
        engine.scale_loss((torch.randn(2, 4, generator=gen) @ weight).square().mean()).backward()
        if overflow:
            weight.grad[1, 2] = float("inf")
        engine.step(optimizer, lambda: None, grads_read=False)
        optimizer.zero_grad()
    assert engine.skipped_steps == sum(overflows)  # waits for every flag
    return warnings


def test_2n_plus_1_overflows_in_a_row_warn_twice(flag_timing):
    warnings = _train([False] + [True] * (2 * N + 1) + [False])
    assert len(warnings) == 2, warnings
    assert f"{N} optimizer steps in a row skipped" in warnings[0] and "layer.weight" in warnings[0]
    assert f"{2 * N} optimizer steps in a row skipped" in warnings[1]


def test_a_clean_step_restarts_the_count(flag_timing):
    warnings = _train([True] * (N - 1) + [False] + [True] * (N - 1) + [False])
    assert warnings == []
    assert len(_train([True] * (N - 1) + [False] + [True] * N)) == 1
