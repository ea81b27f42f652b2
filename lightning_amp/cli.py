"""The ``lightning-amp`` command.

    lightning-amp bench [--models feedforward,unet,bert] [--levels fp32,bf16-mixed,bf16-true,O1,O2,O3]
                        [--dtype auto] [--accelerator auto|cpu|cuda] [--steps N] [--size tiny|small|base]
                        [--batch-size N] [--optimizer example|fused-adam] [--out DIR] [--quick]
    lightning-amp info

``bench`` trains each example model at each level (lightning-amp's O0-O3 and Lightning's own
precisions) in a fresh process, with the batches drawn on the device before timing, and prints a
table (step time over a window of steps, samples/s, the optimizer that ran, speed-up and peak memory
against fp32 and against Lightning's bf16-mixed, final loss against chance and against fp32); it
writes DIR/bench.json, DIR/bench.png and DIR/bench.md. Defaults depend on the device: tiny models on
CPU, BERT-base at batch 256 (and the others GPU-sized) on CUDA. Bad arguments exit with status 2
and a usage message.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
from typing import Optional, Sequence

from lightning_amp.bench.models import MODELS, SIZES
from lightning_amp.bench.optimizers import OPTIMIZERS
from lightning_amp.bench.runner import DEFAULT_WARMUP
from lightning_amp.bench.worker import ACCELERATORS, DTYPES, LEVELS

MODEL_NAMES = tuple(MODELS)
QUICK = dict(size="tiny", steps=3, warmup=1)


def default_levels(dtype: str) -> list[str]:
    """fp32, Lightning's mixed and pure half precision in the half dtype asked for, and O1-O3."""
    half = "16" if dtype == "float16" else "bf16"
    return ["fp32", f"{half}-mixed", f"{half}-true", "O1", "O2", "O3"]


