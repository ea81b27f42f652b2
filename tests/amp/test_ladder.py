"""The precision ladder's framework-free core: rung validation, rules, snapshots, and moves in a plain loop."""
import math
import warnings

import pytest
import torch

from lightning_amp.amp.ladder.ladder import AmpLadder
from lightning_amp.amp.ladder.rules import BF16_LADDER, FP16_LADDER, LadderRules, Rung, RungWatch, check_ladder
from lightning_amp.amp.ladder.snapshot import SnapshotStore
from lightning_amp.amp.runtime import AmpRuntime, named_params
from support.ladder_nets import BigGradNet, GainSum, full_batch

# ---- validation ------------------------------------------------------------------------


def test_default_ladders_follow_the_dtype():
    assert check_ladder(None, torch.float16) == FP16_LADDER == (Rung("O2", 128.0), Rung("O1", 128.0),
                                                                 Rung("O1", "dynamic"))
    assert check_ladder(None, torch.bfloat16) == BF16_LADDER == (Rung("O2"), Rung("O1"), Rung("O0"))
    assert check_ladder([("o2", "128.0"), "O1", ["O1", "dynamic"]], torch.float16) == FP16_LADDER[:1] + (
        Rung("O1"), Rung("O1", "dynamic"))


@pytest.mark.parametrize("ladder, match", [
    ([], r"`ladder` must be a non-empty list.*\"O0\"\|\"O1\"\|\"O2\""),
    ("O2", r"`ladder` must be a non-empty list"),
    ([("O3", 128.0)], r"`ladder\[0\]`.*one of \('O0', 'O1', 'O2'\)"),
    (["O2", "O4"], r"`ladder\[1\]`.*one of \('O0', 'O1', 'O2'\)"),
    ([("O2", -1.0)], r"`ladder\[0\]`.*positive finite number"),
    ([("O2", 128.0, 3)], r"`ladder\[0\]`.*one of"),
])
def test_bad_ladder_is_a_value_error_naming_it(ladder, match):
    with pytest.raises(ValueError, match=match):
        check_ladder(ladder, torch.float16)
    with pytest.raises(ValueError, match=match):
        AmpLadder(ladder)


def test_bf16_rung_with_a_loss_scale_is_refused():
    with pytest.raises(ValueError, match=r"`ladder\[1\]`.*bfloat16 rung takes no loss scale"):
        check_ladder(["O2", ("O1", 128.0)], torch.bfloat16)
    with pytest.raises(ValueError, match=r"bfloat16 rung takes no loss scale"):
        AmpRuntime("auto", dtype="bfloat16", device_type="cpu", ladder=[("O2", "dynamic")])


@pytest.mark.parametrize("option, value", [
    ("nonfinite_in_a_row", 0), ("nonfinite_in_a_row", 2.5), ("max_skip_rate", 0.0), ("max_skip_rate", 1.5),
    ("skip_window", 0), ("floor_patience", 0), ("spike_factor", 1.0), ("spike_factor", math.inf),
    ("spike_steps", 0), ("spike_history", 2), ("snapshot_every", 0), ("decide_every", True),
])
def test_thresholds_out_of_range_are_value_errors_naming_the_option(option, value):
    with pytest.raises(ValueError, match=rf"`{option}` must be"):
        LadderRules(**{option: value})


def test_rules_can_be_switched_off_and_must_be_ladder_rules():
    rules = LadderRules(nonfinite_in_a_row=None, max_skip_rate=None, floor_patience=None, spike_factor=None)
    watch = RungWatch(rules)
    for _ in range(200):
        watch.step(True, 1.0, 1.0)
        watch.loss(float("nan"))
    assert watch.verdict() is None
    with pytest.raises(TypeError, match="`ladder_rules` must be a lightning_amp LadderRules"):
        AmpLadder(rules={"nonfinite_in_a_row": 3})


# ---- rules -----------------------------------------------------------------------------


