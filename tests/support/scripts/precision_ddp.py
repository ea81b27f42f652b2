"""Standalone run for tests/precision/test_precision_ddp.py.

Usage: python -m support.scripts.precision_ddp OUT_DIR DEVICES
Trains a tiny model under AmpO2Precision(float16) with accumulate_grad_batches=2. With 2 devices
(strategy="ddp", gloo) rank 1 alone writes inf into one gradient at optimizer step INF_STEP; with
1 device the same step gets the inf, and the batch holds both ranks' samples. Each rank saves its
params (the optimizer's and the module's, both fp32 under O2), loss scale and skipped-step count to OUT_DIR/rank{r}.pt.
"""
import os
import sys
import warnings

import torch
from torch import nn

import lightning as L
from lightning_amp import AmpO2Precision

INF_STEP = 2
MICRO_BATCH = 4  # per rank


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_after_backward(self):
        last_micro_batch = (self.trainer.fit_loop.epoch_loop.batch_idx + 1) % 2 == 0
        if self.trainer.global_step == INF_STEP and last_micro_batch and self.global_rank == self.trainer.world_size - 1:
            self.net[2].weight.grad[0, 0] = float("inf")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main(out_dir: str, devices: int) -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    y = torch.randn(64, 3)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if devices > 1:  # each rank its own interleaved half of the data; the 1-device run sees both halves per batch
        x, y = x[rank::devices], y[rank::devices]
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=MICRO_BATCH * (3 - devices), shuffle=False
    )
    model = Net()
    plugin = AmpO2Precision(dtype="float16", init_scale=2.0**10, growth_interval=1000)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        plugins=[plugin],
        max_steps=5,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, data)
    masters = [p.detach().clone() for p in trainer.optimizers[0].param_groups[0]["params"]]
    halves = [p.detach().clone() for p in model.parameters()]
    torch.save(
        {"masters": masters, "halves": halves, "scale": plugin.loss_scale, "skipped": plugin.skipped_steps},
        os.path.join(out_dir, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
