"""The ``lightning-amp`` command.

    lightning-amp bench [--models feedforward,unet,bert] [--levels fp32,bf16-mixed,bf16-true,O1,O2,O3]
                        [--dtype auto] [--accelerator auto|cpu|cuda] [--steps N] [--size tiny|small|base]
                        [--batch-size N] [--optimizer example|fused-adam] [--out DIR] [--quick] [--stream]
    lightning-amp info
    lightning-amp build [--force]
    lightning-amp --version

``bench`` trains each example model at each level (lightning-amp's O0-O3 and Lightning's own
precisions) in a fresh process, with the batches drawn on the device before timing, and prints a
table (step time over a window of steps, samples/s, the optimizer that ran, speed-up and peak memory
against fp32 and against Lightning's bf16-mixed, final loss against chance and against fp32); it
writes DIR/bench.json, DIR/bench.png and DIR/bench.md. Defaults depend on the device: tiny models on
CPU, BERT-base at batch 256 (and the others GPU-sized) on CUDA. Names (levels, models, dtype, ...)
are case-insensitive, and ``--dtype`` takes the names the plugins take ("fp16", "bf16", ...). Bad arguments
exit with status 2, the command's usage and the allowed values, no traceback (an unknown flag with the closest
known one). A ``--quick`` run labels its figures indicative: a few steps of tiny models time noise as much as
the levels.

``bench --stream`` times nothing: one Trainer step of each model per level, observed by
:mod:`lightning_amp.bench.stream` (saved-for-backward bytes by dtype, dtype casts and their bytes, each block's
output dtype, the first op that promotes a half stream to fp32); it prints a table per model and writes
DIR/stream.json. For a model of one's own: :func:`lightning_amp.bench.stream.stream_report`.

``build`` compiles the kernels for the running torch into the per-user cache ahead of first use (for a
Docker image or an offline cluster; ``LIGHTNING_AMP_CACHE_DIR`` chooses the folder); exit status 1 when
the build fails. ``info`` says which build of the compiled core loaded and from where, or why none did.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from typing import Optional, Sequence

# What the parser needs imports no torch (tests/bench/test_cli_startup.py); a command that runs imports the rest
from lightning_amp._dtype_names import HALF_DTYPES, half_dtype
from lightning_amp._keywords import closest
from lightning_amp.bench.choices import ACCELERATORS, DEFAULT_WARMUP, LEVELS, OPTIMIZERS
from lightning_amp.bench.meta import commit, cpu_bf16_flags
from lightning_amp.bench.models import MODELS, SIZES

MODEL_NAMES = tuple(MODELS)
QUICK = dict(size="tiny", steps=3, warmup=1)
DTYPE_CHOICES = "auto, " + ", ".join(f"{dtype} ({'/'.join(names[1:])})" for dtype, names in HALF_DTYPES.items())
QUICK_CAVEAT = ("quick run ({steps} timed steps after {warmup} warm-up, {size} models): the figures are indicative "
                "only, a few steps time noise as much as the levels; run without --quick for figures to quote")
EXAMPLES = """examples:
  lightning-amp bench --quick                        # smoke run: tiny models, six levels, 1 warm-up + 3 timed steps
  lightning-amp bench --models bert --levels fp32,bf16-mixed,O2 --steps 50 --out bench-out
  lightning-amp bench --stream --models bert         # what each level saves for backward, casts, keeps half
  lightning-amp info                                 # versions, compiled backend, bf16 instructions of this CPU
  lightning-amp build                                # compile the kernels for this torch now, not at first import
"""


def default_levels(dtype: str) -> list[str]:
    """fp32, Lightning's mixed and pure half precision in the half dtype asked for, and O1-O3."""
    half = "16" if dtype == "float16" else "bf16"
    return ["fp32", f"{half}-mixed", f"{half}-true", "O1", "O2", "O3"]


def _comma_list(allowed: Sequence[str], what: str):
    """A comma-separated list of names from ``allowed``, matched case-insensitively (``o2`` is ``O2``)."""
    canonical = {name.lower(): name for name in allowed}

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item.lower() not in canonical]
        if not items or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {','.join(allowed)}")
        return list(dict.fromkeys(canonical[item.lower()] for item in items))
    return parse


def _dtype(text: str) -> str:
    """A half dtype by any name the plugins take (``fp16`` is ``float16``), or "auto": its torch name."""
    name = half_dtype(text)
    if name is None:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {DTYPE_CHOICES}")
    return name


