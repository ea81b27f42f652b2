"""The ``lightning-amp`` command.

    lightning-amp bench [--models feedforward,unet,bert] [--levels fp32,O1,O2,O3] [--dtype auto]
                        [--steps N] [--size tiny|small|base] [--out DIR] [--quick]
    lightning-amp info

``bench`` trains each example model at each level in a fresh process, prints a table (median step
time, samples/s, speed-up, peak memory and its ratio, final loss and its difference, all against
fp32) and writes DIR/bench.json, DIR/bench.png and DIR/bench.md. Bad arguments exit with status 2
and a usage message.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Optional, Sequence

from lightning_amp.bench.models import MODELS, SIZES
from lightning_amp.bench.worker import DTYPES, LEVELS

MODEL_NAMES = tuple(MODELS)
QUICK = dict(size="tiny", steps=3, warmup=1)
DEFAULT_SIZE, DEFAULT_WARMUP = "small", 2


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
    bench.add_argument("--levels", type=_comma_list(LEVELS, "level"), default=["fp32", "O1", "O2", "O3"],
                       help=f"comma-separated, from {','.join(LEVELS)} (default: fp32,O1,O2,O3)")
    bench.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="half dtype; auto = bfloat16 on CPU and bf16-capable GPUs, else float16")
    bench.add_argument("--steps", type=_int_at_least(1), default=None,
                       help="timed steps per run (default: per model, " + ", ".join(f"{m.name} {m.default_steps}" for m in MODELS.values()) + "; --quick: 3)")
    bench.add_argument("--warmup", type=_int_at_least(0), default=None,
                       help=f"untimed warm-up steps per run (default: {DEFAULT_WARMUP}; --quick: 1)")
    bench.add_argument("--size", choices=SIZES, default=None,
                       help=f"model size (default: {DEFAULT_SIZE}; --quick: tiny)")
    bench.add_argument("--seed", type=int, default=0, help="weights and data seed, the same for every level (default: 0)")
    bench.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto", help="default: auto")
    bench.add_argument("--threads", type=_int_at_least(1), default=None,
                       help="torch CPU threads per run (default: torch's default, one per core)")
    bench.add_argument("--out", default="bench-out", help="output folder for bench.json/png/md (default: bench-out)")
    bench.add_argument("--quick", action="store_true", help="a smoke run: tiny models, 1 warm-up + 3 timed steps")

    commands.add_parser("info", help="versions, compiled backend and bf16 support of this machine")
    return parser


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lightning_amp.bench import draw_chart, markdown_table, plan_runs, rich_table, run_matrix, write_json

    size = args.size or (QUICK["size"] if args.quick else DEFAULT_SIZE)
    steps = args.steps or (QUICK["steps"] if args.quick else None)
    warmup = args.warmup if args.warmup is not None else (QUICK["warmup"] if args.quick else DEFAULT_WARMUP)
    specs = plan_runs(args.models, args.levels, dtype=args.dtype, size=size, steps=steps, warmup=warmup,
                      seed=args.seed, accelerator=args.accelerator, threads=args.threads)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped or captured: do not squeeze the table into 80 columns
    started = datetime.datetime.now(datetime.timezone.utc)
    records = run_matrix(specs, console=console)
    finished = datetime.datetime.now(datetime.timezone.utc)

    ok = [r for r in records if not r.get("error")]
    device = ok[0]["device_name"] if ok else "unknown device"
    import torch

    title = f"lightning-amp bench, {started:%Y-%m-%d %H:%M} UTC, {device}, torch {torch.__version__}"
    console.print(rich_table(records, title=title))
    os.makedirs(args.out, exist_ok=True)
    write_json(records, os.path.join(args.out, "bench.json"))
    with open(os.path.join(args.out, "bench.md"), "w") as md:
        md.write(f"{title} (size {size}; {(finished - started).total_seconds():.0f} s in all)\n\n")
        md.write(markdown_table(records))
    if ok:
        draw_chart(records, os.path.join(args.out, "bench.png"), title=f"lightning-amp bench ({device})")
    console.print(f"wrote {args.out}/bench.json, bench.md" + (", bench.png" if ok else "")
                  + f" in {(finished - started).total_seconds():.0f} s")
    return 0 if len(ok) == len(records) else 1


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
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    return _info()


if __name__ == "__main__":
    sys.exit(main())
