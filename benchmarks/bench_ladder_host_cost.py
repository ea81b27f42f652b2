"""Host cost of ``opt_level="auto"`` (the precision ladder) against the plain first rung, on a model where
compute is negligible: the step path of ``bench_host_cost.py`` (101 ``Linear(32, 32)``, batch 8, 1 CPU thread,
float16, torch AdamW stepped by the fused kernels).

Columns: ``AmpPrecision("O2", loss_scale=128.0)`` (the fp16 ladder's first rung), ``AmpAutoPrecision`` with the
default rules (a snapshot every 100 steps), and with a snapshot every step (the cost of one snapshot: the
difference). Runs are interleaved round after round; the median step (training thread's CPU time, or wall
time with ``--clock wall``) is printed with its ratio to the plain rung::

    python benchmarks/bench_ladder_host_cost.py --rounds 3 --steps 150
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import sys
import warnings

import torch

import lightning as L

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_host_cost import BATCH, CLOCKS, LAYERS, WIDTH, _Deep, _Timer  # noqa: E402

from lightning_amp import AmpAutoPrecision, AmpPrecision, LadderRules  # noqa: E402

CONFIGS = {
    "O2/128": lambda: AmpPrecision("O2", dtype="float16", loss_scale=128.0),
    "auto": lambda: AmpAutoPrecision(dtype="float16"),
    "auto, snapshot every step": lambda: AmpAutoPrecision(dtype="float16", ladder_rules=LadderRules(snapshot_every=1)),
}


def _one_run(config: str, steps: int, warmup: int, clock) -> list:
    timer = _Timer(warmup, clock)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn((steps + warmup) * BATCH, WIDTH)),
                                       batch_size=BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps + warmup, plugins=[CONFIGS[config]()],
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[timer])
    trainer.fit(_Deep("adamw"), data)
    return timer.times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every run")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="thread")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    times = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for config in CONFIGS:
            times[config] += _one_run(config, args.steps, args.warmup, CLOCKS[args.clock])
    print(f"\n{LAYERS} x Linear({WIDTH},{WIDTH}), batch {BATCH}, 1 thread, float16, torch AdamW, median of "
          f"{args.rounds} x {args.steps} steps, {args.clock} clock, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    base = statistics.median(times["O2/128"])
    for config in CONFIGS:
        med = statistics.median(times[config])
        print(f"{config:<28}{1e3 * med:8.2f} ms ({med / base:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