def _comma_list(allowed: Sequence[str], what: str):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in allowed]
        if not items or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {','.join(allowed)}")
        return list(dict.fromkeys(items))
    return parse


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-amp", description="lightning-amp command line tools")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{bench,info}")

    bench = commands.add_parser("bench", help="time and memory of the example models at each precision level",
                                description=__doc__.split("\n\n")[2])
    bench.add_argument("--models", type=_comma_list(MODEL_NAMES, "model"), default=list(MODEL_NAMES),
                       help=f"comma-separated, from {','.join(MODEL_NAMES)} (default: all)")
    bench.add_argument("--levels", type=_comma_list(LEVELS, "level"), default=None,
                       help=f"comma-separated, from {','.join(LEVELS)} (default: {','.join(default_levels('auto'))}; "
                            "with --dtype float16 the 16-mixed/16-true peers)")
    bench.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="half dtype of O1-O3; auto = bfloat16 on CPU and bf16-capable GPUs, else float16")
    bench.add_argument("--accelerator", choices=ACCELERATORS, default="auto",
                       help="auto = cuda when torch sees a GPU, else cpu (default: auto)")
    bench.add_argument("--steps", type=_int_at_least(1), default=None,
                       help="timed steps per run (default per model, cpu/cuda: " + ", ".join(
                           f"{m.name} {m.cpu_steps}/{m.gpu_steps}" for m in MODELS.values()) + "; --quick: 3)")
    bench.add_argument("--warmup", type=_int_at_least(0), default=None,
                       help="untimed warm-up steps per run (default: "
                            f"{DEFAULT_WARMUP['cpu']} on cpu, {DEFAULT_WARMUP['cuda']} on cuda; --quick: 1)")
    bench.add_argument("--size", choices=SIZES, default=None,
                       help="model size (default: tiny on cpu, base on cuda; --quick: tiny)")
    bench.add_argument("--batch-size", type=_int_at_least(1), default=None,
                       help="samples per step (default: the example's batch for the size on cpu; on cuda "
                            + ", ".join(f"{m.name} {m.gpu_batch}" for m in MODELS.values()) + ")")
    bench.add_argument("--seed", type=int, default=0, help="weights and data seed, the same for every level (default: 0)")
    bench.add_argument("--threads", type=_int_at_least(1), default=None,
                       help="torch CPU threads per run (default: 1 on cpu, robust on a shared machine; "
                            "torch's default on cuda)")
    bench.add_argument("--optimizer", choices=OPTIMIZERS, default="example",
                       help="example = each example's own (torch AdamW/Adam); fused-adam = lightning-amp's FusedAdam "
                            "in its place, same param groups and hyperparameters (default: example)")
    bench.add_argument("--out", default="bench-out", help="output folder for bench.json/png/md (default: bench-out)")
    bench.add_argument("--quick", action="store_true", help="a smoke run: tiny models, 1 warm-up + 3 timed steps")

    commands.add_parser("info", help="versions, compiled backend and bf16 support of this machine")
    return parser


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from rich.console import Console

    from lightning_amp.bench import draw_chart, markdown_table, plan_runs, rich_table, run_matrix, write_json

    size = args.size or (QUICK["size"] if args.quick else None)
    steps = args.steps or (QUICK["steps"] if args.quick else None)
    warmup = args.warmup if args.warmup is not None else (QUICK["warmup"] if args.quick else None)
    try:
        specs = plan_runs(args.models, args.levels or default_levels(args.dtype), dtype=args.dtype, size=size,
                          steps=steps, warmup=warmup, seed=args.seed, accelerator=args.accelerator,
                          threads=args.threads, batch_size=args.batch_size, optimizer=args.optimizer)
    except ValueError as error:  # e.g. --accelerator cuda without a GPU
        parser.error(str(error))
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped or captured: do not squeeze the table into 80 columns
    started = datetime.datetime.now(datetime.timezone.utc)
    records = run_matrix(specs, console=console)
    finished = datetime.datetime.now(datetime.timezone.utc)

    ok = [r for r in records if not r.get("error")]
    device = ok[0]["device_name"] if ok else "unknown device"
    import torch

    title = (f"lightning-amp bench, {started:%Y-%m-%d %H:%M} UTC, {device}, torch {torch.__version__}, "
             f"commit {_commit()}")
    console.print(rich_table(records, title=title))
    os.makedirs(args.out, exist_ok=True)
    write_json(records, os.path.join(args.out, "bench.json"))
    with open(os.path.join(args.out, "bench.md"), "w") as md:
        md.write(f"{title}; {(finished - started).total_seconds():.0f} s in all\n\n"
                 f"command: `lightning-amp {shlex.join(args.argv)}`\n\n")
        md.write(markdown_table(records))
    if ok:
        draw_chart(records, os.path.join(args.out, "bench.png"), title=f"lightning-amp bench ({device})")
    console.print(f"wrote {args.out}/bench.json, bench.md" + (", bench.png" if ok else "")
                  + f" in {(finished - started).total_seconds():.0f} s")
    return 0 if len(ok) == len(records) else 1


def _commit() -> str:
    """The source checkout's short commit (with "+dirty" for local changes), or "unknown"."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _cpu_bf16_flags() -> str:
    """Which bf16 instruction sets the CPU reports (bf16 GEMMs beat fp32 by far only with AMX)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return ", ".join(f"{flag}={'yes' if flag in flags else 'no'}" for flag in ("avx512_bf16", "amx_bf16", "amx_tile"))


def _info() -> int:
    import torch

    import lightning_amp
    from lightning_amp import ops

    print(f"lightning-amp {lightning_amp.__version__}, torch {torch.__version__}")
    if ops.extension_error() is None:
        print(f"compiled extension: loaded from {ops.extension_path()}")
    else:
        print(f"compiled extension: NOT in use: {ops.extension_error()}")
    print(f"cpu backend: {ops.backend('cpu')}; cpu threads: {torch.get_num_threads()}; "
          f"cpu bf16 instructions: {_cpu_bf16_flags()}")
    if torch.cuda.is_available():
        print(f"cuda: {torch.cuda.get_device_name()}, bf16 supported: {torch.cuda.is_bf16_supported()}, "
              f"backend: {ops.backend('cuda')}")
    else:
        print("cuda: not available")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``lightning-amp`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command == "bench":
        return _bench(args, parser)
    return _info()


if __name__ == "__main__":
    sys.exit(main())
