"""Models that fail on the upper rungs of the float16 ladder, on the CPU, for the ``opt_level="auto"`` tests.

* :class:`GainSum`: an fp32 gain Parameter times a half activation, then an unnormalised sum. O1 promotes the
  product to fp32 (torch's type promotion), O2's op policy casts the Parameter to half, where the sum
  overflows: O2 diverges (every step non-finite) where O1 trains.
* :class:`BigGradNet`: an unnormalised squared-error loss whose gradient (about 1000 per output) times a
  static scale of 128 overflows float16 in the half backward at O1 and O2; a dynamic scale backs off and trains.

Every batch is the same full batch (:func:`full_batch`), so a run rolled back to its start and continued for
``n`` steps equals a run of ``n`` steps on the rung it moved to, bit for bit. :class:`LitNet` trains one of
them under the Trainer, :func:`fit` runs it.
"""
import contextlib

import lightning as L
import torch
from torch import nn

from support.trainer import quiet_lightning


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
