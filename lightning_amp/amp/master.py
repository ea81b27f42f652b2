"""fp32 master params for half models (apex O2), framework-free.

Contract:

* :class:`MasterParams` swaps every half (fp16/bf16) param in an optimizer's ``param_groups``
  for an fp32 master copy, in place, so the optimizer (and any LR scheduler bound to it, and
  optimizer state created later) only ever sees fp32 tensors. fp32 params (e.g. BatchNorm kept
  fp32) stay as they are: they are their own masters.
* After each backward, :meth:`MasterParams.accumulate_model_grads_` adds the half grads into
  the masters' fp32 ``.grad`` and clears the half grads, so gradient accumulation over
  micro-batches happens in fp32. The grads keep whatever loss scale they were produced with;
  unscaling is :func:`unscale_grads_`'s job.
* After a successful optimizer step, :meth:`MasterParams.copy_to_model_` refreshes the half
  params from the masters (round to nearest).
* One master per model param, shared between optimizers through a ``registry`` dict.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_amp import ops

HALF_DTYPES = (torch.float16, torch.bfloat16)


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Every param of ``optimizer``, group by group (masters once :class:`MasterParams` is applied)."""
    for group in optimizer.param_groups:
        yield from group["params"]


def optimizer_grads(optimizer: torch.optim.Optimizer) -> List[Tensor]:
    """The existing ``.grad`` tensors of ``optimizer``'s params (params without grad are left out)."""
    return [p.grad for p in optimizer_params(optimizer) if p.grad is not None]


def unscale_grads_(grads: Sequence[Tensor], inv_scale: float) -> Tuple[Tensor, Optional[Tensor]]:
    """Multiply ``grads`` by ``inv_scale`` in place; return ``(found_inf, per_tensor_flags)``.

    ``found_inf`` is a 0-dim fp32 tensor (1.0 if any grad held inf/nan); ``per_tensor_flags``
    is fp32 ``[len(grads)]`` marking the offending tensors (``None`` when ``grads`` is empty).
    """
    if not grads:
        return torch.zeros(()), None
    return ops.multi_tensor_scale(list(grads), list(grads), inv_scale, per_tensor=True)


