"""Standalone run for tests/precision/test_fsdp2.py.

Usage: python -m support.scripts.fsdp2 OUT_DIR LAYOUT PRECISION[,PRECISION...] [INF_STEP]

LAYOUT: ``fsdp`` (Lightning ``ModelParallelStrategy``, FSDP2 ``fully_shard`` over 2 data-parallel
ranks), ``fsdp_tp`` (``parallelize_module`` over 2 tensor-parallel ranks, then ``fully_shard``) or
``single`` (one process, no strategy: the reference). PRECISION: a Lightning precision string
(``32-true``, ``bf16-mixed``) or ``O0``..``O3`` (our plugins, bf16, dynamic loss scale); several,
comma-separated, train one after the other in the same processes (one launch).
Every layout sees the same global batch of 8 samples per step (fsdp: 4 per rank, fsdp_tp: all 8 on
both ranks). The model ends in a BatchNorm (sharded on its own, so that O2 keeps it fp32); CPU has no
SyncBatchNorm, so every global batch holds each input twice, once in each rank's half (different
targets): the batch statistics of a rank's half are those of the global batch. With INF_STEP, rank 1
alone (rank 0 in ``single``) writes inf into one local gradient shard at that optimizer step: every
rank must skip it.

Rank 0 saves OUT_DIR/PRECISION.pt: the full (gathered) params, per-step losses, skipped steps, loss
scale, the dtypes the head's and the BatchNorm's forward saw, and the bytes this rank holds in params,
grads and optimizer state (local shards).
"""
import os
import sys
import warnings
from functools import partial

import torch
from torch import nn

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_amp import AmpPrecision

STEPS, GLOBAL_BATCH, D = 6, 8, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(L.LightningModule):
    def __init__(self, layout: str, inf_step: int = -1):
        super().__init__()
        torch.manual_seed(0)
        self.layout, self.inf_step = layout, inf_step
        self.blocks = nn.Sequential(Block(), Block())
        self.bn = nn.BatchNorm1d(D)
        self.head = nn.Linear(D, 4)
        self.losses = []
        self.seen = {}  # module name -> dtype of the weight its forward computed with (first step)
        for name in ("bn", "head"):
            getattr(self, name).register_forward_pre_hook(partial(self._see, name))

    def _see(self, name, module, args):
        self.seen.setdefault(name, module.weight.dtype)

    def configure_model(self):
        if self.layout == "single":
            return
        from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        if self.layout == "fsdp_tp":
            for block in self.blocks:
                parallelize_module(block, mesh["tensor_parallel"],
                                   {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(self.bn, mesh=mesh["data_parallel"])  # its own group: O2 keeps it fp32
        for block in self.blocks:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self, mesh=mesh["data_parallel"])

    def forward(self, x):  # FSDP2's root hooks run on forward: call self(x), not the submodules
        return self.head(self.bn(self.blocks(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        # y.float(): O3 casts the batch to bf16, and torch 2.11's mse_loss backward refuses fp32 vs bf16
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(loss.detach().float())
        return loss

    def on_after_backward(self):  # before the plugin's unscale and overflow check
        poison_rank = 0 if self.layout == "single" else 1
        if self.trainer.global_step == self.inf_step and self.global_rank == poison_rank:
            grad = self.head.weight.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("inf")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors):
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def fit(layout: str, precision: str, inf_step: int = -1, steps: int = STEPS, batches: int = STEPS,
        ckpt_path=None, **strategy_kwargs):
    """Train ``steps`` optimizer steps on ``batches`` global batches per epoch (the same ones every
    epoch); ``ckpt_path`` resumes. Returns (trainer, model, plugin or None)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(1)
    x = torch.randn(batches * GLOBAL_BATCH // 2, D).repeat_interleave(2, dim=0)  # each input twice (docstring)
    y = torch.randn(batches * GLOBAL_BATCH, 4)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    batch = GLOBAL_BATCH
    if layout == "fsdp":  # each rank its interleaved half of every global batch
        x, y, batch = x[rank::2], y[rank::2], GLOBAL_BATCH // 2
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=False)
    plugins, kwargs = [], {}
    if precision.startswith("O"):
        plugins = [AmpPrecision(opt_level=precision, dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**8)]
    else:
        kwargs["precision"] = precision
    if layout == "single":
        strategy, devices = "auto", 1
    else:
        dp, tp = (2, 1) if layout == "fsdp" else (1, 2)
        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, **strategy_kwargs)
        devices = 2
    model = Net(layout, inf_step)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, plugins=plugins, max_steps=steps,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, use_distributed_sampler=False, **kwargs)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, model, (plugins[0] if plugins else None)


def full_params(model):
    """Every param gathered whole, fp32 (a collective under FSDP2: call it on every rank)."""
    return {name: _full(p).detach().float().clone() for name, p in model.named_parameters()}


def main(out_dir: str, layout: str, precision: str, inf_step: int = -1) -> None:
    trainer, model, plugin = fit(layout, precision, inf_step)
    optimizer = trainer.optimizers[0]
    state = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    result = {
        "params": full_params(model),
        "losses": _global_mean(torch.stack(model.losses)).tolist(),
        "memory": {"params": _bytes(params), "optimizer_state": _bytes(state), "grads": _bytes(grads),
                   "optimizer_params": _bytes([p for g in optimizer.param_groups for p in g["params"]])},
        "dtypes": {"params": {p.dtype for p in params}, "grads": {g.dtype for g in grads},
                   "forward": dict(model.seen)},
        "skipped": plugin.skipped_steps if plugin else 0,
        "scale": plugin.loss_scale if plugin else 1.0,
    }
    if trainer.is_global_zero:
        torch.save(result, os.path.join(out_dir, f"{precision}.pt"))


def _global_mean(values):
    if torch.distributed.is_initialized():  # fsdp: each rank its half of the batch; fsdp_tp: equal
        torch.distributed.all_reduce(values)
        values /= torch.distributed.get_world_size()
    return values


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


if __name__ == "__main__":
    for level in sys.argv[3].split(","):
        main(sys.argv[1], sys.argv[2], level, int(sys.argv[4]) if len(sys.argv) > 4 else -1)
