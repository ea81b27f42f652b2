"""GEMM throughput per dtype on this machine: the figure that decides whether any half level can be fast.

    python benchmarks/bench_matmul.py                    # 2048^3 and a BERT-small shape, fp32 and bf16
    python benchmarks/bench_matmul.py --device cuda --repeats 50

Times ``a @ b`` for each dtype, interleaved (one call of each dtype per round, so changing load hits
all alike), and prints the median GFLOP/s (2*m*n*k per call) and each dtype's rate relative to fp32
in the same run. CPU: wall clock; CUDA: events around each call, TF32 off for the fp32 row.
"""
from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time

import torch

from lightning_amp.bench.worker import device_description

SHAPES = [(2048, 2048, 2048), (4096, 512, 2048)]  # (m, k, n); the second is BERT-small's MLP on 4096 tokens
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def seconds(fn, device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated from fp32,bf16,fp16 (fp16 GEMMs are very slow on CPUs without AMX-FP16)")
    args = parser.parse_args(argv)
    names = [d for d in args.dtypes.split(",") if d]
    if not names or any(d not in DTYPES for d in names) or names[0] != "fp32":
        parser.error(f"--dtypes: comma-separated from {','.join(DTYPES)}, starting with fp32 (the reference)")
    torch.backends.cuda.matmul.allow_tf32 = False
    where = device_description(args.device)
    print(f"bench_matmul, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {where}, "
          f"torch {torch.__version__}")
    print(f"command: python benchmarks/bench_matmul.py {shlex.join(sys.argv[1:] if argv is None else argv)}\n")
    print("| m x k x n | " + " | ".join(f"{d} GFLOP/s" for d in names) + " | "
          + " | ".join(f"{d}/fp32" for d in names[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(names) - 1))
    for m, k, n in SHAPES:
        operands = {d: (torch.randn(m, k, device=args.device).to(DTYPES[d]),
                        torch.randn(k, n, device=args.device).to(DTYPES[d])) for d in names}
        samples = {d: [] for d in names}
        for round_ in range(args.repeats + 1):
            for d in names:
                a, b = operands[d]
                took = seconds(lambda: a @ b, args.device)
                if round_:  # round 0 warms up
                    samples[d].append(took)
        rate = {d: 2 * m * n * k / statistics.median(samples[d]) / 1e9 for d in names}
        print(f"| {m} x {k} x {n} | " + " | ".join(f"{rate[d]:.0f}" for d in names) + " | "
              + " | ".join(f"{rate[d] / rate['fp32']:.2f}" for d in names[1:]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
