"""Micro-benchmark: fused weight-gradient accumulation vs the unfused PyTorch expressions.

For Megatron-like shapes (tokens x in -> out), times in one run:
  fused      ops.wgrad_gemm_accum_fp32(x, g, main_grad)        (16-bit operands, fp32 accumulate, beta = 1)
  unfused    main_grad.add_((g.t() @ x).float())               (16-bit GEMM, rounds dW to 16 bits, then adds)
  fp32 addmm main_grad.addmm_(g32.t(), x32)                    (fp32 operands, the fp32 baseline)
  gemm       torch.mm(g.t(), x, out=dw)                        (a plain 16-bit GEMM of the shape, 16-bit out)
and prints the fused/unfused, fused/fp32 and fused/gemm time ratios (lower is better for the fused op;
fused/gemm is what accumulating into fp32 costs over the bare GEMM).
On CPU the fused op serves 16-bit operands through one of three GEMM paths ("onednn": oneDNN's
micro-kernel, "mkl": MKL's 16-bit GEMM, "aten": fp32 upcast of token blocks + sgemm), the one
measured fastest on this machine and cached beside the build ("auto", lightning_amp/ops/_wgrad_choice.py);
each usable path is also timed forced, in its own column, with its own ratio to the unfused expression.
The header names the CPU, its bf16 flags, the libraries' ISA caps when set (ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS, ATEN_CPU_CAPABILITY: they emulate a smaller CPU), the load average, the
commit, and how the auto path was decided (with the machine's measurement).

Run: .venv/bin/python benchmarks/bench_wgrad.py [--repeat N] [--inner K] [--device cpu|cuda] [--dtype bf16|fp16]
     [--json FILE]
Timings are medians of N round-robin repeats after a warm-up round, each repeat K back-to-back
calls (cuda: timed with events, one sync per repeat; cpu: wall clock); ratios are only comparable
within one run. ``--json FILE`` also writes one row per shape (milliseconds and ratios).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch

from bench_optim import add_cpu_options, apply_cpu_options, measure  # this folder is on sys.path as a script
from lightning_amp import ops
from lightning_amp.bench.meta import commit, cpu_bf16_flags
from lightning_amp.bench.worker import device_description

SHAPES = [  # (tokens, in features, out features)
    (4096, 1024, 4096),  # MLP up-projection, hidden 1024
    (4096, 4096, 1024),  # MLP down-projection
    (2048, 1024, 3072),  # fused QKV
]


def _interleaved_medians(fns: dict, repeat: int, device: str, inner: int = 1) -> dict:
    """Median seconds per call of each callable, timed round-robin (A B C A B C ...) after one warm-up
    round, so load from other processes on a shared machine hits every variant alike; each sample
    is ``inner`` back-to-back calls (cuda: between two events, so launch gaps and syncs stay out)."""

    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            times[name].append(measure(fn, device, repeats=1, inner=inner))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _with_policy(ext, policy, fn):
    def run():
        ext._set_wgrad_cpu_gemm_policy(policy)
        try:
            fn()
        finally:
            ext._set_wgrad_cpu_gemm_policy("auto")

    return run



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--inner", type=int, default=None, help="calls per timed sample (default: cpu 1, cuda 20)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--only", default=None, metavar="VARIANT",
                        help="time only this variant (fused, unfused, fp32, gemm or a CPU path: onednn, mkl, aten), "
                             "--repeat x --inner calls per shape, and print its times: for pairing whole processes "
                             "(farm-bench), which then differ only in the variant")
    add_cpu_options(parser)
    args = parser.parse_args()
    apply_cpu_options(args)
    inner = args.inner or (20 if args.device == "cuda" else 1)
    dev = args.device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    name = str(dtype)[6:]
    ext = ops._ext_for(dev)
    cpu_hooks = dev == "cpu" and ext is not None
    chosen = ops.wgrad_cpu_gemm(dtype) if cpu_hooks else "cublas" if ext is not None else "torch"
    usable = [p for p, why in ext._wgrad_cpu_gemm_paths(name) if not why] if cpu_hooks else []
    caps = ", ".join(f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                                      "ATEN_CPU_CAPABILITY") if k in os.environ)
    print(f"bench_wgrad, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit()}, "
          f"{device_description(dev)}" + (f" [{cpu_bf16_flags()}]" if dev == "cpu" else "")
          + f", load average {os.getloadavg()[0]:.2f}")
    print(f"backend={ops.backend(dev)} dtype={args.dtype} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"clock={args.clock} device={dev}" + (f" library ISA caps: {caps}" if caps else ""))
    if cpu_hooks:
        unusable = "; ".join(f"{p}: {why}" for p, why in ext._wgrad_cpu_gemm_paths(name) if why)
        print(f"auto path={chosen}: {ops.wgrad_cpu_gemm_origin(dtype)}" + (f"; not usable: {unusable}" if unusable else ""))
    cols = [f"{p} ms" for p in usable] + [f"{p}/unf" for p in usable]
    header = (f"{'tokens x in -> out':>22} | {'fused ms':>9} | " + " | ".join(f"{c:>9}" for c in cols)
              + (" | " if cols else "") + f"{'unfused ms':>10} | {'fp32 ms':>8} | "
              f"{'fused/unfused':>13} | {'fused/fp32':>10} | {'gemm ms':>8} | {'fused/gemm':>10} | {'fused GFLOP/s':>13}")
    if args.only is None:
        print(header)
        print("-" * len(header))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens, n_in, n_out in SHAPES:
        x = torch.randn(tokens, n_in, generator=gen).to(dtype).to(dev)
        g = torch.randn(tokens, n_out, generator=gen).to(dtype).to(dev)
        x32, g32 = x.float(), g.float()
        main_grad = torch.zeros(n_out, n_in, device=dev)
        dw = torch.empty(n_out, n_in, device=dev, dtype=dtype)
        variants = {
            "fused": lambda: ops.wgrad_gemm_accum_fp32(x, g, main_grad),
            "unfused": lambda: main_grad.add_((g.t() @ x).float()),
            "fp32": lambda: main_grad.addmm_(g32.t(), x32),
            "gemm": lambda: torch.mm(g.t(), x, out=dw),
        }
        for path in usable:
            variants[path] = _with_policy(ext, path, variants["fused"])
        if args.only is not None:
            if args.only not in variants:
                parser.error(f"--only: choose from {', '.join(variants)}, got {args.only!r}")
            variants[args.only]()  # warm-up
            median = measure(variants[args.only], dev, repeats=args.repeat, inner=inner)
            print(f"{f'{tokens} x {n_in} -> {n_out}':>22} | {args.only} {median * 1e3:.2f} ms", flush=True)
            continue
        t = _interleaved_medians(variants, args.repeat, dev, inner)
        fused, unfused, fp32, gemm = t["fused"], t["unfused"], t["fp32"], t["gemm"]
        gflops = 2.0 * tokens * n_in * n_out / fused / 1e9
        per_path = " | ".join([f"{t[p] * 1e3:9.2f}" for p in usable] + [f"{t[p] / unfused:9.2f}" for p in usable])
        print(
            f"{f'{tokens} x {n_in} -> {n_out}':>22} | {fused * 1e3:9.2f} | " + per_path + (" | " if usable else "")
            + f"{unfused * 1e3:10.2f} | {fp32 * 1e3:8.2f} | "
            f"{fused / unfused:13.2f} | {fused / fp32:10.2f} | {gemm * 1e3:8.2f} | {fused / gemm:10.2f} | {gflops:13.1f}",
            flush=True,
        )
        rows.append(dict(tokens=tokens, n_in=n_in, n_out=n_out, dtype=args.dtype, fused_ms=fused * 1e3,
                         unfused_ms=unfused * 1e3, fp32_ms=fp32 * 1e3, gemm_ms=gemm * 1e3,
                         path_ms={p: t[p] * 1e3 for p in usable}, fused_over_gemm=fused / gemm,
                         fused_over_unfused=fused / unfused, fused_gflops=gflops, device=dev,
                         backend=ops.backend(dev), gemm_path=chosen))
        if args.json:
            with open(args.json, "w") as out:
                json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
