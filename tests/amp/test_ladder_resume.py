"""Two moves of the ladder with a checkpoint and a resume between them, from plain PyTorch (``AmpRuntime``): the
resumed run ends exactly where the straight one does (params, optimizer state, LR scheduler, scaler, the ladder's
books), its rollback points keep the run's own step numbers across the moves, and the candidate taken on a failing
rung is never promoted. The same under the Trainer and Fabric: tests/precision/test_auto.py,
tests/fabric/test_fabric_auto.py."""
import copy

import pytest
import torch

from lightning_amp.amp.runtime import AmpRuntime, named_params
from support.flag_timing import LATE_STEPS
from support.ladder_nets import (RESUME_AT, TWO_MOVES, TWO_MOVES_STEPS, GainSum, assert_same, books, full_batch,
                                 loss_factor)


def _runtime():
    options = dict(TWO_MOVES)
    return AmpRuntime("auto", device_type="cpu", scaler_kwargs={k: options.pop(k) for k in ("init_scale",
                                                                                         "growth_interval")}, **options)


def _setup(amp):
    torch.manual_seed(0)
    model = GainSum()
    amp.prepare(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97 ** step)
    amp.connect([optimizer], named_params(model))
    amp.rollback_extras["scheduler"] = scheduler
    return model, optimizer, scheduler


def _train(amp, model, optimizer, scheduler, steps, scales):
    """Steps ``steps`` (the run's own numbers) of a plain loop; the scale each step ran at goes to ``scales``."""
    x, y = full_batch()
    for step in steps:
        with amp.forward_context():
            loss = GainSum.loss(model(x), y) * loss_factor(step)
        scales[step] = amp.loss_scale
        with amp.backward_context():
            amp.scale_loss(loss).backward()
        amp.step(optimizer)
        optimizer.zero_grad()
        scheduler.step()


def _state(amp, model, optimizer, scheduler):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "amp": amp.state_dict()}


@pytest.fixture
def straight(flag_timing):
    amp = _runtime()
    objects = _setup(amp)
    scales = {}
    with pytest.warns(UserWarning, match="moved from rung") as record:
        _train(amp, *objects, range(TWO_MOVES_STEPS), scales)
    amp.release()
    return amp, objects, scales, [str(w.message) for w in record if "moved from rung" in str(w.message)]


def test_two_moves_go_back_to_rollback_points_numbered_by_the_run(straight, flag_timing):
    """The flags land ``late`` steps after their step (a device behind the host): each move comes that much later."""
    amp, _, scales, moves = straight
    ladder, late = amp.ladder, LATE_STEPS if flag_timing == "late" else 0
    assert len(moves) == 2 and ladder.changes == 2 and str(ladder.rung) == "O0"
    assert f"at step {3 + late}; rolled back to step 0 and moved from rung 0 (O2/128.0) to rung 1 (O1/dynamic)" in moves[0]
    # the dynamic rung trained from the first move to step 19: its rollback point is a state of that stretch,
    # numbered by the run (the candidates of steps 8, 12 and 16 promoted 4 steps after each)
    assert f"at step {23 + late}; rolled back to step 16 and moved from rung 1 (O1/dynamic) to rung 2 (O0)" in moves[1]
    assert (ladder.moved_at, ladder.snapshot_step, ladder.steps) == (23 + late, 16, TWO_MOVES_STEPS)
    # the candidate taken on the failing rung (step 20, or 24 when the move came at 25) was dropped at the move:
    # the next one is taken 4 steps later and promoted 4 steps after that
    assert (ladder.snapshots.good.step, ladder.snapshots.candidate.step) == ((16, 28) if late else (24, 28))
    assert scales[RESUME_AT] not in (2.0**4, 2.0**16) and amp.skipped_steps == 6 + late  # O2's steps before the move, then the 3 of BLOWUP


def test_a_resume_between_the_moves_ends_as_the_straight_run(straight, tmp_path):
    want_amp, want_objects, want_scales, _ = straight
    amp = _runtime()
    objects = _setup(amp)
    scales = {}
    with pytest.warns(UserWarning, match="moved from rung 0"):
        _train(amp, *objects, range(RESUME_AT), scales)
    torch.save(_state(amp, *objects), tmp_path / "ckpt.pt")
    amp.release()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)

    resumed = _runtime()
    objects = _setup(resumed)
    model, optimizer, scheduler = objects
    with pytest.warns(UserWarning, match=r"resuming on rung 1 \(O1/dynamic\), reached at step [35]"):
        resumed.load_state_dict(saved["amp"])
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    assert resumed.loss_scale == want_scales[RESUME_AT] and resumed.ladder.steps == RESUME_AT
    scales = {}
    with pytest.warns(UserWarning, match="at step 2[35]; rolled back to step 16"):
        _train(resumed, *objects, range(RESUME_AT, TWO_MOVES_STEPS), scales)
    resumed.release()
    assert scales == {step: want_scales[step] for step in range(RESUME_AT, TWO_MOVES_STEPS)}
    assert_same(_state(resumed, *objects), _state(want_amp, *want_objects))
    assert_same(books(resumed), books(want_amp))


@pytest.mark.parametrize("change, match", [
    (dict(ladder=[("O2", 128.0), ("O1", 128.0), "O0"]), r"its ladder \[\('O2', 128.0\), \('O1', 'dynamic'\), \('O0', "
                                                        r"None\)\] differs from this run's `ladder` \[\('O2', 128.0\), "
                                                        r"\('O1', 128.0\)"),
    (dict(dtype="bfloat16", ladder=["O2", "O1", "O0"]), r"its dtype float16 differs from this run's bfloat16.*its ladder"),
])
def test_a_checkpoint_of_another_ladder_is_refused_before_anything_changes(change, match):
    amp = _runtime()
    _setup(amp)
    state = copy.deepcopy(amp.state_dict())
    amp.release()  # O2's op policy was held since prepare
    other = AmpRuntime("auto", device_type="cpu", **{**{k: v for k, v in TWO_MOVES.items()
                                                        if k not in ("init_scale", "growth_interval")}, **change})
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"the checkpoint belongs to another ladder: " + match):
        other.load_state_dict(state)
    assert_same(other.state_dict(), before)


def test_a_checkpoint_of_the_same_rungs_in_another_dtype_is_refused():
    bf16 = AmpRuntime("auto", dtype="bfloat16", device_type="cpu", ladder=["O2", "O0"])
    fp16 = AmpRuntime("auto", dtype="float16", device_type="cpu", ladder=["O2", "O0"])
    with pytest.raises(ValueError, match=r"its dtype bfloat16 differs from this run's float16; nothing was restored|"
                                         r"its dtype bfloat16 differs from this run's float16\. Resume"):
        fp16.load_state_dict(bf16.state_dict())
    assert fp16.ladder.dtype == torch.float16 and fp16.ladder.steps == 0
