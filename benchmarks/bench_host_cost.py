"""Host cost of the precision plugins' step path: a model of many tiny layers, where compute is negligible.

101 ``Linear(32, 32)`` layers (202 params), batch 8, 1 CPU thread; every configuration trains in this
one process, round after round (interleaved, so machine noise hits all alike), and the median step
(``on_train_batch_start`` to ``on_train_batch_end``: forward, backward, optimizer step) is printed
with its ratio to the pure-half baseline of the same dtype. The default clock is the training
thread's CPU time (1 intra-op thread: the host's whole cost of the step), which other processes on
a shared machine do not move; ``--clock wall`` times elapsed time:

    python benchmarks/bench_host_cost.py                       # bf16 (static scale 1.0)
    python benchmarks/bench_host_cost.py --dtype float16       # fp16: O1/O2 use dynamic loss scaling
    python benchmarks/bench_host_cost.py --rounds 5 --steps 200

Columns: ``{h}-true`` (Lightning's pure half), O3, O2, ``{h}-mixed`` (Lightning's autocast), O1.
Ratios: O3 and O2 against ``{h}-true``, O1 against ``{h}-mixed``.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import platform
import statistics
import sys
import time
import warnings

import torch
from torch import nn

import lightning as L
from lightning_amp import AmpPrecision
from lightning_amp.optimizers import FusedAdam

LAYERS, WIDTH, BATCH = 101, 32, 8


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


class _Timer(L.Callback):
    def __init__(self, warmup: int, clock) -> None:
        self.warmup, self.clock, self.times, self._t0 = warmup, clock, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = self.clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.times.append(self.clock() - self._t0)


class _Deep(L.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).float().square().mean()

    def configure_optimizers(self):
        if self.optimizer == "fused":
            return FusedAdam(self.parameters(), lr=1e-4)
        return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)


def _one_run(config: str, optimizer: str, dtype: str, steps: int, warmup: int, clock=time.perf_counter) -> list:
    half = "bf16" if dtype == "bfloat16" else "16"
    if config in ("true", "mixed"):
        precision, plugins = f"{half}-{config}", []
    else:
        precision, plugins = None, [AmpPrecision(config, dtype=dtype)]
    timer = _Timer(warmup, clock)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn((steps + warmup) * BATCH, WIDTH)),
                                       batch_size=BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps + warmup, precision=precision, plugins=plugins,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[timer])
    trainer.fit(_Deep(optimizer), data)
    return timer.times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every run")
    parser.add_argument("--optimizers", default="fused,adamw", help="comma-separated subset of fused,adamw")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                        help="thread: CPU time of the training thread (what the host spends, unmoved by other "
                             "processes on a shared machine); wall: elapsed time")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    half = "bf16" if args.dtype == "bfloat16" else "16"
    configs = ["true", "O3", "O2", "mixed", "O1"]
    optimizers = [o for o in args.optimizers.split(",") if o]
    times = {(o, c): [] for o in optimizers for c in configs}
    for _ in range(args.rounds):
        for o in optimizers:
            for c in configs:
                times[(o, c)] += _one_run(c, o, args.dtype, args.steps, args.warmup, CLOCKS[args.clock])

    names = {"true": f"{half}-true", "mixed": f"{half}-mixed"}
    print(f"\n{LAYERS} x Linear({WIDTH},{WIDTH}), batch {BATCH}, 1 thread, {args.dtype}, median of "
          f"{args.rounds} x {args.steps} steps, {args.clock} clock, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"{'optimizer':<22}" + "".join(f"{names.get(c, c):>18}" for c in configs))
    for o in optimizers:
        med = {c: 1e3 * statistics.median(times[(o, c)]) for c in configs}
        base = {"O3": med["true"], "O2": med["true"], "O1": med["mixed"]}
        cells = [f"{med[c]:.2f} ms" + (f" ({med[c] / base[c]:.2f}x)" if c in base else "") for c in configs]
        label = "FusedAdam" if o == "fused" else "torch AdamW(foreach)"
        print(f"{label:<22}" + "".join(f"{cell:>18}" for cell in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
