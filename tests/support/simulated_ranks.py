"""Every rank of a tensor-parallel group simulated in one process, for layouts that exist only at sizes this machine
cannot launch (tp=8): the plan is built once, each rank's copy of the module is converted as that rank
(``torch.distributed`` answers its rank and the group's size; collectives do nothing), and the module's output is
the sum of the ranks' outputs (what the out-projection's all-reduce computes), so it must equal the unconverted
module's; backward through that sum gives each rank the gradient its shards get in a real run, before any
all-reduce: a sharded weight's must equal its slice of the full gradient, a replicated weight's (key/value heads kept
whole) summed over the ranks must equal the full gradient. The module must end with its out-projection (no bias:
every rank would add it) so that its output is linear in the ranks' partial sums."""
from __future__ import annotations

import contextlib
import copy
from typing import Callable
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_amp.parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelConfig
from lightning_amp.parallel.fused_qkv import ReplicatedHeadsLinear, ReplicatedKVColumnParallel
from lightning_amp.parallel.convert import convert
from lightning_amp.parallel.plan import build_plan


@contextlib.contextmanager
def as_rank(rank: int, tp: int):
    """``torch.distributed`` as rank ``rank`` of ``tp`` sees it; every all-reduce leaves its tensor as it is."""
    with mock.patch.object(dist, "is_initialized", lambda: True), \
            mock.patch.object(dist, "get_world_size", lambda group=None: tp), \
            mock.patch.object(dist, "get_rank", lambda group=None: rank), \
            mock.patch.object(dist, "all_reduce", lambda *args, **kwargs: None):
        yield


def simulate(full: nn.Module, run: Callable[[nn.Module], Tensor], tp: int):
    """(plan, rank 0's plan report, ranks' converted copies of ``full``, sum of ``run(rank copy)`` over the ranks)."""
    with as_rank(0, tp):
        plan = build_plan(full, "auto", tp)
    ranks, reports, total = [], [], 0
    for rank in range(tp):
        copy_ = copy.deepcopy(full)
        with as_rank(rank, tp):
            reports.append(convert(copy_, plan, None, TensorParallelConfig()))
            total = total + run(copy_)
        ranks.append(copy_)
    return plan, reports[0], ranks, total


def backward(total: Tensor, grad: Tensor, tp: int) -> None:
    with as_rank(0, tp):
        total.backward(grad)


def grad_errors(full: nn.Module, ranks: list[nn.Module]) -> dict[str, float]:
    """Per param of ``full``: the largest difference between its gradient and what the ranks' gradients say it is,
    relative to its largest gradient element."""
    summed: dict[str, Tensor] = {}
    errors: dict[str, float] = {}

    def rel(got: Tensor, want: Tensor) -> float:
        return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()

    for module in ranks:
        inside, fused = set(), []
        for path, sub in module.named_modules():
            key = f"{path}." if path else ""
            if any(path.startswith(f + ".") for f in fused):
                continue  # the query part of a fused [q | k | v], compared with it
            if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
                for name, param in sub.named_parameters(recurse=False):
                    want = full.get_parameter(key + name).grad
                    layout = getattr(param, "shard_layout", None)
                    want = layout.shard(want) if layout is not None else want
                    errors[key + name] = max(errors.get(key + name, 0.0), rel(param.grad, want))
            elif isinstance(sub, ReplicatedKVColumnParallel):
                fused.append(path)
                q_rows = sub.heads.blocks[0]
                for name, q, kv in (("weight", sub.q.weight, sub.kv_weight), ("bias", sub.q.bias, sub.kv_bias)):
                    if kv is None:
                        continue
                    want = full.get_parameter(key + name).grad
                    errors[key + name] = max(errors.get(key + name, 0.0), rel(q.grad, q.shard_layout.shard(want[:q_rows])))
                    summed[key + name] = summed.get(key + name, 0) + kv.grad
            elif isinstance(sub, ReplicatedHeadsLinear):
                for name, param in sub.named_parameters(recurse=False):
                    summed[key + name] = summed.get(key + name, 0) + param.grad
            else:
                continue
            inside.update(f"{key}{n}" for n, _ in sub.named_parameters())
        for name, param in module.named_parameters():
            if name in inside or param.grad is None:
                continue
            if getattr(param, "sequence_parallel", False):  # partial on each rank, summed over the group
                summed[name] = summed.get(name, 0) + param.grad
            else:
                errors[name] = max(errors.get(name, 0.0), rel(param.grad, full.get_parameter(name).grad))
    for name, grad in summed.items():
        want = full.get_parameter(name).grad
        if want.shape != grad.shape:  # a fused [q | k | v]: its key/value rows
            want = want[want.shape[0] - grad.shape[0]:]
        errors[name] = max(errors.get(name, 0.0), rel(grad, want))
    return errors
