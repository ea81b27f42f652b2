"""Fused optimizer steps and multi-tensor ops vs torch's fastest equivalent, side by side in one run.

    python benchmarks/bench_optim.py --device cpu                  # medians of wall-clock repeats
    python benchmarks/bench_optim.py --device cuda                 # CUDA events, one sync per measurement
    python benchmarks/bench_optim.py --device cpu --lists few-large --modes fp32 --repeats 3

For each op, tensor list and precision mode, lightning-amp's op and torch's fastest equivalent run
interleaved on the same tensors (torch: ``fused=True`` where torch has it, else ``foreach=True``; the
column ``torch impl`` says which ran). Modes: ``fp32`` (fp32 params, grads, state), ``bf16`` (bf16
params, grads and state), ``master`` (bf16 params and grads carrying a loss scale of 1024, fp32
master weights and state: the step lightning-amp's engine runs for FusedAdam, i.e. the inf/nan check
of the 16-bit grads (``ops.multi_tensor_check_finite``, read only), then FusedAdam unscaling inside
its kernel; the torch equivalent is what a user without a fused master-weight kernel runs: the
foreach copy of the grads into the fp32 masters' grads, ``torch.amp.GradScaler``'s check of them,
torch's optimizer unscaling inside its step (fused AdamW reads ``grad_scale``/``found_inf``), and
the foreach copy of the params out). Lists: ``few-large``
(4 tensors of 4M elements on cuda, 1M on cpu) and ``many-small`` (10,000 tensors of 1-4k elements).
The op ``finite`` is the read-only inf/nan check (``ops.multi_tensor_check_finite``; torch: the foreach
inf-norm). The op ``copy`` (``torch._foreach_copy_`` of the list, no torch column) measures the device's copy
bandwidth on the same tensors: the ceiling for the other rows' GB/s.

Where torch ships a kernel ours may hand over to (``lightning_amp/ops/_choice.py``: Adam/AdamW, SGD, the L2
norm), the same op also runs forced onto each (``our kernel ms``: our compiled kernel; ``via torch ms``: our
op through torch's fused kernel, our semantics kept), interleaved with the rest: the figures the choice
table is decided from. ``chosen`` says which the op takes here, ``ours/torch`` is the op as chosen against
torch's fastest optimizer step, in time (lower is better; <= 1.00 is the goal).

"bytes" is what one pass over the list must read and write at the least (e.g. AdamW fp32: p, g,
m, v read and p, m, v written, 28 bytes per element; LAMB needs two passes), the same figure for
both implementations, so "GB/s" = bytes / time is an effective bandwidth, comparable across rows.
``--json FILE`` writes the rows (the table's columns as keys), rewritten after each row, so a run cut
short keeps the rows measured so far.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from lightning_amp import FusedAdadelta, FusedAdam, FusedLAMB, FusedSGD, ops
from lightning_amp.ops import _choice
from lightning_amp.bench.worker import device_description

MODES = ("fp32", "bf16", "master")
LISTS = ("few-large", "many-small")
OPS = ("adamw", "sgd", "lamb", "adadelta", "scale", "finite", "l2norm", "copy")
MASTER_LOSS_SCALE = 1024.0  # the loss scale the grads of mode "master" carry


@dataclass
class Case:
    """One measured pair: our callable and torch's (None where torch has no equivalent)."""

    op: str
    mode: str
    ours: Callable[[], None]
    theirs: Optional[Callable[[], None]]
    torch_impl: str
    bytes_moved: int
    choice: Optional[tuple] = None  # (op name in ops/_choice.py, device, dtype) where torch's kernel may serve