def nonfinite_flags(grads: Sequence[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """Like :func:`unscale_grads_` but read-only: ``(found_inf, per_tensor_flags)`` of ``grads``."""
    if not grads:
        return torch.zeros(()), None
    flags = torch.stack([torch.logical_not(torch.isfinite(g).all()) for g in grads]).float()
    return flags.max(), flags


def rescale_grads_(grads: Sequence[Tensor], factor: float) -> None:
    """Multiply ``grads`` by ``factor`` in place (re-basing accumulated grads onto a new loss scale)."""
    if grads and factor != 1.0:
        torch._foreach_mul_(list(grads), factor)


class MasterParams:
    """fp32 master copies of one optimizer's half params (see the module docstring).

    Args:
        optimizer: its ``param_groups`` are rewritten in place; existing state of a half param
            moves to its master (floating tensors cast to fp32).
        registry: model param -> master, shared between the optimizers of one model so a param
            listed by two optimizers gets one master.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, registry: Optional[Dict[Tensor, Tensor]] = None) -> None:
        registry = {} if registry is None else registry
        self.optimizer = optimizer
        self.model_params: List[Tensor] = []  # the model-side tensor of every optimizer param
        self.pairs: List[Tuple[Tensor, Tensor]] = []  # (half model param, fp32 master)
        for group in optimizer.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                self.model_params.append(param)
                if param.dtype not in HALF_DTYPES:
                    continue
                master = registry.get(param)
                if master is None:
                    master = param.detach().clone().float()
                    master.requires_grad_(param.requires_grad)
                    registry[param] = master
                params[i] = master
                self.pairs.append((param, master))
                self._move_state(param, master)
        self.master_of: Dict[Tensor, Tensor] = {half: master for half, master in self.pairs}
        self._trainable: Optional[Tuple[List[Tensor], List[Tensor], List[Tensor]]] = None

    def _move_state(self, half: Tensor, master: Tensor) -> None:
        state = self.optimizer.state.pop(half, None)
        if state is None:
            return
        self.optimizer.state[master] = {
            key: value.float() if isinstance(value, Tensor) and value.is_floating_point() and key != "step" else value
            for key, value in state.items()
        }

    @property
    def halves(self) -> List[Tensor]:
        return [half for half, _ in self.pairs]

    @property
    def masters(self) -> List[Tensor]:
        return [master for _, master in self.pairs]

    def has_model_grads(self) -> bool:
        """True when some half param holds a grad not yet moved into its master."""
        return any(half.grad is not None for half, _ in self.pairs)

    def _grad_views(self) -> Optional[Tuple[List[Tensor], List[Tensor], List[Tensor]]]:
        """(halves, masters, fp32 grad views) of the trainable pairs, built once; None when a half
        carries a ``main_grad`` (the tensor-parallel strategy's buffer: handled param by param)."""
        if self._trainable is None:
            pairs = [(h, m) for h, m in self.pairs if h.requires_grad]
            if any(isinstance(getattr(h, "main_grad", None), Tensor) for h, _ in pairs):
                self._trainable = ([], [], [])
            else:
                views: Dict[int, Tensor] = {}
                for device in {m.device for _, m in pairs}:
                    on = [m for _, m in pairs if m.device == device]
                    flat = torch.zeros(sum(m.numel() for m in on), dtype=torch.float32, device=device)
                    for m, view in zip(on, torch.split(flat, [m.numel() for m in on])):
                        views[id(m)] = view.view(m.shape)
                self._trainable = ([h for h, _ in pairs], [m for _, m in pairs], [views[id(m)] for _, m in pairs])
        return self._trainable if self._trainable[0] else None

    @torch.no_grad()
    def accumulate_model_grads_(self) -> None:
        """``master.grad += half.grad`` in fp32 (or ``= half.grad.float()``), then ``half.grad = None``.

        Common case, one foreach call: every trainable half has a grad and the masters' grads are
        their views into one flat fp32 buffer per device (attached by the first backward after the
        masters' grads were cleared, copied into rather than added to). Otherwise param by param.
        A half param that carries an fp32 ``main_grad`` of its shape (the tensor-parallel strategy's
        flat buffer, which its ``.grad`` was exposed from) contributes that full-precision tensor
        instead of the rounded ``.grad``; the master's grad then aliases it when it had none.
        """
        if not self._accumulate_all_at_once():
            self._accumulate_one_by_one()

    def _accumulate_all_at_once(self) -> bool:
        trainable = self._grad_views()
        if trainable is None:
            return False
        halves, masters, views = trainable
        grads = [h.grad for h in halves]
        if any(g is None for g in grads):
            return False
        attached = [m.grad is v for m, v in zip(masters, views)]
        if all(attached):
            torch._foreach_add_(views, grads)
        elif not any(attached) and all(m.grad is None for m in masters):
            torch._foreach_copy_(views, grads)
            for m, v in zip(masters, views):
                m.grad = v
        else:
            return False
        for h in halves:
            h.grad = None
        return True

    def _accumulate_one_by_one(self) -> None:
        for half, master in self.pairs:
            grad = half.grad
            if grad is None:
                continue
            main_grad = getattr(half, "main_grad", None)
            if isinstance(main_grad, Tensor) and main_grad.dtype == torch.float32 and main_grad.shape == half.shape:
                if master.grad is None:
                    master.grad = main_grad
                elif master.grad is not main_grad:  # an alias already holds the values
                    master.grad.add_(main_grad)
            elif master.grad is None:
                master.grad = grad.to(torch.float32, copy=True)
            else:
                master.grad.add_(grad)
            half.grad = None

    @torch.no_grad()
    def copy_to_model_(self) -> None:
        """Refresh every half param from its master (``half.copy_(master)``, round to nearest)."""
        if self.pairs:
            torch._foreach_copy_(self.halves, self.masters)

    @torch.no_grad()
    def load_masters_(self, values: Dict[Tensor, Tensor]) -> int:
        """Set masters from ``values`` (half model param -> full-precision value), then refresh the halves.

        Returns how many masters were loaded; params absent from ``values`` keep their masters.
        """
        loaded = 0
        for half, master in self.pairs:
            value = values.get(half)
            if value is None:
                continue
            if tuple(value.shape) != tuple(master.shape):
                raise ValueError(
                    f"master value shape {tuple(value.shape)} does not match the param's shape {tuple(master.shape)}"
                )
            master.copy_(value)
            half.copy_(master)
            loaded += 1
        return loaded

    def clear_grads_(self) -> None:
        """Drop the grads of the half params and of every optimizer param (masters included)."""
        for half in self.model_params:
            half.grad = None
        for param in optimizer_params(self.optimizer):
            param.grad = None


def param_name(names: Dict[Tensor, List[str]], param: Tensor) -> str:
    """The first of ``param``'s names in ``names``, or a placeholder naming its shape."""
    return names.get(param, [f"<unnamed {tuple(param.shape)}>"])[0]


def _sharded(param: Tensor) -> bool:
    """Tensor-parallel shards: their checkpoint entries are the gathered full tensors (the strategy
    saves and loads those masters itself)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def masters_into_state_dict(pairs: Sequence[Tuple[Tensor, Tensor]], names: Dict[Tensor, List[str]],
                            model_state: Dict[str, object]) -> List[str]:
    """Write each fp32 master over its half param's entries of ``model_state`` (by the param's names).

    Returns the names of the (unsharded) params whose entry was missing or had another shape:
    nothing was written for them, the caller decides whether that is an error.
    """
    mismatched = []
    for half, master in pairs:
        found = False
        for name in names.get(half, []):
            value = model_state.get(name)
            if isinstance(value, Tensor) and value.shape == master.shape:
                model_state[name] = master.detach().clone()
                found = True
        if not found and not _sharded(half):
            mismatched.append(param_name(names, half))
    return mismatched


def load_masters(masters: "MasterParams", names: Dict[Tensor, List[str]], model_state: Dict[str, object]) -> List[str]:
    """Set ``masters`` from the full-precision entries of ``model_state`` (by their params' names).

    Returns the names of the (unsharded) params with no entry of their shape; those keep their masters.
    """
    values, mismatched = {}, []
    for half, _ in masters.pairs:
        for name in names.get(half, []):
            value = model_state.get(name)
            if isinstance(value, Tensor) and value.shape == half.shape:
                values[half] = value
                break
        else:
            if not _sharded(half):
                mismatched.append(param_name(names, half))
    masters.load_masters_(values)
    return mismatched
