"""A litgpt-style Lightning Fabric training loop on a tiny GPT, with lightning-amp precision.

    python examples/fabric_tiny_gpt.py                                  # O2, one process, CPU
    python examples/fabric_tiny_gpt.py --precision O1 --devices 2       # DDP over 2 processes (gloo)
    python examples/fabric_tiny_gpt.py --precision bf16-mixed           # Fabric's own precision, same loop
    python examples/fabric_tiny_gpt.py --strategy tp_fused --devices 2  # tensor parallel over 2 processes

``--precision`` takes a lightning-amp level (``O0``..``O3``, a :class:`lightning_amp.fabric.FabricAmpPrecision`
plugin) or one of Fabric's precision strings (``32-true``, ``bf16-mixed``, ``bf16-true``, ...). The loop:
``fabric.launch``, ``fabric.setup``, gradient accumulation under ``fabric.no_backward_sync``,
``fabric.backward``, ``fabric.clip_gradients``, ``fabric.save`` / ``fabric.load``. Batch ``i`` of the
global batch is the same whatever the number of processes (each data-parallel rank takes every
``num_replicas``-th row; the ranks of a tensor-parallel group take the same rows), so runs at 1 and 2
processes, DDP or ``tp_fused``, train on the same data.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Dict, Optional, Sequence

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_amp.fabric import FabricAmpPrecision, TensorParallelStrategy


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections (litgpt/Llama layout). The head count is read
    from ``n_head`` and the widths from the layers, so a tensor-parallel plan may split the heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.o_proj(att.reshape(b, t, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = Attention(dim, heads), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm and an untied LM head."""

    def __init__(self, vocab: int = 64, block_size: int = 16, dim: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_fabric(precision: str, devices: int, strategy: str = "", tp: int = 0) -> L.Fabric:
    """Fabric on CPU; a lightning-amp level becomes the plugin, anything else is Fabric's ``precision``.
    ``strategy``: a Fabric strategy name ("tp_fused": lightning-amp's tensor parallel, ``tp`` ranks per
    tensor-parallel group, default all); default "ddp" at several devices."""
    if strategy == "tp_fused" and tp:
        strategy = TensorParallelStrategy(tensor_parallel_size=tp)
    kwargs = dict(accelerator="cpu", devices=devices, strategy=strategy or ("ddp" if devices > 1 else "auto"))
    if precision in ("O0", "O1", "O2", "O3"):
        return L.Fabric(plugins=[FabricAmpPrecision(opt_level=precision)], **kwargs)
    return L.Fabric(precision=precision, **kwargs)


def train(fabric: L.Fabric, args: argparse.Namespace) -> Dict[str, object]:
    """Train ``args.steps`` optimizer steps; returns fp32 weights, last loss and skipped steps (this rank)."""
    fabric.seed_everything(args.seed)
    model = TinyGPT(args.vocab, args.block_size)
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)

    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
    data = torch.randint(args.vocab, (args.steps * args.accumulate * args.batch_size, args.block_size + 1),
                         generator=torch.Generator().manual_seed(args.seed + 1))
    # the data-parallel rank and size (under tp_fused the TP ranks of a group share a DP rank)
    split = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    rank, world = split["rank"], split["num_replicas"]
    loss = torch.zeros(())
    while state["step"] < args.steps:
        step = state["step"]
        for micro in range(args.accumulate):
            start = (step * args.accumulate + micro) * args.batch_size
            rows = data[start + rank : start + args.batch_size : world]
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                logits = model(rows[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), rows[:, 1:].reshape(-1))
                if step == args.inject_inf_at and micro == 0 and fabric.global_rank == fabric.world_size - 1:
                    loss = loss * math.inf  # a gradient overflow on this rank only: the step must be skipped
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=args.clip, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        if args.save_at == state["step"] and args.save:
            fabric.save(args.save, state)
    precision = fabric.strategy.precision
    return {
        # the full model (tp_fused gathers the shards: every rank takes part)
        "weights": {k: v.detach().float().clone() for k, v in fabric.strategy.get_module_state_dict(model.module).items()},
        "local_shapes": {k: tuple(v.shape) for k, v in model.state_dict().items()},
        "loss": float(loss.detach()),
        "skipped": getattr(precision, "skipped_steps", None),
        "nonfinite": list(getattr(precision, "last_nonfinite_params", [])),
    }


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="O2", help="O0..O3 (lightning-amp) or a Fabric precision string")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="", help='a Fabric strategy ("ddp", "tp_fused"); default ddp at --devices > 1')
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8, help="global micro-batch size (all ranks)")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tp", type=int, default=0, help="tp_fused: ranks per tensor-parallel group (default: all)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default="", help="checkpoint path written after --save-at steps")
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", default="", help="checkpoint to resume from")
    parser.add_argument("--inject-inf-at", type=int, default=-1, help="step whose gradients overflow (last rank)")
    parser.add_argument("--out", default="", help="directory for rank<k>.pt results")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(argv)
    fabric = make_fabric(args.precision, args.devices, args.strategy, args.tp)
    fabric.launch()
    result = train(fabric, args)
    if args.out:
        torch.save(result, Path(args.out) / f"rank{fabric.global_rank}.pt")
    fabric.print(f"{args.precision}: {args.steps} steps, last loss {result['loss']:.4f}, skipped {result['skipped']}")
    return result


if __name__ == "__main__":
    main()
