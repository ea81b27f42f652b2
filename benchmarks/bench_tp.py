"""CPU, 2 ranks (gloo): step time of tp_fused TP=2 vs torch DDP on the same model, and the share of the
input-gradient all-reduce hidden behind the weight-gradient GEMM by ``async_grad_allreduce``.

Each run uses the same global batch: TP=2 gives both ranks the whole batch (DP=1), DDP gives each
rank half. The tp_fused step is what the strategy runs (apply_plan -> parallel layers with fused
fp32 wgrad into main_grad -> MainGradBuffer -> SGD), driven by a plain loop so the timing holds
only the training step. Usage: ``python benchmarks/bench_tp.py [--width 512 --layers 4 --tokens 1024]``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(width: int, layers: int, heads: int) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def timed_steps(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def run_tp(args, x, async_dgrad: bool):
    from lightning_amp.parallel import MainGradBuffer, apply_plan

    model = build_model(args.width, args.layers, args.heads)
    apply_plan(model, None, gradient_accumulation_fusion=True, async_grad_allreduce=async_dgrad)
    buffer = MainGradBuffer(model.parameters(), dp_group=dist.new_group([dist.get_rank()]), tp_group=None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    backward_times = []

    def step():
        out = model(x)
        loss = out.square().mean()
        t0 = time.perf_counter()
        loss.backward()
        backward_times.append(time.perf_counter() - t0)
        buffer.finish_sync()
        buffer.expose_grads()
        opt.step()
        buffer.zero()

    times = timed_steps(step, args.warmup, args.steps)
    return times, backward_times[args.warmup:]


def run_ddp(args, x):
    model = nn.parallel.DistributedDataParallel(build_model(args.width, args.layers, args.heads))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    local = x.chunk(2, dim=0)[dist.get_rank()]

    def step():
        model(local).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_steps(step, args.warmup, args.steps)


def dgrad_comm_time(args, batch_tokens_shape) -> float:
    """Time of the dgrad all-reduces alone: per layer, q/k/v + linear1 column layers each all-reduce a
    [batch, seq, width] fp32 grad (4 per layer)."""
    t = torch.randn(*batch_tokens_shape)
    for _ in range(3):
        dist.all_reduce(t)
    n = 4 * args.layers
    samples = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def worker(rank, port, args, out_path):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(1)
    seq = args.seq
    x = torch.randn(args.tokens // seq, seq, args.width, generator=g)
    res = {}
    res["ddp_step_s"] = statistics.median(run_ddp(args, x))
    step_async, bwd_async = run_tp(args, x, True)
    step_sync, bwd_sync = run_tp(args, x, False)
    res["tp2_step_s"] = statistics.median(step_async)
    res["tp2_step_sync_dgrad_s"] = statistics.median(step_sync)
    res["tp2_backward_async_s"] = statistics.median(bwd_async)
    res["tp2_backward_sync_s"] = statistics.median(bwd_sync)
    res["dgrad_allreduce_alone_s"] = dgrad_comm_time(args, tuple(x.shape))
    hidden = res["tp2_backward_sync_s"] - res["tp2_backward_async_s"]
    res["hidden_share_of_dgrad_comm"] = hidden / res["dgrad_allreduce_alone_s"]
    res["hidden_share_of_backward"] = hidden / res["tp2_backward_sync_s"]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="global batch in tokens")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    out_path = args.json or os.path.join("/tmp", f"bench_tp_{os.getpid()}.json")
    mp.spawn(worker, args=(free_port(), args, out_path), nprocs=2)
    with open(out_path) as f:
        res = json.load(f)
    print(f"model: TransformerEncoder width={args.width} heads={args.heads} layers={args.layers}, "
          f"global batch {args.tokens} tokens (seq {args.seq}), fp32, 2 ranks x {args.threads} thread(s), gloo")
    print(f"DDP step                         {res['ddp_step_s'] * 1e3:9.1f} ms")
    print(f"tp_fused TP=2 step (async dgrad) {res['tp2_step_s'] * 1e3:9.1f} ms  ({res['ddp_step_s'] / res['tp2_step_s']:.2f}x DDP speed)")
    print(f"tp_fused TP=2 step (sync dgrad)  {res['tp2_step_sync_dgrad_s'] * 1e3:9.1f} ms")
    print(f"backward async / sync            {res['tp2_backward_async_s'] * 1e3:9.1f} / {res['tp2_backward_sync_s'] * 1e3:.1f} ms")
    print(f"dgrad all-reduces alone          {res['dgrad_allreduce_alone_s'] * 1e3:9.1f} ms")
    print(f"hidden: {100 * res['hidden_share_of_dgrad_comm']:.0f}% of the dgrad all-reduce time, "
          f"{100 * res['hidden_share_of_backward']:.1f}% of backward")


if __name__ == "__main__":
    main()
