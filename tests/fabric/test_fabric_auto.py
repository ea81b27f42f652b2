"""``FabricAmpAutoPrecision`` (``opt_level="auto"`` under Fabric, CPU, float16): moves, rolls back, never costs a bit."""
import warnings

import pytest
import torch
from lightning.fabric import Fabric

from lightning_amp import LadderRules
from lightning_amp.fabric import FabricAmpAutoPrecision, FabricAmpPrecision, make_scheduler_skip_aware
from support.ladder_nets import (RESUME_AT, TWO_MOVES, TWO_MOVES_STEPS, BigGradNet, GainSum, assert_same, books,
                                 full_batch, loss_factor)

RULES = LadderRules(nonfinite_in_a_row=3, snapshot_every=2)


def _run(net_cls, plugin, steps):
    torch.manual_seed(0)
    model, (x, y) = net_cls(), full_batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97 ** step)
    if plugin.ladder is not None:
        plugin.rollback_extras["scheduler"] = scheduler
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(model, optimizer)
    make_scheduler_skip_aware(scheduler)  # a step after a skipped (or rolled back) one does not advance it
    for _ in range(steps):
        fabric.backward(model.loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, scheduler


@pytest.mark.parametrize("net_cls, working", [(GainSum, ("O1", 128.0))])
def test_fabric_auto_equals_the_manual_ladders_working_rung(flag_timing, net_cls, working):
    plugin = FabricAmpAutoPrecision(dtype="float16", ladder_rules=RULES)
    with pytest.warns(UserWarning, match="moved from rung"):
        auto, auto_scheduler = _run(net_cls, plugin, 24)
    ladder = plugin.ladder
    assert tuple(ladder.rung) == working and ladder.snapshot_step == 0
    manual, manual_scheduler = _run(net_cls, FabricAmpPrecision("O1", dtype="float16", loss_scale=working[1]),
                                    24 - ladder.moved_at)
    for (name, got), want in zip(auto.state_dict().items(), manual.state_dict().values()):
        assert torch.equal(got, want), name
    assert auto_scheduler.state_dict()["last_epoch"] == manual_scheduler.state_dict()["last_epoch"] > 0


def test_fabric_run_that_never_diverges_is_plain_o2_bit_for_bit(flag_timing):
    plugin = FabricAmpAutoPrecision(dtype="float16", ladder_rules=RULES)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        auto, _ = _run(lambda: GainSum(gain=1.0), plugin, 8)
    plain, _ = _run(lambda: GainSum(gain=1.0), FabricAmpPrecision("O2", dtype="float16", loss_scale=128.0), 8)
    assert plugin.ladder.changes == 0
    for (name, got), want in zip(auto.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(got, want), name


def test_fabric_auto_walks_down_to_the_dynamic_scale_and_trains(flag_timing):
    """Not compared bit for bit with a manual O1-dynamic run: Fabric connects an optimizer at its first step, so a
    fresh run's first backward is at scale 1 (finite here) where the moved run's optimizer is connected already."""
    plugin = FabricAmpAutoPrecision(dtype="float16", ladder_rules=RULES)
    with pytest.warns(UserWarning, match=r"moved from rung 1 \(O1/128.0\) to rung 2 \(O1/dynamic\)"):
        auto, _ = _run(BigGradNet, plugin, 30)
    x, y = full_batch()
    torch.manual_seed(0)
    start = BigGradNet()
    with torch.no_grad():
        assert BigGradNet.loss(auto(x), y) < 0.9 * BigGradNet.loss(start(x), y)


def _two_moves(fabric, plugin, steps, load=None):
    """TWO_MOVES's run under Fabric for the run's ``steps`` (after ``load``-ing a checkpoint, if given): (its objects,
    the scale each step ran at)."""
    torch.manual_seed(0)
    model, (x, y) = GainSum(), full_batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97 ** step)
    plugin.rollback_extras["scheduler"] = scheduler
    model, optimizer = fabric.setup(model, optimizer)
    make_scheduler_skip_aware(scheduler)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "amp": plugin}
    if load is not None:
        fabric.load(load, state)
    scales = {}
    for step in steps:
        scales[step] = plugin.loss_scale
        fabric.backward(GainSum.loss(model(x), y) * loss_factor(step))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return state, scales


def _everything(state):
    return {"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict(),
            "scheduler": state["scheduler"].state_dict(), "books": books(state["amp"].amp)}


def test_fabric_two_moves_with_a_resume_between_them_end_as_the_straight_run(tmp_path):
    plugin = FabricAmpAutoPrecision(**TWO_MOVES)
    with pytest.warns(UserWarning, match="moved from rung 1"):
        straight, scales = _two_moves(Fabric(accelerator="cpu", devices=1, plugins=[plugin]), plugin,
                                      range(TWO_MOVES_STEPS))
    ladder = plugin.ladder
    assert (ladder.changes, ladder.moved_at, ladder.snapshot_step, ladder.steps) == (2, 23, 16, TWO_MOVES_STEPS)
    assert (ladder.snapshots.good.step, ladder.snapshots.candidate.step) == (24, 28)
    assert plugin.skipped_steps == 6  # O2's 3 before the first move (a rollback rewinds no count), BLOWUP's 3
    first = FabricAmpAutoPrecision(**TWO_MOVES)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[first])
    with pytest.warns(UserWarning, match="moved from rung 0"):
        state, _ = _two_moves(fabric, first, range(RESUME_AT))
    fabric.save(tmp_path / "between.ckpt", state)
    resumed = FabricAmpAutoPrecision(**TWO_MOVES)
    with pytest.warns(UserWarning) as record:
        state, resumed_scales = _two_moves(Fabric(accelerator="cpu", devices=1, plugins=[resumed]), resumed,
                                           range(RESUME_AT, TWO_MOVES_STEPS), load=tmp_path / "between.ckpt")
    messages = [str(w.message) for w in record]
    assert any("resuming on rung 1 (O1/dynamic)" in m for m in messages)
    assert any("at step 23; rolled back to step 16 and moved from rung 1" in m for m in messages)
    assert resumed_scales == {step: scales[step] for step in range(RESUME_AT, TWO_MOVES_STEPS)}
    assert_same(_everything(state), _everything(straight))
