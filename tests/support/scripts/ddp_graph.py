"""Standalone run for tests/precision/test_precision_ddp.py.

Usage: python -m support.scripts.ddp_graph OUT_DIR

Under ``DDPStrategy(find_unused_parameters=True)`` and ``DDPStrategy(static_graph=True)`` (2 gloo ranks,
each its own half of the data), trains a model with a branch its forward never uses, under Lightning's
``bf16-mixed`` and under O2 (bf16), 4 steps each, one after the other in the same processes. Each rank
saves OUT_DIR/rank{r}.pt: {(strategy, precision): {"params": [...], "unused_grad": ..., "losses": [...]}}.
"""
import os
import sys
import warnings

import torch
from torch import nn

import lightning as L
from lightning.pytorch.strategies import DDPStrategy

from lightning_amp import AmpO2Precision

STEPS = 4
GRAPHS = {"find_unused_parameters": dict(find_unused_parameters=True), "static_graph": dict(static_graph=True)}


class Branchy(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
        self.unused = nn.Linear(8, 4)  # a head only another task uses
        self.losses = []

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[rank::2], y[rank::2]), batch_size=8)
    results = {}
    for graph, kwargs in GRAPHS.items():
        for precision in ("bf16-mixed", "O2"):
            plugins = [AmpO2Precision(dtype="bfloat16")] if precision == "O2" else []
            model = Branchy()
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(**kwargs), plugins=plugins,
                                precision=None if plugins else precision, max_steps=STEPS, logger=False,
                                enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                                use_distributed_sampler=False)
            trainer.fit(model, data)
            results[(graph, precision)] = {
                "params": [p.detach().clone() for p in model.body.parameters()],
                "dtypes": {p.dtype for p in model.parameters()},
                "unused_grad": model.unused.weight.grad,
                "unused_moved": not torch.equal(model.unused.weight.detach(), Branchy().unused.weight.detach()),
                "losses": model.losses,
            }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
