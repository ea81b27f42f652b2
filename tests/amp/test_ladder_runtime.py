"""``opt_level="auto"`` from plain PyTorch: AmpRuntime alone runs the ladder (no Lightning), and its rollback points
are never taken from inside a streak of spiking losses."""
import pytest
import torch
from torch import nn

from support.ladder_nets import GainSum, full_batch
from lightning_amp import LadderRules
from lightning_amp.amp.runtime import AmpRuntime, named_params


def _train(amp, model, optimizer, steps, loss_factor=lambda step: 1.0, each_step=lambda step: None):
    """A plain loop: forward under the runtime, the loss to the spike rule (times ``loss_factor(step)``), scaled
    backward, step."""
    x, y = full_batch()
    for step in range(steps):
        with amp.forward_context():
            loss = nn.functional.mse_loss(model(x).float(), y)
        amp.log_loss(loss.detach() * loss_factor(step))
        with amp.backward_context():
            amp.scale_loss(loss).backward()
        amp.step(optimizer)
        optimizer.zero_grad()
        each_step(step)


def test_the_runtime_alone_moves_down_the_ladder_and_keeps_its_books():
    torch.manual_seed(0)
    model = GainSum()
    amp = AmpRuntime("auto", dtype="float16", device_type="cpu",
                     ladder_rules=LadderRules(nonfinite_in_a_row=3, snapshot_every=2, spike_factor=None))
    amp.prepare(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.connect([optimizer], named_params(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97 ** step)
    amp.rollback_extras["scheduler"] = scheduler
    skipped = []
    try:
        with pytest.warns(UserWarning, match=r"ladder: nonfinite_in_a_row.*moved from rung 0 \(O2/128.0\) to rung 1 "
                                             r"\(O1/128.0\); non-finite grads last in: .*gain"):
            _train(amp, model, optimizer, 10, each_step=lambda step: skipped.append(amp.skipped_steps))
    finally:
        amp.release()
    assert amp.ladder.changes == 1 and amp.properties.opt_level == "O1" and amp.loss_scales == [128.0]
    assert skipped == sorted(skipped) and skipped[-1] == 3  # the O2 steps skipped before the move stay counted
    assert amp.metrics()["amp/level"] == 1.0 and amp.state_dict()["ladder"]["rung"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


SPIKES = {4: 100.0, 5: 100.0}  # the losses of the states after 4 and 5 steps spike: two in a row, the rule needs 3


def test_a_candidate_inside_a_spike_streak_is_never_promoted_even_when_the_streak_ends_without_firing():
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    amp = AmpRuntime("auto", dtype="bfloat16", device_type="cpu", ladder_rules=LadderRules(
        nonfinite_in_a_row=None, max_skip_rate=None, floor_patience=None, spike_factor=10.0, spike_steps=3,
        spike_history=3, snapshot_every=2))
    amp.prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    amp.connect([optimizer], {})
    good = {}
    try:
        _train(amp, model, optimizer, 10, loss_factor=lambda step: SPIKES.get(step, 1.0),
               each_step=lambda step: good.setdefault(step, amp.ladder.snapshots.good.step))
    finally:
        amp.release()  # O2's op policy was held since prepare
    assert amp.ladder.changes == 0  # the streak ended before the rule fired
    # the rollback point decided at the step taken after n steps, boundaries every 2 steps: at 4 the candidate of 2 is
    # not promoted (a spike streak is under way), at 6 the candidate of 4 (taken inside the streak) is dropped though
    # the streak has ended, at 8 the candidate of 6 is promoted
    assert [good[n] for n in (2, 4, 6, 8)] == [0, 0, 0, 6], good


@pytest.mark.parametrize("ladder, match", [
    (["O2", "O2"], r"`ladder\[1\]` = \('O2', None\).* repeats `ladder\[0\]`"),
    ([("O1", 128.0), ("O2", 128.0)], r"`ladder\[1\]` = \('O2', 128.0\).* stands above `ladder\[0\]`"),
    ([("O1", "dynamic"), ("O1", 128.0)], r"`ladder\[1\]` = \('O1', 128.0\).* stands above"),
    ([("O2", 32.0), ("O2", 128.0)], r"stands above.*a smaller static scale after a larger one"),
])
def test_duplicated_or_out_of_order_rungs_are_refused_at_construction(ladder, match):
    with pytest.raises(ValueError, match=match):
        AmpRuntime("auto", dtype="float16", device_type="cpu", ladder=ladder)


def test_rungs_that_go_down_are_accepted():
    amp = AmpRuntime("auto", dtype="float16", device_type="cpu",
                     ladder=[("O2", 128.0), ("O2", 32.0), ("O2", "dynamic"), ("O1", "dynamic"), "O0"])
    assert [str(r) for r in amp.ladder.rungs] == ["O2/128.0", "O2/32.0", "O2/dynamic", "O1/dynamic", "O0"]


def test_the_floor_rule_reads_the_dynamic_scales_floor_through_the_runtime():
    """Every step overflows (an inf loss); the dynamic rung backs off from 4 to its floor 1, and two overflows there
    move the run (floor_patience: the runtime hands the ladder the scale and its floor with each landed flag)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    amp = AmpRuntime("auto", dtype="float16", device_type="cpu", ladder=[("O1", "dynamic"), "O0"],
                     scaler_kwargs=dict(init_scale=4.0, min_loss_scale=1.0),
                     ladder_rules=LadderRules(nonfinite_in_a_row=None, max_skip_rate=None, floor_patience=2,
                                              spike_factor=None, snapshot_every=100))
    amp.prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    amp.connect([optimizer], {})
    x, _ = full_batch()
    with pytest.warns(UserWarning, match=r"floor_patience: 2 overflows in a row with the loss scale at its floor 1.0"):
        for _ in range(6):
            with amp.forward_context():
                loss = model(x).float().sum() * float("inf")
            with amp.backward_context():
                amp.scale_loss(loss).backward()
            amp.step(optimizer)
            optimizer.zero_grad()
    amp.release()
    # the scale after each step: 2, 1 (at the floor: 1st overflow there), 1 (2nd): the rule fires at step 3
    assert amp.ladder.changes == 1 and amp.ladder.moved_at == 3 and str(amp.ladder.rung) == "O0"
