"""CPU, 2 ranks (gloo): backward of a ``transformers`` Llama under tp_fused's conversion with one input collective
per unit (q, k, v share one all-reduce; gate, up another: 2 per block) against each column layer's own asynchronous
all-reduce (5 per block, each overlapped with its weight-gradient GEMM: the behaviour before issue 47), alternating
step by step in one run on the same ranks and weights. Prints per mode the all-reduces and bytes per block in
backward and the median backward time; the ratio is own / shared.

Usage: ``python benchmarks/bench_tp_input_collectives.py [--width 512 --layers 4 --tokens 512 --steps 10]``.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(rank: int, port: int, args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_amp.parallel import TensorParallelConfig
    from lightning_amp.parallel.convert import convert_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=args.width, num_hidden_layers=args.layers,
                                         num_attention_heads=8, num_key_value_heads=8,
                                         intermediate_size=4 * args.width, max_position_embeddings=args.tokens))
    convert_model(model, None, TensorParallelConfig())
    shared = {layer: layer.shared_input for layer in model.modules() if getattr(layer, "shared_input", None)}
    tokens = torch.randint(0, 256, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    times, counts = {"shared": [], "own": []}, {}
    real = dist.all_reduce

    def counted(tensor, *a, **k):
        calls.append(tensor.numel() * tensor.element_size())
        return real(tensor, *a, **k)

    for step in range(2 * (args.steps + 2)):
        mode = ("shared", "own")[step % 2]
        for layer, region in shared.items():
            layer.shared_input = region if mode == "shared" else None
        loss = model(input_ids=tokens).logits.float().square().mean()
        calls = []
        dist.barrier()
        with mock.patch.object(dist, "all_reduce", counted):
            start = time.perf_counter()
            loss.backward()
            elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        counts[mode] = (len(calls) / args.layers, sum(calls) / args.layers / 2**20)
        if step >= 4:
            times[mode].append(elapsed)
    if rank == 0:
        for mode in ("own", "shared"):
            n, mib = counts[mode]
            print(f"{mode:>6}: {n:.0f} all-reduces per block in backward ({mib:.2f} MiB per block), "
                  f"backward median {statistics.median(times[mode]) * 1e3:.1f} ms over {len(times[mode])} steps")
        print(f"own / shared backward time: {statistics.median(times['own']) / statistics.median(times['shared']):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    mp.spawn(run, args=(free_port(), parser.parse_args()), nprocs=2, join=True)
