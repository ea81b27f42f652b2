"""One flat fp32 gradient buffer (``main_grad``) for every param, its hooks, and the bucketed DP all-reduce.

Contract:

* Every trainable param ``p`` gets ``p.main_grad``: an fp32 view of shape ``p.shape`` into one
  flat buffer (apex ``combine_grad``), and ``p.grad_added_to_main_grad = False`` (Megatron-LM's flag).
  Parallel Linear weights accumulate into ``main_grad`` directly (fused wgrad GEMM), set the flag and
  hand autograd a dummy gradient; every param's post-accumulate-grad hook then adds ``p.grad`` to
  ``main_grad`` unless the flag is set (it clears it), frees ``p.grad`` and marks ``p`` ready.
  Accumulation over micro-batches is therefore in fp32.
* :meth:`MainGradBuffer.finish_sync` (after the last micro-batch's backward) averages the buffer
  over the DP group in buckets (apex ``combine_ddp``), then sums the grads of params marked
  ``sequence_parallel`` over the TP group (the two commute). With ``overlap=True`` a bucket's
  all-reduce is launched asynchronously during backward as soon as all its params have reported
  (sequence-parallel params included); gradients that arrive for an already-launched bucket (a
  param whose grad hook fires again in the same round: a second ``backward()`` before the step,
  reentrant activation checkpointing) go to a side buffer that is reduced at the end, so the result
  is exact either way. While a bucket's all-reduce is in flight its params' ``main_grad`` is None
  (a parallel layer then returns an ordinary weight gradient, which the hook puts in the side buffer);
  it is back when the round ends (:meth:`finish_sync`, :meth:`zero`, :meth:`remove_hooks`).
* :meth:`expose_grads` sets ``p.grad`` to ``p.main_grad`` (fp32 params: the view itself; 16-bit
  params: a cast copy) so any torch optimizer and gradient clipping work; :meth:`zero` clears
  ``main_grad`` and ``p.grad`` of the params it is given (an optimizer's, after its step; all by default).
* What the user does to an exposed ``p.grad`` is what ``main_grad`` holds at the next backward
  (:meth:`reclaim`, called before it): cleared (``optimizer.zero_grad()``, set to None) zeroes that
  param's ``main_grad``; a written 16-bit copy (zeroed in place, clipped) or an assigned tensor is
  copied into it; an fp32 view still held keeps accumulating (autograd adds into it in place, the hook
  does not add it twice).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_amp.parallel.groups import group_size


class MainGradBuffer:
    """See the module docstring. ``bucket_numel`` is in elements (fp32)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        dp_group: Any = None,
        tp_group: Any = None,
        bucket_numel: int = 2**22,
        overlap: bool = True,
    ) -> None:
        if not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")
        seen, unique = set(), []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        self.params = unique
        self.dp_group, self.tp_group = dp_group, tp_group
        self.dp_size, self.tp_size = group_size(dp_group), group_size(tp_group)
        self.overlap = bool(overlap) and self.dp_size > 1
        device = unique[0].device if unique else torch.device("cpu")
        total = sum(p.numel() for p in unique)
        self.buffer = torch.zeros(total, dtype=torch.float32, device=device)
        self._late: Optional[Tensor] = None
        self._sp_params = [p for p in unique if getattr(p, "sequence_parallel", False)]
        # Params are laid out in reverse registration order, roughly the order backward produces them.
        self.buckets: list[tuple[int, int, list[nn.Parameter]]] = []
        offset, start, members = 0, 0, []
        self._bucket_of: dict[int, int] = {}
        self._offset_of: dict[int, int] = {}
        for p in reversed(unique):
            n = p.numel()
            p.main_grad = self.buffer[offset:offset + n].view(p.shape)
            self._offset_of[id(p)] = offset
            members.append(p)
            offset += n
            if offset - start >= bucket_numel:
                self._close_bucket(start, offset, members)
                start, members = offset, []
        if members:
            self._close_bucket(start, offset, members)
        self.sync_enabled = True
        self._exposed: list[tuple[nn.Parameter, Tensor, int]] = []  # (param, grad exposed, its version)
        self._held: set[int] = set()  # params whose exposed fp32 view autograd accumulates into in place
        self._views = {id(p): p.main_grad for p in unique}  # main_grad of each param in the flat buffer
        self._hidden: list[nn.Parameter] = []  # params whose main_grad is None while their bucket is in flight
        self._reset_round()
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulate_hook) for p in unique]
        for p in unique:
            p.grad_added_to_main_grad = False  # set by the fused wgrad path of parallel layers (see layers.py)

    def _close_bucket(self, start: int, end: int, members: list) -> None:
        index = len(self.buckets)
        self.buckets.append((start, end, list(members)))
        for p in members:
            self._bucket_of[id(p)] = index

    def _reset_round(self) -> None:
        self._restore_views()
        self._pending = [len(m) for _, _, m in self.buckets]
        self._reported: set[int] = set()
        self._works: list = [None] * len(self.buckets)
        self._has_late = False

    # ---------------------------------------------------------------- hooks
    def _accumulate_hook(self, p: nn.Parameter) -> None:
        grad = p.grad
        if grad is None:
            return
        added = p.grad_added_to_main_grad  # a parallel layer's fused GEMM added it already (grad is a dummy)
        p.grad_added_to_main_grad = False
        if id(p) in self._held:  # autograd accumulated into the exposed main_grad view (see reclaim)
            self._held.discard(id(p))
            if grad is not self._views[id(p)] and not added:  # out of place (create_graph): old + new
                self._views[id(p)].copy_(grad)
        elif not added:
            self._target(p).add_(grad)
        p.grad = None
        self._mark_ready(p)

    def _target(self, p: nn.Parameter) -> Tensor:
        """Where a new gradient of ``p`` must be accumulated: its ``main_grad`` view, or its slot in the side
        buffer when ``p``'s bucket is already being all-reduced (a param used twice in one backward)."""
        if self._works[self._bucket_of[id(p)]] is None:
            return self._views[id(p)]
        if self._late is None:
            self._late = torch.zeros_like(self.buffer)
        self._has_late = True
        off = self._offset_of[id(p)]
        return self._late[off:off + p.numel()].view(p.shape)

    def _restore_views(self) -> None:
        """Every ``main_grad`` back on its view of the flat buffer (see :meth:`_mark_ready`)."""
        for p in self._hidden:
            p.main_grad = self._views[id(p)]
        self._hidden = []

    def _mark_ready(self, p: nn.Parameter) -> None:
        if not (self.overlap and self.sync_enabled) or id(p) in self._reported:
            return
        self._reported.add(id(p))
        bucket = self._bucket_of[id(p)]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            start, end, members = self.buckets[bucket]
            self._works[bucket] = dist.all_reduce(self.buffer[start:end], group=self.dp_group, async_op=True)
            for member in members:  # no fused GEMM may write into it now: late grads go through the hook
                member.main_grad = None
            self._hidden += members

    # ---------------------------------------------------------------- reduction
    def finish_sync(self) -> None:
        """Complete the DP and TP (sequence-parallel params) reductions of this round (collective).

        Both are sums (the DP one then divided by its size) over disjoint rank sets, so they commute:
        the DP all-reduce of every bucket (launched during backward when ``overlap``) is waited on first,
        then the sequence-parallel params' grads are summed over TP.
        """
        if self.dp_size > 1:
            for i, (start, end, _) in enumerate(self.buckets):
                if self._works[i] is None:
                    self._works[i] = dist.all_reduce(self.buffer[start:end], group=self.dp_group, async_op=True)
            for work in self._works:
                work.wait()
            self._restore_views()
            if self.overlap:
                flag = torch.tensor([1.0 if self._has_late else 0.0], device=self.buffer.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dp_group)
                if flag.item() > 0:
                    late = self._late if self._late is not None else torch.zeros_like(self.buffer)
                    dist.all_reduce(late, group=self.dp_group)
                    self.buffer.add_(late)
                    late.zero_()
            self.buffer.div_(self.dp_size)
        if self.tp_size > 1 and self._sp_params:
            flat = torch.cat([p.main_grad.reshape(-1) for p in self._sp_params])
            dist.all_reduce(flat, group=self.tp_group)
            offset = 0
            for p in self._sp_params:
                p.main_grad.copy_(flat[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
        self._reset_round()

    def expose_grads(self) -> None:
        """Point every ``p.grad`` at its ``main_grad`` (cast for 16-bit params)."""
        self._exposed = []
        for p in self.params:
            p.grad = p.main_grad if p.dtype == torch.float32 else p.main_grad.to(p.dtype)
            self._exposed.append((p, p.grad, p.grad._version))

    def reclaim(self) -> None:
        """Before a backward: make ``main_grad`` what the user left in the exposed ``p.grad`` (see the
        module docstring), so that ``optimizer.zero_grad()`` without a step clears what it names."""
        self._held = set()
        for p, exposed, version in self._exposed:
            grad = p.grad
            if grad is p.main_grad:
                self._held.add(id(p))
                continue
            if grad is None:
                p.main_grad.zero_()
            elif grad is not exposed or grad._version != version:
                p.main_grad.copy_(grad)
            p.grad = None
        self._exposed = []

    def zero(self, params: Optional[Iterable[nn.Parameter]] = None) -> None:
        """Clear ``main_grad`` and ``p.grad`` of ``params`` (those in this buffer; all when None)."""
        if params is None:
            self.buffer.zero_()
            cleared = self.params
        else:
            ids = {id(p) for p in params}
            cleared = [p for p in self.params if id(p) in ids]
            if len(cleared) == len(self.params):
                self.buffer.zero_()
            elif cleared:
                torch._foreach_zero_([p.main_grad for p in cleared])
        for p in cleared:
            p.grad = None
        ids = {id(p) for p in cleared}
        self._exposed = [e for e in self._exposed if id(e[0]) not in ids]
        self._held -= ids
        self._reset_round()

    def remove_hooks(self) -> None:
        """Wait for any all-reduce still in flight (a backward without its ``finish_sync``), then detach
        the hooks and the fused-wgrad attributes from the params."""
        for work in self._works:
            if work is not None:
                work.wait()
        self._reset_round()
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self.params:
            if hasattr(p, "grad_added_to_main_grad"):
                delattr(p, "grad_added_to_main_grad")


def tp_grad_norm(params: Iterable[nn.Parameter], tp_group: Any = None, norm_type: float = 2.0) -> Tensor:
    """Total gradient norm of the *full* (unsharded) model from this rank's grads.

    Sharded params (``tensor_model_parallel``) contribute their shard's ``|g|^p`` summed over the TP
    group; replicated params are counted once. Returns a 0-dim fp32 tensor, equal on all TP ranks.
    """
    norm_type = float(norm_type)
    sharded, replicated = [], []
    for p in params:
        if p.grad is None:
            continue
        (sharded if getattr(p, "tensor_model_parallel", False) else replicated).append(p.grad.detach().float())
    device = (sharded + replicated)[0].device if (sharded or replicated) else torch.device("cpu")
    if math.isinf(norm_type):
        local = torch.stack([g.abs().max() for g in sharded + replicated]).max() if (sharded or replicated) else torch.zeros((), device=device)
        if group_size(tp_group) > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=tp_group)
        return local
    s = torch.zeros((), device=device)
    for g in sharded:
        s = s + g.abs().pow(norm_type).sum()
    if group_size(tp_group) > 1:
        dist.all_reduce(s, group=tp_group)
    for g in replicated:
        s = s + g.abs().pow(norm_type).sum()
    return s.pow(1.0 / norm_type)


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, tp_group: Any = None, norm_type: float = 2.0) -> Tensor:
    """Scale grads in place so the full-model norm (see :func:`tp_grad_norm`) is at most ``max_norm``."""
    params = [p for p in params if p.grad is not None]
    total = tp_grad_norm(params, tp_group, norm_type)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total


def mark_sequence_parallel(module: nn.Module) -> nn.Module:
    """Mark ``module``'s params (a LayerNorm, a bias added in a sequence-parallel region) as replicated
    over the TP group with partial gradients: :class:`MainGradBuffer` all-reduces them over TP."""
    for p in module.parameters():
        p.sequence_parallel = True
    return module
