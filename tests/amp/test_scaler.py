"""LossScaler trajectories against hand-computed sequences, state round trips, bad arguments."""
import io
import random

import pytest
import torch

from lightning_amp.amp.scaler import LossScaler


def run(scaler, flags):
    """Feed overflow flags; return the scale after each update."""
    out = []
    for flag in flags:
        scaler.update(flag)
        out.append(scaler.scale)
    return out


def test_defaults_are_apex():
    s = LossScaler()
    assert s.dynamic and s.scale == 2.0**16
    assert (s.growth_factor, s.backoff_factor, s.growth_interval, s.hysteresis) == (2.0, 0.5, 2000, 1)
    assert (s.min_loss_scale, s.max_loss_scale) == (1.0, 2.0**24)
    run(s, [False] * 1999)
    assert s.scale == 2.0**16
    s.update(False)
    assert s.scale == 2.0**17
    s.update(True)
    assert s.scale == 2.0**16


def test_growth_and_immediate_backoff_with_hysteresis_one():
    s = LossScaler(init_scale=8.0, growth_interval=3)
    flags = [0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0]
    expected = [8, 8, 16, 16, 16, 8, 8, 8, 16, 8, 4, 4]
    assert run(s, flags) == expected
    assert s.growth_tracker == 1 and s.total_overflows == 3 and s.overflows_in_a_row == 0 and s.steps == 12


def test_overflow_resets_growth_counter():
    s = LossScaler(init_scale=32.0, growth_interval=4, backoff_factor=0.25)
    #        two clean, overflow (reset), three clean: no growth yet, fourth clean grows
    flags = [0, 0, 1, 0, 0, 0, 0]
    assert run(s, flags) == [32, 32, 8, 8, 8, 8, 16]


def test_hysteresis_follows_megatron():
    # hysteresis=2: the first overflow is tolerated; the budget is re-armed only by a growth,
    # so after it is spent every overflow backs off until growth_interval clean steps pass.
    s = LossScaler(init_scale=64.0, growth_interval=3, hysteresis=2)
    steps = [
        # flag, scale, growth_tracker, hysteresis_tracker
        (1, 64, 0, 1),  # tolerated
        (0, 64, 1, 1),  # a clean step does not re-arm
        (1, 32, 0, 0),  # budget spent: back off
        (1, 16, 0, 0),  # and again at once
        (0, 16, 1, 0),
        (0, 16, 2, 0),
        (0, 32, 0, 2),  # growth re-arms the budget
        (1, 32, 0, 1),  # tolerated again
        (1, 16, 0, 0),
    ]
    for flag, scale, growth, hyst in steps:
        s.update(flag)
        assert (s.scale, s.growth_tracker, s.hysteresis_tracker) == (scale, growth, hyst)
    assert s.overflows_in_a_row == 2 and s.total_overflows == 5


def test_hysteresis_three_needs_three_overflows():
    s = LossScaler(init_scale=1024.0, growth_interval=100, hysteresis=3)
    assert run(s, [1, 1, 1, 1]) == [1024, 1024, 512, 256]
    assert s.overflows_in_a_row == 4


def test_floor_default_one_stops_collapse():
    s = LossScaler(init_scale=8.0, growth_interval=10)
    assert run(s, [1] * 6) == [4, 2, 1, 1, 1, 1]
    f = LossScaler(init_scale=1.0, min_loss_scale=0.125, growth_interval=10)
    assert run(f, [1] * 5) == [0.5, 0.25, 0.125, 0.125, 0.125]
    odd = LossScaler(init_scale=10.0, min_loss_scale=3.0, backoff_factor=0.4, growth_interval=10)
    assert run(odd, [1, 1, 1]) == [4.0, 3.0, 3.0]


def test_ceiling_clamps_growth():
    s = LossScaler(init_scale=2.0**23, growth_interval=1)
    assert run(s, [0, 0, 0]) == [2.0**24] * 3
    t = LossScaler(init_scale=30.0, growth_factor=3.0, growth_interval=1, max_loss_scale=100.0)
    assert run(t, [0, 0, 0, 1, 0]) == [90.0, 100.0, 100.0, 50.0, 100.0]


