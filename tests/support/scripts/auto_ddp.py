"""Standalone run for tests/precision/test_auto_ddp.py.

Usage: python -m support.scripts.auto_ddp OUT_DIR
``AmpAutoPrecision(dtype="float16")`` under ``Trainer(strategy="ddp", devices=2)`` (gloo) on GainSum, every rank
the same full batch. Only the last rank has the ``nonfinite_in_a_row`` rule; rank 0 has it off, so it moves only
because the ranks agree on the verdict. Each rank saves its rung, moves, steps and params to OUT_DIR/rank{r}.pt. With ``AUTO_DDP_SNAPSHOT_DIR`` set,
the ladder's snapshots go to files in that folder (``LadderRules(snapshot_dir=...)``).
"""
import os
import sys
import warnings

import lightning as L
import torch

from lightning_amp import AmpAutoPrecision, LadderRules
from support.ladder_nets import GainSum, LitNet

STEPS = 14


def main(out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    rank = int(os.environ.get("LOCAL_RANK", 0))
    rules = LadderRules(nonfinite_in_a_row=3 if rank == 1 else None, max_skip_rate=None, floor_patience=None,
                        snapshot_every=2, decide_every=4, snapshot_dir=os.environ.get("AUTO_DDP_SNAPSHOT_DIR"))
    plugin = AmpAutoPrecision(dtype="float16", ladder_rules=rules)
    model = LitNet(GainSum)  # every rank the same full batch: no distributed sampler below
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], max_epochs=STEPS, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(model)
    ladder = plugin.ladder
    torch.save({"rung": tuple(ladder.rung), "changes": ladder.changes, "moved_at": ladder.moved_at,
                "reason": ladder.reason, "snapshot_step": ladder.snapshot_step, "nbytes": ladder.snapshots.nbytes,
                "params": [p.detach().clone() for p in model.parameters()]},
               os.path.join(out_dir, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
