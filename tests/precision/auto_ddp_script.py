"""Standalone run for tests/precision/test_auto_ddp.py (not a test module itself).

Usage: python auto_ddp_script.py OUT_DIR
``AmpAutoPlugin(dtype="float16")`` under ``Trainer(strategy="ddp", devices=2)`` (gloo) on GainSum, every rank
the same full batch. Only the last rank has the ``nonfinite_in_a_row`` rule; rank 0 has it off, so it moves only
because the ranks agree on the verdict. Each rank saves its rung, moves, steps and params to OUT_DIR/rank{r}.pt. With ``AUTO_DDP_SNAPSHOT_DIR`` set,
the ladder's snapshots go to files in that folder (``LadderRules(snapshot_dir=...)``).
"""
import os
import sys
import warnings

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _ladder_nets import GainSum, full_batch  # noqa: E402

from lightning_amp import AmpAutoPlugin, LadderRules  # noqa: E402

STEPS = 14


class LitNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = GainSum()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.net.loss(self.net(x), y)

    def configure_optimizers(self):  # as test_auto.LitNet's
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.97 ** step)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    rank = int(os.environ.get("LOCAL_RANK", 0))
    rules = LadderRules(nonfinite_in_a_row=3 if rank == 1 else None, max_skip_rate=None, floor_patience=None,
                        snapshot_every=2, decide_every=4, snapshot_dir=os.environ.get("AUTO_DDP_SNAPSHOT_DIR"))
    plugin = AmpAutoPlugin(dtype="float16", ladder_rules=rules)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*full_batch()), batch_size=32)
    model = LitNet()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], max_epochs=STEPS, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(model, data)
    ladder = plugin.ladder
    torch.save({"rung": tuple(ladder.rung), "changes": ladder.changes, "moved_at": ladder.moved_at,
                "reason": ladder.reason, "snapshot_step": ladder.snapshot_step, "nbytes": ladder.snapshots.nbytes,
                "params": [p.detach().clone() for p in model.parameters()]},
               os.path.join(out_dir, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
