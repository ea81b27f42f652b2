"""``opt_level="auto"`` under the Trainer keeps its books across a move: the skipped-step count never goes down
(the plugin's, the logged one, the checkpoint's), and a rollback takes the LR scheduler back with the weights even
when it advanced between the rollback point and the move."""
import csv

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from support.ladder_nets import BigGradNet, GainSum, LitNet, fit
from lightning_amp import AmpAutoPrecision, LadderRules

RULES = LadderRules(nonfinite_in_a_row=3, snapshot_every=2, max_skip_rate=None, floor_patience=None)


class _Counts(L.Callback):
    """The plugin's skipped-step count and the ladder's moves after every step."""

    def __init__(self):
        self.skipped, self.changes = [], []

    def on_train_batch_end(self, trainer, *args):
        plugin = trainer.precision_plugin
        self.skipped.append(plugin.skipped_steps)
        self.changes.append(plugin.ladder.changes)


def test_skipped_steps_never_go_down_across_moves_the_log_and_a_resume(tmp_path, flag_timing):
    plugin, counts = AmpAutoPrecision(dtype="float16", ladder_rules=RULES), _Counts()
    _, trainer = fit(BigGradNet, plugin, 14, callbacks=[counts], logger=CSVLogger(tmp_path, name="run"),
                     log_every_n_steps=1)
    assert counts.changes[-1] == 2 and tuple(plugin.ladder.rung) == ("O1", "dynamic")  # two moves: O2 -> O1 -> O1/dyn
    assert counts.skipped == sorted(counts.skipped) and counts.skipped[-1] >= 6, counts.skipped
    moved = counts.changes.index(1)
    assert counts.skipped[moved] >= 3  # the steps skipped on the first rung still count after its move
    logged = [float(row["amp/skipped_steps"]) for row in csv.DictReader(open(next(tmp_path.rglob("metrics.csv"))))
              if row.get("amp/skipped_steps")]
    assert len(logged) >= 10 and logged == sorted(logged) and counts.skipped[-1] - 1 <= logged[-1] <= counts.skipped[-1]

    path = tmp_path / "after-moves.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["AmpAutoPrecision"]["skipped_steps"] == plugin.skipped_steps
    resumed, resumed_counts = AmpAutoPrecision(dtype="float16", ladder_rules=RULES), _Counts()
    with pytest.warns(UserWarning, match="ladder: resuming on rung 2"):
        fit(BigGradNet, resumed, 16, ckpt_path=path, quiet=False, callbacks=[resumed_counts])
    assert resumed_counts.skipped[0] >= plugin.skipped_steps and resumed_counts.skipped == sorted(resumed_counts.skipped)


POISON_FROM = 5  # optimizer steps before the gain is boosted: O2 overflows from then on, O1 does not


class BoostedGainSum(GainSum):
    """GainSum whose gain is multiplied by ``boost`` inside its forward."""

    boost = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x)) * self.gain * self.boost  # O2: a half product, then half again
        return self.head(h.sum(-1, keepdim=True) * 1e-5)


class PoisonedLater(LitNet):
    """GainSum with a gain of 1 trains at O2 until step POISON_FROM, from which its gain is boosted 30000-fold: its
    half product overflows at O2 (every step skipped, so the ladder moves), not at O1 (the product is promoted to
    fp32). Its first layer is frozen, so the activations the boost multiplies stay the seed's (up to 3)."""

    def __init__(self):
        super().__init__(lambda: BoostedGainSum(gain=1.0))
        self.net.fc.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        self.net.boost = 30000.0 if self.trainer.global_step >= POISON_FROM else 1.0
        return super().training_step(batch, batch_idx)


class _States(L.Callback):
    """Before each step: the weights, Adam's first moment, the scheduler's count and lrs, keyed by the ladder's steps
    (on the first rung); after the move, the state the run went on from."""

    def __init__(self):
        self.before_move, self.after_move = {}, None

    def on_train_batch_start(self, trainer, module, *args):
        ladder, scheduler = trainer.precision_plugin.ladder, trainer.lr_scheduler_configs[0].scheduler
        optimizer = trainer.optimizers[0]
        state = ([p.detach().clone() for p in module.parameters()],
                 [optimizer.state[p]["exp_avg"].clone() for p in module.parameters() if p in optimizer.state],
                 scheduler.last_epoch, scheduler.get_last_lr()[0], optimizer.param_groups[0]["lr"])
        if ladder.changes == 0:
            self.before_move[ladder.steps] = state
        elif self.after_move is None:
            self.after_move = state


def test_a_move_rolls_the_scheduler_back_with_the_weights_after_it_advanced(flag_timing):
    rules = LadderRules(nonfinite_in_a_row=2, snapshot_every=2, max_skip_rate=None, floor_patience=None,
                        spike_factor=None)
    plugin, states = AmpAutoPrecision(dtype="float16", ladder_rules=rules), _States()
    fit(PoisonedLater(), plugin, 9, callbacks=[states])  # ends a step after the move
    ladder = plugin.ladder
    assert ladder.changes == 1 and tuple(ladder.rung) == ("O1", 128.0)
    point = ladder.snapshot_step  # steps before POISON_FROM are never skipped: the scheduler advanced at each
    assert 1 <= point < POISON_FROM and max(state[2] for state in states.before_move.values()) > point
    weights, moments, last_epoch, last_lr, lr = states.after_move
    assert all(torch.equal(a, b) for a, b in zip(weights, states.before_move[point][0]))
    assert len(moments) == len(states.before_move[point][1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(moments, states.before_move[point][1]))
    # LitNet's LambdaLR: lr 1e-2 x 0.97 per step (with a device behind the host the count lands late: compared
    # with the schedule, not with what was seen before the step)
    assert last_epoch == point and last_lr == lr == pytest.approx(1e-2 * 0.97 ** point, rel=1e-12)
