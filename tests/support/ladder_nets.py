"""Models that fail on the upper rungs of the float16 ladder, on the CPU, for the ``opt_level="auto"`` tests.

* :class:`GainSum`: an fp32 gain Parameter times a half activation, then an unnormalised sum. O1 promotes the
  product to fp32 (torch's type promotion), O2's op policy casts the Parameter to half, where the sum
  overflows: O2 diverges (every step non-finite) where O1 trains.
* :class:`BigGradNet`: an unnormalised squared-error loss whose gradient (about 1000 per output) times a
  static scale of 128 overflows float16 in the half backward at O1 and O2; a dynamic scale backs off and trains.

Every batch is the same full batch (:func:`full_batch`), so a run rolled back to its start and continued for
``n`` steps equals a run of ``n`` steps on the rung it moved to, bit for bit. :class:`LitNet` trains one of
them under the Trainer, :func:`fit` runs it.

Two moves with a resume between them (:data:`TWO_MOVES`): :class:`GainSum` on ``O2/128 -> O1/dynamic -> O0``
moves at step 3 (O2 diverges); the dynamic scale starts at 2**4 and doubles every 3 clean steps, so at the
checkpoint (step :data:`RESUME_AT`) it is neither its start nor a power the rung would restart at; the losses of
the run's steps in :data:`BLOWUP` (the run's own step numbers: a rollback does not replay data) are multiplied by
inf, so the dynamic rung sees 3 non-finite steps in a row and moves at step 23, back to a rollback point taken on
that rung (:func:`loss_factor`). :func:`books` is what a resumed run must equal the straight one in.
"""
import contextlib
import math

import lightning as L
import torch
from torch import nn

from lightning_amp import LadderRules
from support.trainer import quiet_lightning

TWO_MOVES = dict(dtype="float16", ladder=[("O2", 128.0), ("O1", "dynamic"), "O0"], init_scale=2.0**4,
                 growth_interval=3, ladder_rules=LadderRules(nonfinite_in_a_row=3, snapshot_every=4, spike_factor=None,
                                                             max_skip_rate=None, floor_patience=None))
BLOWUP = range(20, 23)
RESUME_AT = 12
TWO_MOVES_STEPS = 30


def loss_factor(step: int) -> float:
    """What the loss of the run's optimizer step ``step`` (counted from 0) is multiplied by."""
    return math.inf if step in BLOWUP else 1.0


def books(amp) -> dict:
    """What a resumed run must end with as the straight one did, of an AmpRuntime (``plugin.amp``): the ladder's
    books (rung, moves, steps, rollback point and candidate with their states, the rules' streaks), the scalers and
    the skipped steps."""
    state = amp.state_dict()
    return {"ladder": state["ladder"], "loss_scalers": state["loss_scalers"], "skipped": state["skipped_steps"],
            "skipped_per_optimizer": state["skipped_per_optimizer"], "opt_level": state["opt_level"]}


def assert_same(got, want, where: str = "") -> None:
    """Nested dicts/lists/tuples of tensors and plain values equal, tensors bit for bit."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(want, key=str), (where, sorted(got, key=str))
        for key in want:
            assert_same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert got == want, (where, got, want)


class GainSum(nn.Module):
    def __init__(self, gain: float = 3000.0) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.gain = nn.Parameter(torch.full((64,), gain))
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x)) * self.gain
        return self.head(h.sum(-1, keepdim=True) * 1e-5)

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out.float(), y)


class BigGradNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 50.0 * (out.float() - 10.0 * y).pow(2).sum()


def full_batch(seed: int = 0):
    """(x, y): 32 fresh random samples, inputs in [1, 2), targets in [0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(32, 16, generator=gen) + 1.0, torch.rand(32, 1, generator=gen)


class LitNet(L.LightningModule):
    """``net_cls()`` (seeded) trained with Adam (lr 1e-2, decayed 0.97 per step), one full batch per epoch."""

    def __init__(self, net_cls):
        super().__init__()
        torch.manual_seed(0)
        self.net = net_cls()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.net.loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.97 ** step)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):  # every step sees the same batch
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*full_batch()), batch_size=32)


def fit(net_cls, plugin, steps, ckpt_path=None, quiet=True, **trainer_kwargs):
    """(model, trainer): a :class:`LitNet` of ``net_cls`` (or ``net_cls`` itself when it is a LitNet already) fitted
    on the CPU under ``plugin`` for ``steps`` epochs of one step (no logger or checkpoints unless ``trainer_kwargs``
    say so), Lightning quiet unless ``quiet`` is off."""
    model = net_cls if isinstance(net_cls, LitNet) else LitNet(net_cls)
    options = dict(logger=False, enable_checkpointing=False)
    options.update(trainer_kwargs)
    trainer = L.Trainer(accelerator="cpu", max_epochs=steps, plugins=[plugin], enable_progress_bar=False,
                        enable_model_summary=False, **options)
    with quiet_lightning() if quiet else contextlib.nullcontext():
        trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer
