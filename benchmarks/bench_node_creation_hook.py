"""What torch's public ``torch.autograd.graph.node_creation_hook`` (torch 2.14+) would cost as the way to find the
user Functions applied in O2's forward, instead of replacing ``Function.apply`` (amp/function_backward.py).

    python benchmarks/bench_node_creation_hook.py        # needs torch >= 2.14

The hook is called from C++ for every autograd node a forward creates; ours would only test the node's type.
A dispatch-bound forward (300 x Linear(16, 16) + GELU on a batch of 2, 1 thread) is timed without and with such
a hook, interleaved, best of 7 rounds of 20 forwards; prints both, the difference per node and per forward.
"""
from __future__ import annotations

import datetime
import sys
import time

import torch
from torch.autograd.function import BackwardCFunction

from lightning_amp.bench.worker import device_description


def _hook(node) -> None:
    if isinstance(node, BackwardCFunction):
        pass


def main() -> int:
    graph = torch.autograd.graph
    if not hasattr(graph, "node_creation_hook"):
        print(f"torch {torch.__version__} has no torch.autograd.graph.node_creation_hook (2.14+)")
        return 1
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(300)])
    x = torch.randn(2, 16)
    nodes = []
    with graph.node_creation_hook(nodes.append):
        model(x)

    def forward(hooked: bool) -> None:
        if hooked:
            with graph.node_creation_hook(_hook):
                model(x)
        else:
            model(x)

    best = {False: float("inf"), True: float("inf")}
    for hooked in (False, True):
        forward(hooked)
    for _ in range(7):
        for hooked in (False, True):
            start = time.perf_counter()
            for _ in range(20):
                forward(hooked)
            best[hooked] = min(best[hooked], (time.perf_counter() - start) / 20)
    extra = best[True] - best[False]
    print(f"bench_node_creation_hook, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{device_description('cpu')}, torch {torch.__version__}, 1 thread")
    print(f"{len(nodes)} nodes per forward: {best[False] * 1e3:.2f} ms without the hook, {best[True] * 1e3:.2f} ms "
          f"with it (+{extra / best[False]:.0%}, {extra / len(nodes) * 1e6:.2f} us per node)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
