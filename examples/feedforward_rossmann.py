"""Feed-forward net on Rossmann-store-sales-shaped tabular data (synthetic), as a LightningModule.

Categorical columns (store, day of week, promo, state holiday, ...) go through embeddings, dense
columns through BatchNorm; an MLP regresses centred log-sales. The synthetic sales follow a fixed
multiplicative rule (store level x weekday x promo x holiday x season x competition) plus noise, so
the loss falls towards the noise floor.

    python examples/feedforward_rossmann.py --opt-level O2 --dtype bfloat16 --max-steps 100
"""
from __future__ import annotations

import math
import os
import sys
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Example, batch_loader, main_for  # noqa: E402

#: (column, cardinality) of the categorical inputs, as in the Kaggle Rossmann data.
CATEGORICAL = (
    ("store", 1115), ("day_of_week", 7), ("promo", 2), ("state_holiday", 4), ("school_holiday", 2),
    ("store_type", 4), ("assortment", 3), ("month", 12), ("day", 31), ("year", 3), ("promo2", 2),
    ("state", 12), ("week", 53),
)
#: standardised continuous inputs (competition distance, weather, trend ...).
DENSE = ("competition_distance", "max_temperature", "mean_humidity", "max_wind", "cloud_cover", "trend")
#: log-sales are centred on this value so the regression target is O(1).
LOG_SALES_CENTRE = 8.5

#: hidden layer widths, samples per step and learning rate by size (small/base: the fastai Rossmann net, [1000, 500]).
SIZES = {
    "tiny": dict(hidden=(64, 32), batch_size=64, lr=3e-3),
    "small": dict(hidden=(1000, 500), batch_size=512, lr=1e-3),
    "base": dict(hidden=(1000, 500), batch_size=2048, lr=1e-3),
}


class SalesWorld:
    """The fixed hidden rule that produces sales; only the sampling of rows depends on the data seed."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2015)
        self.store_level = 0.4 * torch.randn(1115, generator=g)
        self.store_type = torch.randint(0, 4, (1115,), generator=g)
        self.assortment = torch.randint(0, 3, (1115,), generator=g)
        self.state = torch.randint(0, 12, (1115,), generator=g)
        self.store_promo2 = torch.randint(0, 2, (1115,), generator=g)
        self.weekday_effect = torch.tensor([0.15, -0.05, -0.08, -0.06, 0.05, 0.1, -1.2])
        self.month_effect = 0.06 * torch.sin(torch.arange(12) / 12 * 2 * math.pi) + torch.tensor([0.0] * 11 + [0.25])
        self.type_promo_effect = torch.tensor([0.25, 0.15, 0.35, 0.2])
        self.assortment_effect = torch.tensor([0.0, 0.1, -0.05])
        self.dense_weights = torch.tensor([0.12, 0.03, -0.02, -0.01, -0.015, 0.04])

    def sample(self, batch_size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``batch_size`` rows: (categorical int64 [B, 13], dense float32 [B, 6], centred log-sales [B])."""
        store = torch.randint(0, 1115, (batch_size,), generator=g)
        dow = torch.randint(0, 7, (batch_size,), generator=g)
        promo = (torch.rand(batch_size, generator=g) < 0.4).long() * (dow < 5).long()
        state_holiday = torch.where(torch.rand(batch_size, generator=g) < 0.05,
                                    torch.randint(1, 4, (batch_size,), generator=g), torch.zeros(batch_size, dtype=torch.long))
        school_holiday = (torch.rand(batch_size, generator=g) < 0.18).long()
        month = torch.randint(0, 12, (batch_size,), generator=g)
        day = torch.randint(0, 31, (batch_size,), generator=g)
        year = torch.randint(0, 3, (batch_size,), generator=g)
        week = (month * 53 // 12 + day // 7).clamp(max=52)
        dense = torch.randn(batch_size, len(DENSE), generator=g)
        categorical = torch.stack([
            store, dow, promo, state_holiday, school_holiday, self.store_type[store], self.assortment[store],
            month, day, year, self.store_promo2[store], self.state[store], week,
        ], dim=1)
        log_sales = (
            self.store_level[store] + self.weekday_effect[dow] + promo * self.type_promo_effect[self.store_type[store]]
            - 0.6 * (state_holiday > 0).float() + 0.05 * school_holiday + self.month_effect[month]
            + self.assortment_effect[self.assortment[store]] + 0.03 * year + dense @ self.dense_weights
            + 0.05 * torch.randn(batch_size, generator=g)
        )
        return categorical, dense, log_sales


class TabularNet(nn.Module):
    """Embeddings per categorical column + BatchNorm'd dense columns -> [Linear, ReLU, BatchNorm, Dropout] * n -> 1."""

    def __init__(self, hidden: tuple[int, ...], embedding_dropout: float = 0.04, dropout: float = 0.1) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(card, min(50, (card + 1) // 2)) for _, card in CATEGORICAL)
        self.embedding_dropout = nn.Dropout(embedding_dropout)
        self.dense_norm = nn.BatchNorm1d(len(DENSE))
        width = sum(e.embedding_dim for e in self.embeddings) + len(DENSE)
        layers: list[nn.Module] = []
        for out in hidden:
            layers += [nn.Linear(width, out), nn.ReLU(), nn.BatchNorm1d(out), nn.Dropout(dropout)]
            width = out
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 1)

    def forward(self, categorical: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        embedded = torch.cat([emb(categorical[:, i]) for i, emb in enumerate(self.embeddings)], dim=1)
        dense = self.dense_norm(dense).to(embedded.dtype)
        features = torch.cat([self.embedding_dropout(embedded), dense], dim=1)
        return self.head(self.body(features)).squeeze(1)


class RossmannRegressor(L.LightningModule):
    """Predicts centred log-sales with MSE; logs the MAPE of the sales themselves (torchmetrics)."""

    def __init__(self, hidden: tuple[int, ...] = (1000, 500), lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = TabularNet(tuple(hidden))
        self.train_mape = torchmetrics.MeanAbsolutePercentageError()

    def forward(self, categorical: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.net(categorical, dense)

    def training_step(self, batch, batch_idx):
        categorical, dense, target = batch
        prediction = self(categorical, dense).float()
        target = target.float()  # O2/O3 cast the whole batch to half; the loss is computed in fp32
        loss = F.mse_loss(prediction, target)
        self.train_mape(torch.exp(prediction.detach() + LOG_SALES_CENTRE), torch.exp(target + LOG_SALES_CENTRE))
        self.log("train_loss", loss)
        self.log("train_mape", self.train_mape)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-4)


def build_example(size: str = "small", seed: int = 0, batch_size: Optional[int] = None,
                  lr: Optional[float] = None) -> Example:
    """The regressor (weights seeded by ``seed``) and its endless synthetic data stream."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    config = SIZES[size]
    batch_size = batch_size or config["batch_size"]
    torch.manual_seed(seed)
    module = RossmannRegressor(hidden=config["hidden"], lr=lr or config["lr"])
    world = SalesWorld()
    loader = batch_loader(lambda g: world.sample(batch_size, g), seed=seed)
    return Example(module=module, train_dataloader=loader, batch_size=batch_size)


def main(argv=None) -> float:
    return main_for(build_example, __doc__.splitlines()[0], tuple(SIZES), "small", argv)


if __name__ == "__main__":
    main()
