"""Host cost of O2's op policy (``lightning_amp.amp.o2.policy``, ``csrc/o2_policy.cpp``) on the CPU.

Prints, as medians over interleaved rounds of the calling thread's CPU time:

* registering and removing the kernels (``hold()`` + ``release()``: what the Fabric plugin pays per
  forward context, the Trainer plugin once per run);
* entering and leaving O2's forward on a thread (``o2_policy.forward()``: once per forward);
* per op, under CPU autocast on tiny tensors (compute negligible): a registered op (``x * w`` of a half
  activation and an fp32 Parameter, ``layer_norm``) with the kernels absent, registered but inactive
  (a ``bf16-mixed`` user in the same process) and active (O2's forward).

    python benchmarks/bench_o2_policy.py [--rounds 20] [--reps 2000]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from lightning_amp.amp.o2 import policy as o2_policy


def _median_us(fn, rounds: int, reps: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(reps):
            fn()
        times.append((time.thread_time() - start) / reps)
    return 1e6 * statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--reps", type=int, default=2000, help="calls per round (registration: reps / 100)")
    args = parser.parse_args(argv)
    if not o2_policy.available():
        print("the compiled extension is not loaded: no op policy to time")
        return 1
    torch.set_num_threads(1)
    x = torch.randn(4, 8).bfloat16()
    w, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))

    def mul():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(10):
                x * w

    def norm():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(10):
                F.layer_norm(x, (8,), w, b)

    def cycle():
        o2_policy.hold().release()

    def enter():
        with o2_policy.forward():
            pass

    rows = {}
    for name, fn in (("mul", mul), ("layer_norm", norm)):
        absent = _median_us(fn, args.rounds, args.reps) / 10
        with o2_policy.held():
            inactive = _median_us(fn, args.rounds, args.reps) / 10
            with o2_policy.forward():
                active = _median_us(fn, args.rounds, args.reps) / 10
        rows[name] = (absent, inactive, active)
    register = _median_us(cycle, args.rounds, max(1, args.reps // 100))
    switch = _median_us(enter, args.rounds, args.reps)

    print(f"O2 op policy host cost, thread clock, medians of {args.rounds} rounds, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"register + remove the kernels ({len(o2_policy.table())} ops, 2 keys): {register:.1f} us")
    print(f"enter + leave O2's forward on a thread: {switch:.2f} us")
    print(f"{'op under CPU autocast (bf16, tiny)':<36}{'not registered':>16}{'inactive':>12}{'O2 active':>12}")
    for name, (absent, inactive, active) in rows.items():
        print(f"{name:<36}{absent:>13.2f} us{inactive:>9.2f} us{active:>9.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
