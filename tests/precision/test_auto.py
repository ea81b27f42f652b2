"""``AmpPrecision(opt_level="auto")`` under the Trainer (CPU, float16): the ladder moves, rolls back, logs and resumes."""
import csv

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_amp import AmpAutoPrecision, AmpPrecision, LadderRules
from support.ladder_nets import (RESUME_AT, TWO_MOVES, TWO_MOVES_STEPS, BigGradNet, GainSum, LitNet, assert_same, books,
                                 fit, loss_factor)
from support.trainer import assert_same_weights, quiet_lightning

RULES = LadderRules(nonfinite_in_a_row=3, snapshot_every=2)


@pytest.mark.parametrize("net_cls, working", [(GainSum, ("O1", 128.0)), (BigGradNet, ("O1", "dynamic"))])
def test_auto_equals_the_manual_ladders_working_rung(flag_timing, net_cls, working):
    plugin = AmpAutoPrecision(dtype="float16", ladder_rules=RULES)
    auto, trainer = fit(net_cls, plugin, 24)
    ladder = plugin.ladder
    assert tuple(ladder.rung) == working and plugin.properties.opt_level == "O1"
    assert ladder.snapshot_step == 0 and 3 * ladder.changes <= ladder.moved_at <= 5 * ladder.changes
    manual, manual_trainer = fit(net_cls, AmpPrecision("O1", dtype="float16", loss_scale=working[1]),
                                  24 - ladder.moved_at)
    assert_same_weights(auto, manual)  # rolled back to the start, then the working rung's own run
    last_epoch = [t.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"] for t in (trainer, manual_trainer)]
    assert last_epoch[0] == last_epoch[1] > 0


def test_the_move_warns_with_rule_step_params_and_rungs(flag_timing):
    plugin = AmpPrecision("auto", dtype="float16", ladder_rules=RULES)
    with pytest.warns(UserWarning, match=r"ladder: nonfinite_in_a_row: non-finite grads on 3 steps in a row .* at step "
                                         r"\d; rolled back to step 0 and moved from rung 0 \(O2/128.0\) to rung 1 "
                                         r"\(O1/128.0\); non-finite grads last in: .*gain"):
        fit(GainSum, plugin, 6, quiet=False)


def test_a_run_that_never_diverges_is_plain_o2_bit_for_bit(flag_timing):
    auto_plugin = AmpAutoPrecision(dtype="float16", ladder_rules=RULES)
    auto, _ = fit(lambda: GainSum(gain=1.0), auto_plugin, 8)
    plain, _ = fit(lambda: GainSum(gain=1.0), AmpPrecision("O2", dtype="float16", loss_scale=128.0), 8)
    assert auto_plugin.ladder.changes == 0 and auto_plugin.ladder.snapshots.good.step == 4
    assert_same_weights(auto, plain)


def test_snapshots_on_disk_give_the_in_memory_run_bit_for_bit_and_hold_no_host_memory(tmp_path, flag_timing):
    """SpikesAtO2 with snapshot_every=2: the rollback point is promoted (a rename on disk) before the move."""
    runs = []
    for snapshot_dir in (None, tmp_path / "snaps"):
        rules = LadderRules(spike_factor=10.0, spike_steps=2, spike_history=4, snapshot_every=2,
                            snapshot_dir=snapshot_dir)
        plugin = AmpAutoPrecision(dtype="float16", ladder_rules=rules)
        trainer = L.Trainer(accelerator="cpu", max_epochs=12, plugins=[plugin], logger=CSVLogger(tmp_path, name="run"),
                            log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        model = SpikesAtO2(lambda: GainSum(gain=1.0))
        with quiet_lightning():
            trainer.fit(model)
        runs.append((model, trainer, plugin.ladder))
    (memory, memory_trainer, memory_ladder), (disk, disk_trainer, disk_ladder) = runs
    assert memory_ladder.changes == disk_ladder.changes == 1 and memory_ladder.snapshot_step > 0
    assert (disk_ladder.moved_at, disk_ladder.snapshot_step) == (memory_ladder.moved_at, memory_ladder.snapshot_step)
    assert_same_weights(disk, memory)
    for trainer in (memory_trainer, disk_trainer):
        assert trainer.optimizers[0].state_dict()["state"]
    for a, b in zip(*(t.optimizers[0].state_dict()["state"].values() for t in (disk_trainer, memory_trainer))):
        assert all(torch.equal(a[key], b[key]) for key in a)
    assert memory_ladder.snapshots.nbytes > 0 and disk_ladder.snapshots.nbytes == 0
    files = {p.name: p.stat().st_size for p in (tmp_path / "snaps").iterdir()}
    assert set(files) <= {"ladder-rank0-good.pt", "ladder-rank0-candidate.pt"} and "ladder-rank0-good.pt" in files
    assert memory_ladder.snapshots.nbytes <= sum(files.values()) <= memory_ladder.snapshots.nbytes + 20_000 * len(files)


def test_level_and_rung_changes_are_logged(tmp_path):
    plugin = AmpAutoPrecision(dtype="float16", ladder_rules=RULES)
    fit(GainSum, plugin, 8, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=1)
    rows = [row for row in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if row.get("amp/level")]
    levels = [float(row["amp/level"]) for row in rows]
    changes = [float(row["amp/rung_changes"]) for row in rows]
    assert levels[:3] == [2.0] * 3 and levels[-1] == 1.0 and changes[0] == 0.0 and changes[-1] == 1.0


def test_resume_after_a_move_continues_on_its_rung_and_says_so(tmp_path, flag_timing):
    straight_plugin = AmpAutoPrecision(dtype="float16", ladder_rules=RULES)
    straight, _ = fit(GainSum, straight_plugin, 12)
    first_plugin = AmpAutoPrecision(dtype="float16", ladder_rules=RULES)
    _, trainer = fit(GainSum, first_plugin, 8)
    assert first_plugin.ladder.changes == 1
    path = tmp_path / "after-move.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["AmpAutoPrecision"]["ladder"]
    assert saved["rung"] == 1 and saved["reason"].startswith("nonfinite_in_a_row") and saved["snapshot_step"] == 0
    resumed_plugin = AmpAutoPrecision(dtype="float16", ladder_rules=RULES)
    with pytest.warns(UserWarning, match=r"ladder: resuming on rung 1 \(O1/128.0\), reached at step \d after "
                                         r"nonfinite_in_a_row"):
        resumed, _ = fit(GainSum, resumed_plugin, 12, ckpt_path=path, quiet=False)
    assert resumed_plugin.properties.opt_level == "O1" and resumed_plugin.loss_scale == 128.0
    assert_same_weights(resumed, straight)


@pytest.mark.parametrize("kwargs, match", [
    (dict(opt_level="auto", loss_scale=128.0), r"`loss_scale` is set per rung"),
    (dict(opt_level="O2", ladder=["O2", "O1"]), r"`ladder` and `ladder_rules` are for opt_level=\"auto\""),
    (dict(opt_level="auto", ladder=[]), r"`ladder` must be a non-empty list"),
    (dict(opt_level="auto", dtype="bfloat16", ladder=[("O2", 128.0)]), r"bfloat16 rung takes no loss scale"),
    (dict(opt_level="auto", dtype="float16", ladder=["O2", "O1"], half_buffers=True), r"`ladder\[1\]`.*does not fit"),
])
def test_bad_auto_options_are_value_errors_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AmpPrecision(**kwargs)


def test_bf16_default_ladder():
    plugin = AmpAutoPrecision(dtype="bfloat16")
    assert [tuple(r) for r in plugin.ladder.rungs] == [("O2", None), ("O1", None), ("O0", None)]
    assert plugin.properties.opt_level == "O2" and plugin.loss_scale == 1.0


class SpikesAtO2(LitNet):
    """GainSum(gain=1) trains at every rung; at O2 its loss is multiplied by 100 from step 6 on (finite grads, no
    skipped step): only the loss-spike rule can see it."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        at_o2 = self.trainer.precision_plugin.properties.opt_level == "O2"
        return loss * 100.0 if at_o2 and self.trainer.global_step >= 6 else loss


@pytest.mark.parametrize("log_metrics", [True, False])
def test_a_loss_spike_on_logged_steps_moves_the_run(flag_timing, tmp_path, log_metrics):
    """The spike rule reads the loss on the logging steps whether or not the amp/* metrics are logged."""
    rules = LadderRules(spike_factor=10.0, spike_steps=2, spike_history=4, snapshot_every=4)
    plugin = AmpAutoPrecision(dtype="float16", ladder_rules=rules, log_metrics=log_metrics)
    trainer = L.Trainer(accelerator="cpu", max_epochs=12, plugins=[plugin], logger=CSVLogger(tmp_path, name="spike"),
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with quiet_lightning():
        trainer.fit(SpikesAtO2(lambda: GainSum(gain=1.0)))
    ladder = plugin.ladder
    assert ladder.changes == 1 and tuple(ladder.rung) == ("O1", 128.0) and plugin.skipped_steps == 0
    assert ladder.reason.startswith("spike_factor: logged loss spiked on 2 logged steps in a row")
    # spikes logged at steps 7 and 8; the candidate of step 4 was not promoted at step 8 (a spike was under way
    # then), so the rollback point is still the start
    assert ladder.moved_at == 8 and ladder.snapshot_step == 0
    assert ("amp/level" in trainer.logged_metrics) is log_metrics


def test_dynamic_scaler_keywords_configure_the_dynamic_rung(flag_timing):
    plugin = AmpAutoPrecision(dtype="float16", ladder_rules=RULES, init_scale=2.0**9, growth_interval=4)
    assert plugin.loss_scale == 128.0  # the first rung's static scale
    auto, _ = fit(BigGradNet, plugin, 20)
    assert tuple(plugin.ladder.rung) == ("O1", "dynamic") and plugin.scalers[0].growth_interval == 4
    manual, _ = fit(BigGradNet, AmpPrecision("O1", dtype="float16", init_scale=2.0**9, growth_interval=4),
                     20 - plugin.ladder.moved_at)
    assert_same_weights(auto, manual)


class TwoMoves(LitNet):
    """GainSum with the losses of the run's steps in BLOWUP multiplied by inf (support.ladder_nets.TWO_MOVES); the
    scale each step runs at is recorded by step."""

    def __init__(self):
        super().__init__(GainSum)
        self.scales = {}

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        self.scales[step] = self.trainer.precision_plugin.loss_scale
        return super().training_step(batch, batch_idx) * loss_factor(step)


def _everything(model, trainer):
    plugin = trainer.precision_plugin
    return {"model": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(), "books": books(plugin.amp)}


def test_two_moves_with_a_resume_between_them_end_as_the_straight_run(tmp_path):
    with pytest.warns(UserWarning, match="moved from rung 1"):
        straight, straight_trainer = fit(TwoMoves(), AmpAutoPrecision(**TWO_MOVES), TWO_MOVES_STEPS,
                                            quiet=False)
    ladder = straight_trainer.precision_plugin.ladder
    assert (ladder.changes, ladder.moved_at, ladder.snapshot_step, ladder.steps) == (2, 23, 16, TWO_MOVES_STEPS)
    # the candidate of step 20, taken on the failing rung, dropped at the move: the one of step 24 promoted at 28
    assert (ladder.snapshots.good.step, ladder.snapshots.candidate.step) == (24, 28)
    with pytest.warns(UserWarning, match="moved from rung 0"):
        _, first = fit(TwoMoves(), AmpAutoPrecision(**TWO_MOVES), RESUME_AT, quiet=False)
    first.save_checkpoint(tmp_path / "between.ckpt")
    plugin = AmpAutoPrecision(**TWO_MOVES)
    with pytest.warns(UserWarning, match=r"at step 23; rolled back to step 16 and moved from rung 1"):
        resumed, trainer = fit(TwoMoves(), plugin, TWO_MOVES_STEPS, ckpt_path=tmp_path / "between.ckpt", quiet=False)
    assert resumed.scales == {step: straight.scales[step] for step in range(RESUME_AT, TWO_MOVES_STEPS)}
    assert straight.scales[RESUME_AT] not in (2.0**4, 2.0**16)
    assert_same(_everything(resumed, trainer), _everything(straight, straight_trainer))


def test_a_checkpoint_of_another_ladder_is_refused_at_resume(tmp_path):
    _, trainer = fit(GainSum, AmpAutoPrecision(**TWO_MOVES), 2)
    trainer.save_checkpoint(tmp_path / "ckpt")
    other = AmpAutoPrecision(**{**TWO_MOVES, "ladder": [("O2", 128.0), ("O1", 128.0), "O0"]})
    with pytest.raises(ValueError, match=r"the checkpoint belongs to another ladder: its ladder .* differs"):
        fit(GainSum, other, 4, ckpt_path=tmp_path / "ckpt")
    assert other.ladder.steps == 0 and other.ladder.changes == 0
