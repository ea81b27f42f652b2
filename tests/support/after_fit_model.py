"""The LightningModule of tests/precision/test_after_fit.py, in its own module so a process that never imports
lightning_amp (or the test) can unpickle it (with ``tests/`` on its ``sys.path``)."""
import lightning as L
import torch
import torchmetrics
from torch import nn


class AfterFitNet(L.LightningModule):
    """Linear -> BatchNorm1d -> ReLU -> Linear, then a fixed projection *buffer* applied by matmul (a
    half buffer would refuse an fp32 input), a gate Linear fed an fp32 upcast made inside forward
    (``fp32_gate``; O2's input casts must reach it; off for O3, which has none, as ``bf16-true``) and a
    torchmetrics metric."""

    def __init__(self, fp32_gate: bool = True):
        super().__init__()
        self.fp32_gate = fp32_gate
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        self.gate = nn.Linear(4, 4)
        self.register_buffer("proj", torch.randn(4, 2))
        self.mean_loss = torchmetrics.MeanMetric()

    def forward(self, x):
        h = self.body(x)
        h = h * torch.sigmoid(self.gate(h.float() if self.fp32_gate else h))
        return h @ self.proj

    def training_step(self, batch, batch_idx):
        loss = self(batch).float().pow(2).mean()
        self.mean_loss.update(loss.detach())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(batch).float().pow(2).mean())

    def predict_step(self, batch, batch_idx):
        return self(batch)

    def _loader(self):
        gen = torch.Generator().manual_seed(1)
        return torch.utils.data.DataLoader(torch.randn(64, 32, generator=gen), batch_size=8)

    train_dataloader = val_dataloader = predict_dataloader = _loader

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
