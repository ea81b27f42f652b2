"""Standalone run for tests/precision/test_fsdp2.py: O2 checkpoints under FSDP2.

Usage: python -m support.scripts.fsdp2_resume OUT_DIR

On 2 ranks (``fsdp`` layout of :mod:`support.scripts.fsdp2`, O2 bf16, dynamic scale, rank 1 overflows at step 2),
epochs of one global batch (Lightning restarts a plain DataLoader from its first batch on resume, so
any other epoch length would feed the resumed run different batches):

1. ``straight``: 6 steps in one fit;
2. ``first``: 3 steps, then ``trainer.save_checkpoint`` (Lightning's default under
   ModelParallelStrategy: a distributed checkpoint, each rank writing its own shards);
3. ``resumed``: a fresh model and Trainer, ``fit(ckpt_path=...)`` to step 6.

Rank 0 saves OUT_DIR/resume.pt with the full params, loss scale and skipped steps of each run, the
losses of steps 4-6 of ``straight`` and ``resumed``, and the checkpoint converted to one file by
torch's ``dcp_to_torch_save`` (what Lightning's ``consolidate_checkpoint`` does) under ``consolidated``.
"""
import os
import sys

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from support.scripts import fsdp2

INF_STEP, EPOCH = 2, 1


def run(steps: int, ckpt_path=None):
    trainer, model, plugin = fsdp2.fit("fsdp", "O2", INF_STEP, steps=steps, batches=EPOCH, ckpt_path=ckpt_path)
    losses = fsdp2._global_mean(torch.stack(model.losses)).tolist()
    return trainer, {"params": fsdp2.full_params(model), "scale": plugin.loss_scale,
                     "skipped": plugin.skipped_steps, "losses": losses}


def main(out_dir: str) -> None:
    _, straight = run(6)
    trainer, first = run(3)
    ckpt = os.path.join(out_dir, "step3.ckpt")
    trainer.save_checkpoint(ckpt)
    trainer, resumed = run(6, ckpt_path=ckpt)
    if trainer.is_global_zero:
        dcp_to_torch_save(ckpt, os.path.join(out_dir, "consolidated.pt"))
        consolidated = torch.load(os.path.join(out_dir, "consolidated.pt"), weights_only=False)
        torch.save({"straight": straight, "first": first, "resumed": resumed, "sharded": os.path.isdir(ckpt),
                    "consolidated": consolidated}, os.path.join(out_dir, "resume.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