@pytest.mark.parametrize("kwargs, bound", [
    (dict(init_scale=2.0**30), "16777216.0"),  # above the default ceiling 2**24
    (dict(init_scale=2.0**16, max_loss_scale=1024.0), "1024.0"),
    (dict(init_scale=0.5), "1.0"),  # below the default floor
    (dict(init_scale=2.0, min_loss_scale=4.0), "4.0"),
])
def test_init_scale_outside_the_bounds_raises_naming_both(kwargs, bound):
    with pytest.raises(ValueError, match=rf"`init_scale` \({kwargs['init_scale']}\).*`min_loss_scale`, `max_loss_scale`.*{bound}"):
        LossScaler(**kwargs)
    assert LossScaler(init_scale=1024.0, max_loss_scale=1024.0).scale == 1024.0  # the bounds themselves are fine
    with pytest.raises(ValueError, match="init_scale"):  # also for a static scale: "auto" may be dynamic elsewhere
        LossScaler(loss_scale=128.0, init_scale=2.0**30)


def test_static_scale_never_changes_but_counts_overflows():
    s = LossScaler(loss_scale=128.0, init_scale=4.0, growth_interval=1, min_loss_scale=1.0, max_loss_scale=8.0)
    assert not s.dynamic
    assert run(s, [0, 0, 1, 1, 0, 1]) == [128.0] * 6
    assert s.total_overflows == 3 and s.overflows_in_a_row == 1 and s.inv_scale == 1 / 128.0
    assert LossScaler(loss_scale=1).scale == 1.0 and isinstance(LossScaler(loss_scale=3).scale, float)


def test_found_inf_may_be_a_tensor():
    s = LossScaler(init_scale=16.0)
    s.update(torch.tensor(1.0))
    s.update(torch.tensor(0.0))
    assert s.scale == 8.0 and s.total_overflows == 1


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_state_dict_round_trip_mid_trajectory(hysteresis):
    rng = random.Random(1234 + hysteresis)
    flags = [rng.random() < 0.3 for _ in range(60)]
    cfg = dict(init_scale=2.0**10, growth_interval=3, hysteresis=hysteresis, growth_factor=2.0, max_loss_scale=2.0**12)
    straight = LossScaler(**cfg)
    expected = run(straight, flags)

    first = LossScaler(**cfg)
    head = run(first, flags[:25])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # a checkpoint round trip, loadable with weights_only
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = LossScaler(**cfg)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == first.state_dict()
    assert head + run(resumed, flags[25:]) == expected
    assert resumed.state_dict() == straight.state_dict()
    assert len(set(expected)) > 2  # the trajectory really moved


def test_load_state_dict_static_keeps_its_scale_dynamic_clamps():
    donor = LossScaler(init_scale=2.0**20)
    run(donor, [1, 0])
    static = LossScaler(loss_scale=64.0)
    static.load_state_dict(donor.state_dict())
    assert static.scale == 64.0 and static.total_overflows == 1 and static.steps == 2
    capped = LossScaler(init_scale=2.0**10, max_loss_scale=2.0**10)
    capped.load_state_dict(donor.state_dict())
    assert capped.scale == 2.0**10
    from_static = LossScaler()
    from_static.load_state_dict(LossScaler(loss_scale=128.0).state_dict())
    assert from_static.scale == 128.0


def test_load_state_dict_rejects_foreign_dicts():
    with pytest.raises(ValueError, match="`state_dict` lacks"):
        LossScaler().load_state_dict({"scale": 4.0})
    bad = LossScaler().state_dict()
    bad["scale"] = -1.0
    with pytest.raises(ValueError, match="scale"):
        LossScaler().load_state_dict(bad)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(loss_scale=0.0), "loss_scale"),
        (dict(loss_scale=-2.0), "loss_scale"),
        (dict(loss_scale="auto"), "loss_scale"),
        (dict(loss_scale=float("inf")), "loss_scale"),
        (dict(init_scale=0.0), "init_scale"),
        (dict(init_scale=-1.0), "init_scale"),
        (dict(init_scale=float("nan")), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(growth_factor=-2.0), "growth_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=1.5), "backoff_factor"),
        (dict(backoff_factor=-0.5), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(growth_interval=2.5), "growth_interval"),
        (dict(growth_interval=True), "growth_interval"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(hysteresis=-1), "hysteresis"),
        (dict(hysteresis=1.5), "hysteresis"),
        (dict(hysteresis="2"), "hysteresis"),
        (dict(min_loss_scale=0.0), "min_loss_scale"),
        (dict(min_loss_scale=-1.0), "min_loss_scale"),
        (dict(max_loss_scale=0.0), "max_loss_scale"),
        (dict(max_loss_scale=float("inf")), "max_loss_scale"),
        (dict(min_loss_scale=8.0, max_loss_scale=4.0), "min_loss_scale"),
        (dict(max_loss_scale=0.5), "min_loss_scale"),  # below the default floor of 1.0
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        LossScaler(**kwargs)
