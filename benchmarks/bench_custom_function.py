"""Host cost of a user's ``torch.autograd.Function`` applied inside O2's forward (amp/function_backward.py).

    python benchmarks/bench_custom_function.py               # 1 thread, best of 15 rounds of 500 calls

Per call: ``apply`` of a 4x16 linear Function plus its share of one backward through 500 of them (one forward
applying it 500 times), under plain bf16 autocast (what
``bf16-mixed`` runs: torch's own ``apply``) and inside O2's forward (``apply`` replaced, two node hooks
registered, the backward run under the forward's autocast), interleaved round by round so changing load hits
both alike; prints the best microseconds per call of each and their difference. Forwards that apply no
custom Function pay nothing.
"""
from __future__ import annotations

import contextlib
import datetime
import time

import torch

from lightning_amp.amp import function_backward
from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.bench.worker import device_description


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


@contextlib.contextmanager
def _forward(inside_o2: bool):
    """One forward's context: bf16 autocast, and inside O2's forward also its rules and the replaced ``apply``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False))
        if inside_o2:
            stack.enter_context(o2_policy.forward())
            stack.enter_context(function_backward.autocast_backward())
        yield


def _per_call_us(inside_o2: bool, calls: int) -> float:
    """One forward applying the Function ``calls`` times, then one backward through all of them."""
    x = torch.randn(4, 16).bfloat16()
    weight = torch.randn(16, 16).bfloat16().requires_grad_()
    start = time.perf_counter()
    with _forward(inside_o2):
        outs = [_Linear.apply(x, weight) for _ in range(calls)]
    torch.stack(outs).float().sum().backward()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    torch.set_num_threads(1)
    best = {False: float("inf"), True: float("inf")}
    with o2_policy.held():  # the Trainer plugin holds the kernels for the whole run
        for inside in (False, True):  # warm-up
            _per_call_us(inside, 50)
        for _ in range(15):
            for inside in (False, True):
                best[inside] = min(best[inside], _per_call_us(inside, 500))
    print(f"bench_custom_function, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{device_description('cpu')}, torch {torch.__version__}, 1 thread")
    print(f"apply + backward of a 4x16 linear Function: bf16 autocast {best[False]:.1f} us, inside O2's forward "
          f"{best[True]:.1f} us (+{best[True] - best[False]:.1f} us per Function applied)")


if __name__ == "__main__":
    main()
