"""Pieces shared by the three example scripts: command line, precision plugin, Trainer, data stream.

Each example imports this file as a sibling module (``python examples/bert_sentiment.py`` puts
``examples/`` on ``sys.path``), so every example still runs alone as a script.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

#: ``fp32`` is plain Lightning ``precision="32-true"`` (no plugin); ``O0``..``O3`` are lightning-amp levels.
OPT_LEVELS = ("fp32", "O0", "O1", "O2", "O3")
DTYPES = ("auto", "bfloat16", "float16")


@dataclass
class Example:
    """One ready-to-train example: the LightningModule, its endless synthetic data, and samples per step."""

    module: L.LightningModule
    train_dataloader: DataLoader
    batch_size: int


class SyntheticBatches(IterableDataset):
    """Endless stream of whole batches; batch ``i`` depends only on ``(seed, i)``.

    ``make_batch(generator)`` draws one batch from the given ``torch.Generator``. Because every batch is
    re-seeded from its index, runs at different precision levels see exactly the same data.
    """

    def __init__(self, make_batch: Callable[[torch.Generator], object], seed: int = 0) -> None:
        super().__init__()
        self.make_batch = make_batch
        self.seed = int(seed)

    def __iter__(self) -> Iterator[object]:
        index = 0
        generator = torch.Generator()
        while True:
            generator.manual_seed(self.seed * 1_000_003 + index)
            yield self.make_batch(generator)
            index += 1


def batch_loader(make_batch: Callable[[torch.Generator], object], seed: int = 0) -> DataLoader:
    """A DataLoader over :class:`SyntheticBatches` (already batched, generated in the training process)."""
    return DataLoader(SyntheticBatches(make_batch, seed), batch_size=None, num_workers=0)


def precision_plugins(opt_level: str, dtype: str = "auto") -> list:
    """The Trainer ``plugins`` list for an opt level: ``[]`` for ``fp32``, else one lightning-amp plugin.

    >>> precision_plugins("O2", "bfloat16")      # doctest: +SKIP
    [AmpO2Precision(...)]
    """
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"opt_level must be one of {OPT_LEVELS}, got {opt_level!r}")
    if opt_level == "fp32":
        return []
    from lightning_amp import AmpO0Precision, AmpO1Precision, AmpO2Precision, AmpO3Precision

    plugin_class = {"O0": AmpO0Precision, "O1": AmpO1Precision, "O2": AmpO2Precision, "O3": AmpO3Precision}[opt_level]
    return [plugin_class(dtype=dtype)]


def example_parser(description: str, sizes: Sequence[str], default_size: str) -> argparse.ArgumentParser:
    """The command line every example shares (opt level, dtype, steps, size, strategy, devices, seed)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--opt-level", choices=OPT_LEVELS, default="O2",
                        help="fp32 = plain Lightning fp32; O0..O3 = lightning-amp opt levels (default: O2)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="half dtype for O1..O3; auto = bfloat16 on CPU and bf16-capable GPUs, else float16")
    parser.add_argument("--max-steps", type=positive_int, default=100, help="optimizer steps to train (default: 100)")
    parser.add_argument("--size", choices=tuple(sizes), default=default_size, help=f"model size (default: {default_size})")
    parser.add_argument("--batch-size", type=positive_int, default=None, help="samples per step (default: per size)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: per example)")
    parser.add_argument("--strategy", default="auto", help='Lightning strategy, e.g. "ddp" or "tp_fused" (default: auto)')
    parser.add_argument("--devices", default="1", help="devices per node (default: 1)")
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data (default: 0)")
    parser.add_argument("--log-every", type=positive_int, default=10, help="print loss every N steps (default: 10)")
    return parser


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class PrintLoss(L.Callback):
    """Prints the training loss and the logged metrics every ``every`` steps (rank 0 only)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and (step % self.every == 0 or step == trainer.max_steps):
            metrics = " ".join(f"{k}={float(v):.4f}" for k, v in sorted(trainer.callback_metrics.items()))
            print(f"step {step:5d}  {metrics}", flush=True)


def make_trainer(opt_level: str, dtype: str, max_steps: int, strategy: str = "auto", devices: str = "1",
                 accelerator: str = "auto", callbacks: Optional[list] = None) -> L.Trainer:
    """A quiet Trainer (no logger, checkpoints or progress bar) with the lightning-amp plugin for ``opt_level``."""
    return L.Trainer(
        accelerator=accelerator,
        devices=int(devices) if str(devices).isdigit() else devices,
        strategy=strategy,
        plugins=precision_plugins(opt_level, dtype),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks or [],
    )


def main_for(build_example: Callable[..., Example], description: str, sizes: Sequence[str], default_size: str,
             argv: Optional[Sequence[str]] = None) -> float:
    """Parse ``argv``, build the example, train it, print the loss as it falls; returns the last training loss."""
    args = example_parser(description, sizes, default_size).parse_args(argv)
    import lightning_amp  # noqa: F401  (registers the "tp_fused" strategy name)

    example = build_example(size=args.size, seed=args.seed, batch_size=args.batch_size, lr=args.lr)
    trainer = make_trainer(args.opt_level, args.dtype, args.max_steps, args.strategy, args.devices,
                           args.accelerator, callbacks=[PrintLoss(args.log_every)])
    trainer.fit(example.module, train_dataloaders=example.train_dataloader)
    return float(trainer.callback_metrics["train_loss"])