def forced(impl: str, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with ``ops._choice`` forced onto ``impl`` ("ours" or "torch") for the call."""
    def run():
        _choice.forced = impl
        try:
            fn()
        finally:
            _choice.forced = None
    return run


def tensor_sizes(kind: str, device: str, seed: int = 0) -> list[int]:
    """Element counts of the list ``kind`` ("few-large" or "many-small")."""
    if kind == "few-large":
        return [(4 if device == "cuda" else 1) << 20] * 4
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1024, 4097, (10_000,), generator=gen).tolist()


def _make(sizes, dtype, device, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * scale).to(device=device, dtype=dtype) for n in sizes]


def _torch_optimizer(cls, params, **kw):
    """torch's fastest implementation of ``cls`` for ``params``: fused, else foreach. Returns (opt, name)."""
    for impl in ("fused", "foreach"):
        try:
            opt = cls(params, **kw, **{impl: True})
            opt.step()  # fused support is only checked at the first step on some versions
            return opt, impl
        except (RuntimeError, TypeError, ValueError):
            continue
    raise RuntimeError(f"{cls.__name__} has neither a fused nor a foreach implementation here")


def _params_with_grads(sizes, dtype, device, seed):
    params = [p.requires_grad_() for p in _make(sizes, dtype, device, seed)]
    for p, g in zip(params, _make(sizes, dtype, device, seed + 1, scale=0.01)):
        p.grad = g
    return params


def bytes_per_element(op: str, mode: str) -> int:
    """Bytes per element one implementation must read and write at the least for ``op`` in ``mode``."""
    p = 4 if mode == "fp32" else 2      # model param and grad
    s = 2 if mode == "bf16" else 4      # optimizer state (and master weight)
    master = mode == "master"
    w = s if master else p              # the weight the update reads and writes
    copy = p if master else 0           # the 16-bit model copy a master-weight step writes
    if op in ("adamw", "adadelta"):     # read w, g and two states; write w and two states
        return (w + p + 2 * s) + (w + 2 * s) + copy
    if op == "sgd":                     # momentum: one state
        return (w + p + s) + (w + s) + copy
    if op == "lamb":                    # pass 1: read w, g, m, v, write m, v; pass 2: read w, m, v, write w
        return (w + p + 2 * s) + 2 * s + (w + 2 * s) + w + copy
    if op == "scale":                   # grads in the model dtype -> fp32
        return p + 4
    if op in ("l2norm", "finite"):    # read only
        return p
    if op == "copy":                    # read and write the list once
        return 2 * p
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def build_cases(kind: str, mode: str, device: str, ops_wanted) -> Iterator[Case]:
    """The cases of one list and mode, built one at a time (each holds its own copies of the tensors)."""
    sizes = tensor_sizes(kind, device)
    numel = sum(sizes)
    model_dtype = torch.float32 if mode == "fp32" else torch.bfloat16

    def pair(op, fused_cls, fused_kw, torch_cls, torch_kw):
        if mode == "master" and fused_cls is not FusedAdam:  # only FusedAdam keeps fp32 masters itself
            return None
        ours_params = _params_with_grads(sizes, model_dtype, device, 1)
        ours = fused_cls(ours_params, **fused_kw, **({"master_weights": True} if mode == "master" else {}))
        if torch_cls is None:
            return Case(op, mode, ours.step, None, "-", bytes_per_element(op, mode) * numel)
        if mode == "master":
            scale = torch.full((), MASTER_LOSS_SCALE, device=device)
            ones = torch.ones((), device=device)
            ours_found = torch.zeros((), device=device)
            ours_grads = [p.grad for p in ours_params]

            def ours_step():  # as the engine's protocol driver: check the 16-bit grads, unscale in the kernel
                ours_found.zero_()
                ops.multi_tensor_check_finite(ours_grads, ours_found)
                ours.step(grad_scale=scale, found_inf=ours_found)

            half = _params_with_grads(sizes, torch.bfloat16, device, 1)
            masters = [p.detach().float().requires_grad_() for p in half]
            for m in masters:
                m.grad = torch.empty_like(m)
            opt, impl = _torch_optimizer(torch_cls, masters, **torch_kw)
            grads_in, half_data = [p.grad for p in half], [p.detach() for p in half]
            master_grads, master_data = [m.grad for m in masters], [m.detach() for m in masters]
            found = torch.zeros((), device=device)

            def theirs():  # GradScaler's check, then the optimizer unscales in its step (fused: in its kernel)
                torch._foreach_copy_(master_grads, grads_in)
                found.zero_()
                torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found, ones)
                opt.grad_scale, opt.found_inf = scale, found
                opt.step()
                torch._foreach_copy_(half_data, master_data)
            return Case(op, mode, ours_step, theirs, impl + " + check + foreach copies",
                        bytes_per_element(op, mode) * numel)
        opt, impl = _torch_optimizer(torch_cls, _params_with_grads(sizes, model_dtype, device, 1), **torch_kw)
        choice = {"adamw": "adam", "sgd": "sgd"}.get(op)
        return Case(op, mode, ours.step, opt.step, impl, bytes_per_element(op, mode) * numel,
                    (choice, torch.device(device), model_dtype) if choice else None)

    if "adamw" in ops_wanted:
        yield pair("adamw", FusedAdam, dict(lr=1e-4, weight_decay=0.01), torch.optim.AdamW,
                          dict(lr=1e-4, weight_decay=0.01))
    if "sgd" in ops_wanted:
        yield pair("sgd", FusedSGD, dict(lr=1e-4, momentum=0.9), torch.optim.SGD, dict(lr=1e-4, momentum=0.9))
    if "lamb" in ops_wanted:
        yield pair("lamb", FusedLAMB, dict(lr=1e-4), None, {})
    if "adadelta" in ops_wanted:
        yield pair("adadelta", FusedAdadelta, dict(lr=1e-4), torch.optim.Adadelta, dict(lr=1e-4))
    grads = _make(sizes, model_dtype, device, 2)
    if "scale" in ops_wanted and mode != "master":
        out = [torch.empty_like(g, dtype=torch.float32) for g in grads]

        def torch_scale():  # unscale into fp32 and check for inf/nan, as an unscale step must
            torch._foreach_copy_(out, grads)
            torch._foreach_mul_(out, 1 / 1024)
            torch.stack(torch._foreach_norm(out, float("inf"))).isfinite().all()
        yield Case("scale", mode, lambda: ops.multi_tensor_scale(grads, out, 1 / 1024), torch_scale,
                          "foreach copy+mul+inf-norm", bytes_per_element("scale", mode) * numel)
    if "finite" in ops_wanted and mode != "master":
        found = torch.zeros((), device=device)

        def ours_finite():  # the read-only inf/nan check the engine runs on 16-bit grads
            found.zero_()
            ops.multi_tensor_check_finite(grads, found)
        yield Case("finite", mode, ours_finite, lambda: torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all(),
                   "foreach inf-norm", bytes_per_element("finite", mode) * numel)
    if "l2norm" in ops_wanted and mode != "master":
        yield Case("l2norm", mode, lambda: ops.multi_tensor_l2norm(grads),
                   lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))),
                   "foreach norm", bytes_per_element("l2norm", mode) * numel, ("l2norm", torch.device(device), model_dtype))
    if "copy" in ops_wanted and mode != "master":
        copies = [torch.empty_like(g) for g in grads]
        yield Case("copy", mode, lambda: torch._foreach_copy_(copies, grads), None, "-",
                   bytes_per_element("copy", mode) * numel)


