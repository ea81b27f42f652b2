"""Host cost of the O2/O3 forward context on the CPU: half default dtype alone vs with autocast.

Measures CPU time of this thread (``time.thread_time``, 1 torch thread), so other processes on a
shared machine disturb it less than wall time; the minimum over interleaved rounds is reported:

1. per op: ``linear``/``layer_norm``/add on tiny half tensors, plain vs inside ``torch.autocast``;
2. the host-cost probe: 48 blocks of Linear(16, 16) -> LayerNorm -> GELU, batch 4, forward and
   backward of a half model, no context vs default dtype vs default dtype + autocast;
3. one forward + backward of each model of ``tests/precision/test_third_party_models.py`` (cast to half,
   BatchNorm fp32), default dtype vs default dtype + autocast.

    python benchmarks/bench_forward_context.py [--dtype bfloat16|float16] [--rounds 25]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import nn

from lightning_amp.amp.module_cast import cast_floating, cast_module_, default_dtype


@contextlib.contextmanager
def half_forward(dtype: torch.dtype, autocast: bool):
    """The half default dtype (O3's forward), plus CPU autocast if asked."""
    with default_dtype(dtype), torch.autocast("cpu", dtype=dtype, cache_enabled=False, enabled=autocast):
        yield


def _min_times(bodies: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, float]:
    for body in bodies.values():
        body()  # warm-up
    times = {name: float("inf") for name in bodies}
    for _ in range(rounds):
        for name, body in bodies.items():
            start = time.thread_time()
            body()
            times[name] = min(times[name], time.thread_time() - start)
    return times


def per_op(dtype: torch.dtype, rounds: int) -> None:
    x, w, ln_w = torch.randn(1, 4, dtype=dtype), torch.randn(4, 4, dtype=dtype), torch.ones(4, dtype=dtype)

    def ops(context) -> Callable[[], None]:
        def body() -> None:
            with context():
                y = x
                for _ in range(200):
                    y = F.layer_norm(F.linear(y, w), (4,), ln_w) + y
        return body

    t = _min_times({"plain": ops(contextlib.nullcontext),
                    "autocast": ops(lambda: torch.autocast("cpu", dtype=dtype, cache_enabled=False))}, rounds)
    plain, auto = t["plain"] / 600, t["autocast"] / 600
    print(f"per op: plain {plain * 1e6:.2f} us, under autocast {auto * 1e6:.2f} us "
          f"(+{(auto - plain) * 1e6:.2f} us, {auto / plain:.3f}x)")


def _step(model: nn.Module, run: Callable[[], torch.Tensor], context) -> Callable[[], None]:
    def body() -> None:
        with context():
            loss = run()
        loss.float().backward()
        for p in model.parameters():
            p.grad = None
    return body


def probe(dtype: torch.dtype, rounds: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(48)],
                          nn.Linear(16, 8)).to(dtype)
    x = torch.randn(4, 16, dtype=dtype)
    run = lambda: model(x).float().pow(2).mean()  # noqa: E731
    t = _min_times({
        "none": _step(model, run, contextlib.nullcontext),
        "dtype": _step(model, run, lambda: half_forward(dtype, autocast=False)),
        "dtype+autocast": _step(model, run, lambda: half_forward(dtype, autocast=True)),
    }, rounds)
    print(f"probe (48 x Linear/LayerNorm/GELU, width 16): no context {t['none'] * 1e3:.2f} ms, "
          f"default dtype {t['dtype'] / t['none']:.3f}x, default dtype + autocast {t['dtype+autocast'] / t['none']:.3f}x")


def models(dtype: torch.dtype, rounds: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_third_party_models as matrix

    for name in matrix.MODELS:
        model, batch = matrix._build(name)
        cast_module_(model, dtype, keep_batchnorm_fp32=True)
        batch = cast_floating(batch, dtype)
        run = lambda: model.training_step(batch, 0)  # noqa: E731
        t = _min_times({
            "dtype": _step(model, run, lambda: half_forward(dtype, autocast=False)),
            "dtype+autocast": _step(model, run, lambda: half_forward(dtype, autocast=True)),
        }, rounds)
        print(f"{name:<18} default dtype {t['dtype'] * 1e3:7.2f} ms, + autocast {t['dtype+autocast'] * 1e3:7.2f} ms "
              f"({t['dtype+autocast'] / t['dtype']:.3f}x)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {args.dtype}, CPU time of one thread, min of {args.rounds} rounds")
    per_op(dtype, args.rounds)
    probe(dtype, args.rounds)
    models(dtype, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
