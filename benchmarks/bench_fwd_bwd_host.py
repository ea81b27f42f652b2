"""Host cost of forward + backward alone (no optimizer, no Lightning) under each way of computing in half.

The model of ``bench_host_cost.py`` (101 ``Linear(32, 32)``, batch 8, bf16, 1 thread), where compute
is negligible, so what is timed is what each precision adds per forward and backward:

* ``bf16-true``: the model cast to bf16 (Lightning's ``bf16-true``);
* ``bf16-mixed``: fp32 params under ``torch.autocast`` (Lightning's ``bf16-mixed``: a cast of every
  weight per forward inside autocast, and of every grad back in backward);
* ``O2``: O2's forward context as shipped (:func:`lightning_amp.amp.forward.forward_context`: autocast,
  O1's cast context, O2's op policy registered and active);
* ``O2 fp32 lists``: the same with ``norm_policy="fp32"`` (no op policy).

Configurations are interleaved round after round; the median CPU time of the thread per
forward+backward is printed with its ratio to ``bf16-true``::

    python benchmarks/bench_fwd_bwd_host.py [--rounds 30] [--reps 10]
"""
from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import sys
import time

import torch
from torch import nn

from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.amp.forward import forward_context
from lightning_amp.amp.levels import resolve_properties
from lightning_amp.amp.module_cast import prepare_o2_module_

LAYERS, WIDTH, BATCH = 101, 32, 8
HALF = torch.bfloat16


def _configs():
    torch.manual_seed(0)
    fp32 = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    half = copy.deepcopy(fp32).to(HALF)
    o2 = prepare_o2_module_(copy.deepcopy(fp32), HALF, keep_batchnorm_fp32=True)
    x = torch.randn(BATCH, WIDTH)

    def true():
        half(x.to(HALF)).float().square().mean().backward()

    def mixed():
        with torch.autocast("cpu", dtype=HALF, cache_enabled=False):
            loss = fp32(x).float().square().mean()
        loss.backward()

    def o2_forward(norm_policy):
        props = resolve_properties("O2", dtype=HALF, norm_policy=norm_policy)

        def run():
            with forward_context(props, "cpu"):
                loss = o2(x).float().square().mean()
            loss.backward()
        return run

    return {"bf16-true": true, "bf16-mixed": mixed, "O2": o2_forward("half"), "O2 fp32 lists": o2_forward("fp32")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--reps", type=int, default=10, help="forward+backward per configuration per round")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configs = _configs()
    policy = o2_policy.hold()  # registered for the whole run, as the Trainer plugin holds it
    times = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, run in configs.items():
            for _ in range(args.reps):
                start = time.thread_time()
                run()
                times[name].append(time.thread_time() - start)
    policy.release()
    med = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print(f"{LAYERS} x Linear({WIDTH},{WIDTH}), batch {BATCH}, bf16, 1 thread, forward+backward, median of "
          f"{args.rounds} x {args.reps}, thread clock, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("".join(f"{name:>22}" for name in med))
    base = med["bf16-true"]
    print("".join(f"{f'{ms:.2f} ms ({ms / base:.2f}x)':>22}" for ms in med.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