def _suggestion(unknown: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The hint ``" (did you mean --levels?)"`` for the first unknown ``--flag`` close to one of
    ``parser``'s flags; "" when none is close."""
    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    for arg in unknown:
        near = closest(arg.split("=")[0], flags) if arg.startswith("--") else ""
        if near:
            return f" (did you mean {near}?)"
    return ""


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
    import lightning_amp

    parser = argparse.ArgumentParser(prog="lightning-amp", description="lightning-amp command line tools",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"lightning-amp {lightning_amp.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{bench,info,build}")

    bench = commands.add_parser("bench", help="time and memory of the example models at each precision level",
                                description=__doc__.split("\n\n")[2])
    bench.add_argument("--models", type=_comma_list(MODEL_NAMES, "model"), default=list(MODEL_NAMES),
                       help=f"comma-separated, from {','.join(MODEL_NAMES)} (default: all)")
    bench.add_argument("--levels", type=_comma_list(LEVELS, "level"), default=None,
                       help=f"comma-separated, from {','.join(LEVELS)} (default: {','.join(default_levels('auto'))}; "
                            "with --dtype float16 the 16-mixed/16-true peers)")
    bench.add_argument("--dtype", type=_dtype, default="auto", metavar="DTYPE",
                       help=f"half dtype of O1-O3, as the plugins name it: {DTYPE_CHOICES}; auto = bfloat16 on CPU "
                            "and bf16-capable GPUs, else float16 (default: auto)")
    bench.add_argument("--accelerator", type=str.lower, choices=ACCELERATORS, default="auto",
                       help="auto = cuda when torch sees a GPU, else cpu (default: auto)")
    bench.add_argument("--steps", type=_int_at_least(1), default=None,
                       help="timed steps per run (default per model, cpu/cuda: " + ", ".join(
                           f"{m.name} {m.cpu_steps}/{m.gpu_steps}" for m in MODELS.values()) + "; --quick: 3)")
    bench.add_argument("--warmup", type=_int_at_least(0), default=None,
                       help="untimed warm-up steps per run (default: "
                            f"{DEFAULT_WARMUP['cpu']} on cpu, {DEFAULT_WARMUP['cuda']} on cuda; --quick: 1)")
    bench.add_argument("--size", type=str.lower, choices=SIZES, default=None,
                       help="model size (default: tiny on cpu, base on cuda; --quick: tiny)")
    bench.add_argument("--batch-size", type=_int_at_least(1), default=None,
                       help="samples per step (default: the example's batch for the size on cpu; on cuda "
                            + ", ".join(f"{m.name} {m.gpu_batch}" for m in MODELS.values()) + ")")
    bench.add_argument("--seed", type=int, default=0, help="weights and data seed, the same for every level (default: 0)")
    bench.add_argument("--threads", type=_int_at_least(1), default=None,
                       help="torch CPU threads per run (default: 1 on cpu, robust on a shared machine; "
                            "torch's default on cuda)")
    bench.add_argument("--optimizer", type=str.lower, choices=OPTIMIZERS, default="example",
                       help="example = each example's own (torch AdamW/Adam); fused-adam = lightning-amp's FusedAdam "
                            "in its place, same param groups and hyperparameters (default: example)")
    bench.add_argument("--out", default="bench-out", help="output folder for bench.json/png/md (default: bench-out)")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke run: tiny models, 1 warm-up + 3 timed steps; its figures are labelled indicative")

    bench.add_argument("--stream", action="store_true",
                       help="no timing: saved-for-backward bytes, dtype casts and block output dtypes of one step per "
                            "level, and the first op that promotes a half stream to fp32 (writes DIR/stream.json)")
    bench.set_defaults(command_parser=bench)

    info = commands.add_parser("info", help="versions, compiled backend and bf16 support of this machine")
    info.set_defaults(command_parser=info)
    build = commands.add_parser("build", help="compile the kernels for the running torch into the per-user cache now",
                                description=__doc__.split("\n\n")[3])
    build.add_argument("--force", action="store_true", help="rebuild even when the cache holds a build")
    build.set_defaults(command_parser=build)
    return parser


def _stream(args: argparse.Namespace) -> int:
    """``bench --stream``: :func:`lightning_amp.bench.stream.stream_report` on each example model."""
    import json

    import torch

    from lightning_amp.bench.models import MODELS as BENCH_MODELS, load_example
    from lightning_amp.bench.stream import format_report, stream_report

    accelerator = "cpu" if args.accelerator == "cpu" or not torch.cuda.is_available() else "cuda"
    dtype = torch.float16 if args.dtype == "float16" else torch.bfloat16
    levels = ["32-true" if level == "fp32" else level for level in (args.levels or default_levels(args.dtype))]
    out = {}
    for name in args.models:
        size = args.size or BENCH_MODELS[name].defaults(accelerator)["size"]
        example = load_example(name)

        def make(example=example, size=size):
            return example.build_example(size, seed=args.seed, batch_size=args.batch_size).module

        batch = next(iter(example.build_example(size, seed=args.seed, batch_size=args.batch_size).train_dataloader))
        records = stream_report(make, [batch], levels, dtype=dtype, accelerator=accelerator)
        baseline = next((level for level in ("bf16-true", "16-true") if level in records), levels[0])
        print(format_report(f"{name} ({size}, {accelerator}, one step)", records, baseline), flush=True)
        out[name] = {level: record.as_dict() for level, record in records.items()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stream.json"), "w") as f:
        json.dump({"command": f"lightning-amp {shlex.join(args.argv)}", "commit": commit(), "models": out}, f, indent=1)
    print(f"wrote {args.out}/stream.json")
    return 0


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.stream:
        return _stream(args)
    from rich.console import Console

    from lightning_amp.bench import (draw_chart, markdown_table, plan_runs, print_results, run_matrix,
                                     run_metadata, write_json)
    from lightning_amp.bench.meta import describe

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
    started, source = datetime.datetime.now(datetime.timezone.utc), commit()
    records = run_matrix(specs, console=console)
    finished = datetime.datetime.now(datetime.timezone.utc)

    ok = [r for r in records if not r.get("error")]
    command = f"lightning-amp {shlex.join(args.argv)}"
    run = run_metadata(records, command, started, finished, source)
    quick = " (quick run: indicative figures)" if args.quick else ""
    if args.quick:
        run["indicative"] = QUICK_CAVEAT.format(steps=steps, warmup=warmup, size=size)
    title = f"lightning-amp bench{quick}: {describe(run)}"
    print_results(records, title, console)
    if args.quick:
        console.print(f"[bold]Note[/bold]: {run['indicative']}.")
    os.makedirs(args.out, exist_ok=True)
    write_json(records, os.path.join(args.out, "bench.json"), run=run)
    with open(os.path.join(args.out, "bench.md"), "w") as md:
        md.write(f"{title}; {run['duration_s']:.0f} s in all\n\ncommand: `{command}`\n\n")
        md.write(f"Note: {run['indicative']}.\n\n" if args.quick else "")
        md.write(markdown_table(records))
    if ok:
        draw_chart(records, os.path.join(args.out, "bench.png"),
                   title=f"lightning-amp bench{quick} on {run['device']}: ratios to fp32 and to Lightning's mixed "
                         "precision", run=run)
    console.print(f"wrote {args.out}/bench.json, bench.md" + (", bench.png" if ok else "")
                  + f" in {run['duration_s']:.0f} s")
    return 0 if len(ok) == len(records) else 1


def _info() -> int:
    import lightning
    import torch

    import lightning_amp
    from lightning_amp import _public, ops  # noqa: F401  (the package in full: the torch-range warning included)
    from lightning_amp.ops import _build

    print(f"lightning-amp {lightning_amp.__version__}, torch {torch.__version__}, lightning {lightning.__version__}")
    if ops.extension_error() is None:
        print(f"compiled extension: loaded from {ops.extension_path()} ({ops.extension_origin()})")
    else:
        print(f"compiled extension: NOT in use: {ops.extension_error()}")
    print(f"first-use build cache: {_build.default_cache_root()} (LIGHTNING_AMP_CACHE_DIR)")
    print(f"cpu backend: {ops.backend('cpu')}; cpu threads: {torch.get_num_threads()}; "
          f"cpu bf16 instructions: {cpu_bf16_flags()}")
    if ops.backend("cpu") == "cpu-ext":
        paths = ", ".join(f"{name} {ops.wgrad_cpu_gemm(dtype)}" for name, dtype in (("bf16", torch.bfloat16),
                                                                                    ("fp16", torch.float16)))
        print(f"cpu wgrad GEMM path (LIGHTNING_AMP_WGRAD_CPU_GEMM pins one): {paths}; bf16 "
              f"{ops.wgrad_cpu_gemm_origin(torch.bfloat16)}")
    if torch.cuda.is_available():
        print(f"cuda: {torch.cuda.get_device_name()}, bf16 supported: {torch.cuda.is_bf16_supported()}, "
              f"backend: {ops.backend('cuda')}")
    else:
        print("cuda: not available")
    return 0


def _build_command(force: bool) -> int:
    from lightning_amp.ops import _build

    try:
        root = _build.require_source_dir()
        key = _build.build_key(root)
        done = _build.build_here(root, key, force=force)
    except (_build.BuildError, OSError) as err:
        print(f"lightning-amp build: {err}", file=sys.stderr)
        return 1
    print(f"{'built' if done.built else 'already built'}: {done.library} for {_build.describe(key)}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``lightning-amp`` console script; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the command's own parser: its usage, and the flag meant
        command_parser = getattr(args, "command_parser", parser)
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{_suggestion(unknown, command_parser)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command == "bench":
        return _bench(args, args.command_parser)
    if args.command == "build":
        return _build_command(args.force)
    return _info()


if __name__ == "__main__":
    sys.exit(main())
