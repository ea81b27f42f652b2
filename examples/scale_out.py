"""One tiny language model trained five ways, the commands of docs/scaling-out.md.

    python examples/scale_out.py --layout single                    # one process
    python examples/scale_out.py --layout ddp --devices 2           # data parallel (DDP)
    python examples/scale_out.py --layout tp --devices 2 --tp 2     # strategy="tp_fused" (TP x DP)
    python examples/scale_out.py --layout fsdp --devices 2          # FSDP2 (ModelParallelStrategy)
    python examples/scale_out.py --layout fsdp_tp --devices 2 --tp 2  # FSDP2 x DTensor tensor parallel
    torchrun --nproc_per_node=2 examples/scale_out.py --layout fsdp --devices 2   # same, torchrun starts ranks

Every layout trains on the same global batch (split over the data-parallel ranks), so the losses
agree with the single process up to rounding. CPU with gloo by default; ``--accelerator gpu`` uses
NCCL. Rank 0 prints one JSON line: the layout, level, last loss (mean over the ranks), the median step
time, and what each
rank holds of params, grads and optimizer state (bytes of its local shards; rank 0's, the others
are equal).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp import AmpPrecision, TensorParallelStrategy

VOCAB, SEQ, WIDTH = 64, 16, 64
LEVELS = ("32-true", "bf16-mixed", "O0", "O1", "O2", "O3")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class TinyLM(L.LightningModule):
    """Embedding, ``layers`` MLP blocks, vocabulary head; next-token loss on random tokens."""

    def __init__(self, layers: int = 2, lr: float = 3e-3, global_batch: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every layout
        self.lr, self.global_batch = lr, global_batch
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.step_times: list = []
        self._tic = 0.0

    def configure_model(self) -> None:
        """Under ModelParallelStrategy only: DTensor TP on the MLPs (when the mesh has a TP dim > 1),
        then FSDP2 per block and at the root. Other strategies leave the model as it is. No
        ``mp_policy``: at O2 the plugin gives every group FSDP2's bf16-compute, fp32-reduce policy."""
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if mesh["tensor_parallel"].size() > 1:
            for block in self.blocks:
                parallelize_module(block, mesh["tensor_parallel"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        for block in self.blocks:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self, mesh=mesh["data_parallel"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self(tokens).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def on_train_batch_start(self, batch, batch_idx):
        self._tic = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_times.append(time.perf_counter() - self._tic)
        self.last_loss = outputs["loss"].detach()

    def train_dataloader(self) -> DataLoader:
        """This data-parallel rank's interleaved share of every global batch (no shuffling, so every
        layout sees the same global batches as the single process)."""
        shard = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        replicas, rank = shard["num_replicas"], shard["rank"]
        if self.global_batch % replicas:
            raise ValueError(f"--global-batch {self.global_batch} must divide over {replicas} data-parallel ranks")
        tokens, targets = dataset(self.trainer.max_steps * self.global_batch).tensors
        return DataLoader(TensorDataset(tokens[rank::replicas], targets[rank::replicas]),
                          batch_size=self.global_batch // replicas, drop_last=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def dataset(samples: int) -> TensorDataset:
    """Sequences from random starts where each next token is ``(5 * token + 3) % VOCAB`` (learnable);
    the targets are the inputs shifted by one."""
    tokens = torch.randint(0, VOCAB, (samples, 1), generator=torch.Generator().manual_seed(1))
    for _ in range(SEQ):
        tokens = torch.cat([tokens, (5 * tokens[:, -1:] + 3) % VOCAB], dim=1)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def strategy_for(layout: str, devices: int, num_nodes: int, tp: int, accelerator: str):
    world = devices * num_nodes
    if layout == "single":
        return "auto"
    if layout == "ddp":
        return "ddp"
    if layout == "tp":
        return TensorParallelStrategy(tensor_parallel_size=tp)
    if layout in ("fsdp", "fsdp_tp"):
        tp = tp if layout == "fsdp_tp" else 1
        backend = "nccl" if accelerator == "gpu" else "gloo"
        return ModelParallelStrategy(data_parallel_size=world // tp, tensor_parallel_size=tp,
                                     process_group_backend=backend)
    raise ValueError(f"--layout must be one of single, ddp, tp, fsdp, fsdp_tp; got {layout!r}")


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="single", choices=("single", "ddp", "tp", "fsdp", "fsdp_tp"))
    parser.add_argument("--level", default="O1", choices=LEVELS)
    parser.add_argument("--devices", type=int, default=1, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (tp, fsdp_tp)")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)

    if args.layout != "single" and args.devices * args.num_nodes < 2:
        parser.error(f"--layout {args.layout} needs --devices x --num-nodes >= 2")
    if args.accelerator == "cpu":
        torch.set_num_threads(1)  # several ranks share the cores
    plugins, precision = [], None
    if args.level.startswith("O"):
        plugins = [AmpPrecision(opt_level=args.level, dtype="bfloat16")]
    else:
        precision = args.level
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
        strategy=strategy_for(args.layout, args.devices, args.num_nodes, args.tp, args.accelerator),
        precision=precision, plugins=plugins, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )
    model = TinyLM(args.layers, global_batch=args.global_batch)
    trainer.fit(model)
    optimizer = trainer.optimizers[0]
    state = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    params = list(model.parameters())
    loss = trainer.strategy.reduce(model.last_loss.float(), reduce_op="mean")  # over the ranks' batch shares
    grads = [p.grad if p.grad is not None else getattr(p, "main_grad", None) for p in params]  # tp_fused: main_grad
    report = {
        "layout": args.layout, "level": args.level, "world_size": trainer.world_size, "steps": args.steps,
        "last_loss": round(float(loss), 5),
        "median_step_s": round(statistics.median(model.step_times[2:] or model.step_times), 4),
        "bytes_per_rank": {
            "params": _local_bytes(params),
            "grads": _local_bytes(g for g in grads if g is not None),
            "optimizer_state": _local_bytes(state),
        },
    }
    if trainer.is_global_zero:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