#: the CPU clock of :func:`measure`: wall time, or this process's CPU time (``--clock cpu``: on a machine
#: shared with other work, time spent waiting for a core is left out; with one thread it is the work done)
CPU_CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CPU_CLOCK["wall"]


def measure(fn: Callable[[], None], device: str, repeats: int, inner: int) -> float:
    """Median seconds per call over ``repeats`` measurements of ``inner`` back-to-back calls.

    cuda: events around the ``inner`` calls, one sync per measurement; cpu: the clock ``--clock`` chose.
    """
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0 / inner)
        else:
            t0 = _clock()
            for _ in range(inner):
                fn()
            samples.append((_clock() - t0) / inner)
    return statistics.median(samples)


def add_cpu_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clock", choices=tuple(CPU_CLOCK), default="wall",
                        help="cpu timings: wall clock, or the process's CPU time (a shared, loaded machine)")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")


def apply_cpu_options(args) -> None:
    global _clock
    _clock = CPU_CLOCK[args.clock]
    if args.threads is not None:
        torch.set_num_threads(args.threads)


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--lists", default=",".join(LISTS), help=f"comma-separated from {','.join(LISTS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated from {','.join(MODES)}")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated from {','.join(OPS)}")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per op (default: cpu 5, cuda 20)")
    parser.add_argument("--inner", type=int, default=None, help="calls per measurement (default: cpu 1, cuda 10)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    add_cpu_options(parser)
    args = parser.parse_args(argv)
    apply_cpu_options(args)
    for name, allowed in (("lists", LISTS), ("modes", MODES), ("ops", OPS)):
        chosen = [x for x in getattr(args, name).split(",") if x]
        if not chosen or any(x not in allowed for x in chosen):
            parser.error(f"--{name}: choose from {','.join(allowed)}, got {getattr(args, name)!r}")
        setattr(args, name, chosen)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    repeats = args.repeats or (20 if args.device == "cuda" else 5)
    inner = args.inner or (10 if args.device == "cuda" else 1)
    device_name = device_description(args.device)
    print(f"bench_optim, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {device_name}, "
          f"torch {torch.__version__}, backend {ops.backend(args.device)}, commit {_commit()}, "
          f"threads {torch.get_num_threads()}, clock {args.clock}, load average {os.getloadavg()[0]:.2f}")
    print(f"command: python benchmarks/bench_optim.py {shlex.join(sys.argv[1:] if argv is None else argv)}\n")
    print("| list | op | mode | bytes/step | chosen | ours ms | ours GB/s | our kernel ms | via torch ms | torch impl "
          "| torch ms | torch GB/s | ours/torch |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|")
    rows = []
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for kind in args.lists:
        for mode in args.modes:
            for case in filter(None, build_cases(kind, mode, args.device, args.ops)):
                variants = {"ours": case.ours}
                if case.choice is not None:
                    variants["kernel"] = forced(_choice.OURS, case.ours)
                    variants["via_torch"] = forced(_choice.TORCH, case.ours)
                if case.theirs:
                    variants["torch"] = case.theirs
                for fn in variants.values():
                    measure(fn, args.device, 1, 1)  # warm-up (state allocation, kernels)
                samples = {name: [] for name in variants}
                for _ in range(repeats):  # interleaved, so drifting load hits every variant alike
                    for name, fn in variants.items():
                        samples[name].append(measure(fn, args.device, 1, inner))
                t = {name: statistics.median(s) for name, s in samples.items()}
                ms = lambda name: 1e3 * t[name] if name in t else None  # noqa: E731
                chosen = ("torch kernel" if _choice.prefers_torch(*case.choice) else "our kernel") if case.choice else "ours"
                row = dict(list=kind, op=case.op, mode=mode, bytes=case.bytes_moved, chosen=chosen, ours_ms=ms("ours"),
                           ours_gbs=case.bytes_moved / t["ours"] / 1e9, kernel_ms=ms("kernel"),
                           via_torch_ms=ms("via_torch"), torch_impl=case.torch_impl, torch_ms=ms("torch"),
                           torch_gbs=case.bytes_moved / t["torch"] / 1e9 if "torch" in t else None,
                           ratio=t["ours"] / t["torch"] if "torch" in t else None)
                rows.append(row)
                print(f"| {kind} | {case.op} | {mode} | {case.bytes_moved / 1e6:.0f} MB | {chosen} | {row['ours_ms']:.2f} | "
                      f"{row['ours_gbs']:.1f} | {fmt(row['kernel_ms'], '.2f')} | {fmt(row['via_torch_ms'], '.2f')} | "
                      f"{case.torch_impl} | {fmt(row['torch_ms'], '.2f')} | {fmt(row['torch_gbs'], '.1f')} | "
                      f"{fmt(row['ratio'], '.2f')} |", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