def test_nonfinite_in_a_row_fires_at_k_consecutive_steps_only():
    watch = RungWatch(LadderRules(nonfinite_in_a_row=4, max_skip_rate=None))
    for skipped in (True, True, True, False, True, True, True):
        watch.step(skipped, 128.0, None)
    assert watch.verdict() is None and not watch.calm
    watch.step(True, 128.0, None)
    assert watch.verdict().startswith("nonfinite_in_a_row: non-finite grads on 4 steps in a row")


def test_skip_rate_is_judged_over_a_full_window():
    watch = RungWatch(LadderRules(nonfinite_in_a_row=None, max_skip_rate=0.25, skip_window=8))
    for skipped in [False, True, True, False, False, False, False]:  # 2 of 7: no full window yet
        watch.step(skipped, 128.0, None)
    watch.step(False, 128.0, None)  # 2 of 8 = 25%: not above
    assert watch.verdict() is None
    watch.step(True, 128.0, None)  # the window slides: 3 of the last 8
    assert watch.verdict().startswith("max_skip_rate: 38% of the last 8 steps skipped")


def test_scale_stuck_at_its_floor_fires_after_floor_patience_overflows():
    watch = RungWatch(LadderRules(nonfinite_in_a_row=None, max_skip_rate=None, floor_patience=3))
    for scale in (4.0, 2.0, 1.0, 1.0):  # a dynamic scale backing off to its floor 1.0
        watch.step(True, scale, 1.0)
    assert watch.verdict() is None
    watch.step(True, 1.0, 1.0)
    assert watch.verdict().startswith("floor_patience: 3 overflows in a row with the loss scale at its floor 1.0")
    static = RungWatch(LadderRules(nonfinite_in_a_row=None, max_skip_rate=None, floor_patience=1))
    static.step(True, 1.0, None)  # a static scale has no floor
    assert static.verdict() is None


def test_loss_spike_fires_after_spike_steps_logged_spikes_in_a_row():
    watch = RungWatch(LadderRules(spike_factor=5.0, spike_steps=2, spike_history=4))
    gen = torch.Generator().manual_seed(1)
    for value in (torch.rand(4, generator=gen) + 1.0).tolist():
        watch.loss(value)
    watch.loss(100.0)
    watch.loss(1.5)  # breaks the run of spikes
    watch.loss(100.0)
    assert watch.verdict() is None
    watch.loss(float("nan"))
    assert watch.verdict().startswith("spike_factor: logged loss spiked on 2 logged steps in a row")


# ---- snapshots -------------------------------------------------------------------------


def test_a_candidate_becomes_the_rollback_point_only_when_promoted_and_restores_are_copies():
    model = torch.nn.Linear(3, 2)
    store = SnapshotStore()
    store.take(0, {"model": model}, good=True)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(torch.randn_like(model.weight))
    store.take(10, {"model": model})  # a state that may be diverging: only a candidate
    assert store.restore({"model": model}) == 0 and torch.equal(model.weight, start)
    with torch.no_grad():
        model.weight.mul_(3.0)  # training on after a restore does not touch the snapshot
    store.restore({"model": model})
    assert torch.equal(model.weight, start)
    assert store.nbytes == 2 * sum(t.numel() * 4 for t in model.state_dict().values())
    store.promote()
    assert store.good.step == 10 and store.candidate is None


def test_a_failed_restore_raises():
    store = SnapshotStore()
    with pytest.raises(RuntimeError, match="no rollback point"):
        store.restore({"model": torch.nn.Linear(2, 2)})
    store.take(0, {"model": torch.nn.Linear(3, 2)}, good=True)
    with pytest.raises(RuntimeError, match="restoring 'model' from the rollback point of step 0 failed"):
        store.restore({"model": torch.nn.Linear(4, 2)})


