"""Step time and peak memory of fp32 vs O1/O2/O3 (bf16 by default) on the BERT-small-shaped encoder.

Each level runs in a fresh process (the `lightning-amp bench` machinery), on the same weights
and data; the figures are printed as ratios to the fp32 run of this same invocation:

    python benchmarks/bench_precision.py                      # BERT small, 2 warm-up + 10 timed steps
    python benchmarks/bench_precision.py --size tiny --steps 3
"""
from __future__ import annotations

import argparse
import datetime
import sys

from lightning_amp.bench import compare, plan_runs, run_matrix
from lightning_amp.bench.models import SIZES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--levels", default="fp32,O1,O2,O3", help="comma-separated; fp32 is the reference")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    levels = [level.strip() for level in args.levels.split(",") if level.strip()]
    if "fp32" not in levels:
        parser.error("--levels must include fp32 (the reference)")

    specs = plan_runs(["bert"], levels, dtype=args.dtype, size=args.size, steps=args.steps, warmup=args.warmup,
                      threads=args.threads)
    records = run_matrix(specs)
    print(f"\nBERT {args.size}, {args.dtype}, {args.steps} timed steps, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{next((r['device_name'] for r in records if not r.get('error')), '?')}")
    print(f"{'level':<6}{'step ms':>10}{'time/fp32':>11}{'peak MiB':>10}{'mem/fp32':>10}{'final loss':>12}{'Δ loss':>9}")
    for c in compare(records):
        r = c.record
        if r.get("error"):
            print(f"{r['level']:<6} failed: {r['error']}")
            continue
        time_ratio = 1.0 / c.speedup if c.speedup else float("nan")
        print(f"{r['level']:<6}{r['step_time_ms']:>10.1f}{time_ratio:>11.2f}{r['peak_mem_mb']:>10.0f}"
              f"{c.memory_ratio or float('nan'):>10.2f}{r['final_loss']:>12.4f}{100 * (c.loss_difference or 0):>+8.2f}%")
    return 0 if all(not r.get("error") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
