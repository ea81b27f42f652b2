"""Reading a forward (lightning_amp/parallel/reading/forward_graph.py) changes nothing and says where its ints come from:
the module's attributes, lists and the random number generator are as before, even when its forward writes them;
a reshape's arguments carry the attributes they were computed from, through arithmetic and a shared config; read
with other values, the forward runs as it would with them, on copies."""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn

from lightning_amp.parallel.reading.dataflow import products
from lightning_amp.parallel.reading.forward_graph import read_forward, tags_of


def _logged(forward):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):  # as transformers' decorators wrap a forward
        return forward(*args, **kwargs)
    return wrapper


class Noisy(nn.Module):
    """A forward that writes its own attributes, appends to its list and draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(heads=4)
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.calls, self.seen, self.size = 0, [], 4

    @_logged
    def forward(self, x, mask=None, **kwargs):
        self.calls += 1
        self.seen.append(x)
        n, t, _ = x.shape
        heads = self.config.heads
        q, k, v = (p(x).view(n, t, heads, self.size).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask) + 0.01 * torch.randn(1)  # drawn while read
        return self.o(y.transpose(1, 2).reshape(n, t, heads * self.size))


def test_reading_changes_nothing_and_tags_the_reshapes():
    module, state = Noisy(), torch.get_rng_state()
    graph = read_forward(module, 16)
    assert (module.calls, module.seen, module.config.heads) == (0, [], 4)
    assert torch.equal(torch.get_rng_state(), state)
    (q, k, v, result), = products(graph)
    assert graph.shape(q) == (2, 4, 5, 4) and graph.shape(result) == (2, 4, 5, 4)
    heads, size = ("", ("config", "heads")), ("", ("size",))
    views = [n for n in graph.graph.nodes if n.target == "view"]
    assert len(views) == 3 and all(tags_of(n.args) == {heads, size} for n in views)
    (merge,) = [n for n in graph.graph.nodes if n.target == "reshape"]
    assert tags_of(merge.args) == {heads, size}  # heads * self.size: the product keeps both sources
    local = read_forward(module, 16, values={heads: 2}, widths={"q": (16, 8), "k": (16, 8), "v": (16, 8),
                                                                 "o": (8, 16)})
    (q, _, _, _), = products(local)
    assert local.shape(q) == (2, 2, 5, 4) and not local.errors and module.config.heads == 4