def _trained_model_and_adam(seed=0):
    """A Linear and its Adam with state, from fresh random data."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 5)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _perturb(model, optimizer):
    model(torch.randn(8, 5)).square().mean().backward()
    optimizer.step()  # the weights and Adam's moments move on from the snapshot
    optimizer.zero_grad()


def _flat_state(model, optimizer):
    state = optimizer.state_dict()["state"]
    return [t.clone() for t in model.state_dict().values()] + [t.clone() for s in state.values() for t in s.values()]


def test_a_snapshot_on_disk_restores_what_the_in_memory_store_restores_bit_for_bit(tmp_path):
    restored = []
    for directory in (None, tmp_path / "snaps"):
        model, optimizer = _trained_model_and_adam()
        store = SnapshotStore(directory)
        store.take(0, {"model": model, "optimizer": optimizer}, good=True)
        _perturb(model, optimizer)
        store.take(4, {"model": model, "optimizer": optimizer})
        store.promote()
        _perturb(model, optimizer)
        assert store.restore({"model": model, "optimizer": optimizer}) == 4
        restored.append(_flat_state(model, optimizer))
        _perturb(model, optimizer)  # training on after a restore does not touch the snapshot
        store.restore({"model": model, "optimizer": optimizer})
        assert all(torch.equal(a, b) for a, b in zip(_flat_state(model, optimizer), restored[-1]))
    in_memory, on_disk = restored
    assert len(in_memory) == len(on_disk) == 8 and all(torch.equal(a, b) for a, b in zip(in_memory, on_disk))
    assert store.nbytes == 0 and sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["ladder-rank0-good.pt"]
    saved = torch.load(tmp_path / "snaps" / "ladder-rank0-good.pt", weights_only=False)
    assert saved["step"] == 4 and set(saved["states"]) == {"model", "optimizer"}


def test_a_candidate_never_writes_over_the_good_file_and_promotion_renames_it(tmp_path):
    model, optimizer = _trained_model_and_adam()
    store = SnapshotStore(tmp_path)
    store.take(0, {"model": model}, good=True)
    good_file = tmp_path / "ladder-rank0-good.pt"
    good_bytes = good_file.read_bytes()
    _perturb(model, optimizer)
    store.take(3, {"model": model})
    assert good_file.read_bytes() == good_bytes and (tmp_path / "ladder-rank0-candidate.pt").exists()
    store.drop_candidate()
    assert not (tmp_path / "ladder-rank0-candidate.pt").exists() and good_file.read_bytes() == good_bytes
    store.take(6, {"model": model})
    store.promote()
    assert store.good.step == 6 and not (tmp_path / "ladder-rank0-candidate.pt").exists()
    assert torch.load(good_file, weights_only=False)["step"] == 6


def test_a_write_killed_midway_leaves_the_good_file_and_its_temp_file_is_ignored_then_removed(tmp_path, monkeypatch):
    model, optimizer = _trained_model_and_adam()
    start = model.weight.detach().clone()
    store = SnapshotStore(tmp_path)
    store.take(0, {"model": model}, good=True)
    good_bytes = (tmp_path / "ladder-rank0-good.pt").read_bytes()
    (tmp_path / "ladder-rank0-good.pt.tmp").write_bytes(b"PK\x03\x04 half a zip")  # an earlier process's killed write

    def dies_midway(error):
        def save(obj, file, *args, **kwargs):
            file.write(b"PK\x03\x04 the first bytes")
            raise error
        return save

    _perturb(model, optimizer)
    monkeypatch.setattr(torch, "save", dies_midway(OSError("No space left on device")))  # a write that fails
    with pytest.raises(RuntimeError, match=r"writing the snapshot of step 5 to .*ladder-rank0-candidate.pt.* failed "
                                           r"\(OSError: No space left"):
        store.take(5, {"model": model})
    assert not (tmp_path / "ladder-rank0-candidate.pt.tmp").exists()  # it removes its own temp file

    monkeypatch.setattr(torch, "save", dies_midway(KeyboardInterrupt()))  # no cleanup runs, as under a kill
    with pytest.raises(KeyboardInterrupt):
        store.take(5, {"model": model})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ladder-rank0-candidate.pt.tmp", "ladder-rank0-good.pt", "ladder-rank0-good.pt.tmp"]
    assert (tmp_path / "ladder-rank0-good.pt").read_bytes() == good_bytes  # nothing half-written under a real name
    assert store.restore({"model": model}) == 0 and torch.equal(model.weight, start)
    monkeypatch.undo()
    SnapshotStore(tmp_path).take(0, {"model": model}, good=True)  # the next run's first snapshot clears the rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ladder-rank0-good.pt"]


def test_snapshot_dir_is_checked_at_construction(tmp_path):
    with pytest.raises(TypeError, match=r"`snapshot_dir` must be a folder path \(str or os.PathLike\).*got int"):
        LadderRules(snapshot_dir=3)
    with pytest.raises(ValueError, match=r"`snapshot_dir` must be a folder path or None; got an empty string"):
        LadderRules(snapshot_dir="")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=rf"`snapshot_dir` = '{blocker}/snaps' cannot hold the ladder's snapshots"):
        AmpLadder(rules=LadderRules(snapshot_dir=blocker / "snaps"))
    ladder = AmpLadder(rules=LadderRules(snapshot_dir=tmp_path / "new" / "snaps"))
    assert ladder.snapshots.directory == str(tmp_path / "new" / "snaps") and (tmp_path / "new" / "snaps").is_dir()


@pytest.mark.parametrize("damage", ["corrupt", "missing", "another step"])
def test_a_snapshot_file_that_cannot_be_read_makes_restore_raise(tmp_path, damage):
    model = torch.nn.Linear(3, 2)
    store = SnapshotStore(tmp_path)
    store.take(2, {"model": model}, good=True)
    good_file = tmp_path / "ladder-rank0-good.pt"
    if damage == "corrupt":
        good_file.write_bytes(good_file.read_bytes()[:100])
    elif damage == "missing":
        good_file.unlink()
    else:
        torch.save({"step": 7, "states": {"model": model.state_dict()}}, good_file)
    with pytest.raises(RuntimeError, match=r"reading the rollback point of step 2 from .*ladder-rank0-good.pt.* failed"):
        store.restore({"model": model})


# ---- moves in a plain PyTorch loop -----------------------------------------------------


def _train(net_cls, steps, opt_level="O2", loss_scale=None, ladder=None, rules=None):
    """A plain loop of ``steps`` steps: at ``opt_level``/``loss_scale``, or with ``rules`` under "auto" (``ladder``:
    its rungs, None for the default)."""
    torch.manual_seed(0)
    model, (x, y) = net_cls(), full_batch()
    if rules is not None:
        amp = AmpRuntime("auto", dtype="float16", device_type="cpu", ladder=ladder, ladder_rules=rules)
    else:
        amp = AmpRuntime(opt_level, dtype="float16", loss_scale=loss_scale, device_type="cpu")
    amp.prepare(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.connect([optimizer], named_params(model))
    for _ in range(steps):
        with amp.forward_context():
            out = model(x)
        with amp.backward_context():
            amp.scale_loss(model.loss(out, y)).backward()
        amp.step(optimizer)
        optimizer.zero_grad()
    amp.release()  # O2's op policy unregistered: nothing held after the run
    return model, amp


@pytest.mark.parametrize("net_cls, working, moves", [(GainSum, FP16_LADDER[1], 1), (BigGradNet, FP16_LADDER[2], 2)])
def test_auto_reaches_the_working_rung_of_the_manual_ladder(flag_timing, net_cls, working, moves):
    with pytest.warns(UserWarning) as record:
        auto, amp = _train(net_cls, 24, rules=LadderRules(nonfinite_in_a_row=3, snapshot_every=2))
    ladder = amp.ladder
    moved = [str(w.message) for w in record if "moved from rung" in str(w.message)]
    assert len(moved) == moves and ladder.changes == moves and ladder.rung == working
    assert "nonfinite_in_a_row" in moved[-1] and f"to rung {moves} ({working})" in moved[-1]
    assert "non-finite grads last in: fc.weight" in moved[-1] or "gain" in moved[-1]
    assert (amp.properties.opt_level, amp.request["loss_scale"]) == tuple(working) and not amp.holds_policy
    assert ladder.snapshot_step == 0  # every step before the move overflowed: the start stays the rollback point
    expected, _ = _train(net_cls, 24 - ladder.moved_at, *working)  # the rung's own run, as many steps
    for (name, got), want in zip(auto.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(got, want), name
    late = 2 if flag_timing == "late" else 0
    assert ladder.moved_at == moves * 3 + moves * late


def test_a_run_that_never_diverges_is_the_plain_first_rung_bit_for_bit(flag_timing):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto, amp = _train(lambda: GainSum(gain=1.0), 12, rules=LadderRules(snapshot_every=3))
    ladder = amp.ladder
    plain, _ = _train(lambda: GainSum(gain=1.0), 12, "O2", 128.0)
    assert ladder.changes == 0 and amp.properties.opt_level == "O2"
    for (name, got), want in zip(auto.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(got, want), name
    assert ladder.snapshots.good.step == 6 and ladder.snapshots.candidate.step == 9


def test_on_the_last_rung_a_rule_warns_once_and_the_gate_keeps_one_watcher():
    with pytest.warns(UserWarning) as record:  # every step overflows at O1/128: the rule fires 6 times
        _, amp = _train(BigGradNet, 12, ladder=[("O1", 128.0)], rules=LadderRules(nonfinite_in_a_row=2))
    ladder = amp.ladder
    last = [str(w.message) for w in record if "the run is on the last rung" in str(w.message)]
    assert len(last) == 1 and ladder.changes == 0 and ladder.rung == ("O1", 128.0)
    assert len(amp.engine.states[0].gate.watchers) == 1


def test_change_level_keeps_the_parameters_and_refuses_o3():
    model = GainSum(gain=1.0)
    params = list(model.parameters())
    amp = AmpRuntime("O2", dtype="float16", loss_scale=128.0, device_type="cpu")
    amp.prepare(model)
    assert amp.holds_policy
    with pytest.raises(ValueError, match=r"O2 -> O3 would change the Parameters' dtype; allowed levels: O0, O1, O2"):
        amp.change_level("O3", None)
    assert amp.properties.opt_level == "O2" and amp.request["opt_level"] == "O2" and amp.holds_policy
    amp.change_level("O1", "dynamic")
    assert amp.properties.opt_level == "O1" and not amp.holds_policy and amp.loss_scale == 2.0**16
    assert all(a is b and a.dtype == torch.float32 for a, b in zip(model.parameters(), params))
    amp.release()


def test_the_rules_books_round_trip_mid_streak():
    """What a RungWatch saw (a streak under way, the window, the losses, a fired rule) comes back from its state:
    a run resumed mid-streak fires on the step the straight run fires."""
    rules = LadderRules(nonfinite_in_a_row=3, floor_patience=4, skip_window=4, max_skip_rate=0.9, spike_history=3)
    watch = RungWatch(rules)
    for state, skipped in enumerate([False, True, False, True, True]):
        watch.step(skipped, 1.0 if skipped else 2.0, 1.0, state)
    for state, loss in enumerate([1.0, 1.1, 0.9, 50.0]):
        watch.loss(loss, state)
    copy = RungWatch(rules)
    copy.load_state_dict(watch.state_dict())
    assert copy.state_dict() == watch.state_dict() and copy.calm is False and copy.quiet_at(3) is False
    assert watch.verdict() is None and watch.in_a_row == 2  # two non-finite steps in a row so far
    for w in (watch, copy):
        w.step(True, 1.0, 1.0, 5)
    assert copy.verdict() == watch.verdict() is not None and copy.verdict().startswith("nonfinite_in_a_row")
    assert copy.state_dict() == watch.state_dict()


@pytest.mark.parametrize("directory", [False, True], ids=["memory", "files"])
def test_the_rollback_point_and_its_candidate_round_trip(tmp_path, directory):
    model = torch.nn.Linear(3, 2)
    store = SnapshotStore(tmp_path / "a" if directory else None)
    store.take(4, {"model": model}, good=True)
    with torch.no_grad():
        model.weight.add_(1.0)
    store.take(8, {"model": model})
    state = store.state_dict()
    copy = SnapshotStore(tmp_path / "b" if directory else None)
    copy.load_state_dict(state)
    assert (copy.good.step, copy.candidate.step) == (4, 8)
    assert torch.equal(copy.state_dict()["candidate"]["states"]["model"]["weight"], model.weight)
    copy.promote()
    restored = torch.nn.Linear(3, 2)
    assert copy.restore({"model": restored}) == 8 and torch.equal(restored.weight, model.weight)
