"""Fused optimizer steps over lists of tensors (Adam/AdamW, SGD, Adadelta, LAMB).

The compiled kernels are the torch.library ops ``lightning_amp::multi_tensor_{adam,sgd,adadelta,lamb}``
and LAMB's two passes (:mod:`lightning_amp.ops._library`); they check every argument in C++. The
pure-PyTorch fallbacks (no extension for the params' device) check their own (:func:`_check_optim_args`).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from . import _ext
from ._ext import _c10_name, _check_dense, _check_float_like
from . import _choice, _dtensor, _library
from ._dtensor import DTensor as _DTensor  # None: torch built without distributed


# --------------------------------------------------------------------------------------
# Fused optimizer updates (one call per param group and dtype over lists of tensors)
#
# Shared conventions: ``steps`` are per-tensor 0-dim float32 step counters that the op
# increments itself; ``grad_scale`` (0-dim fp32) divides the grads in the kernel, which writes the
# unscaled grads back in place (rounded to their dtype), as torch's fused optimizers do; without it
# the grads are only read; ``found_inf`` (0-dim fp32) non-zero means the op changes NOTHING (params,
# state, steps, model copies, grads). ``model_copies`` (optional, 16-bit) receive the updated fp32 ``params``
# rounded to their dtype in the same pass (fp32 master weights + half model copy).
# All math is fp32; state tensors have the dtype of their param.
# --------------------------------------------------------------------------------------

_OPT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _compiled(params: Sequence[Tensor]) -> bool:
    """Whether the compiled kernels serve these params (an extension for their device); empty lists and
    devices without kernels take the fallback path, which checks its arguments itself."""
    return len(params) > 0 and isinstance(params[0], Tensor) and _ext._ext_for(params[0].device) is not None


def local_shards(*lists: Optional[Sequence[Tensor]]) -> tuple:
    """``lists`` with every DTensor replaced by its local shard (``to_local()``, same storage), so an
    elementwise update runs on this rank's part of each tensor in place; ``None`` stays ``None``.
    Returned as given when the first list (the params) holds no DTensor.

    The compiled kernels do not need it: called with DTensors they go through DTensor's dispatch
    (:mod:`._dtensor`). It serves the pure-PyTorch fallbacks, LAMB with a caller's ``reduce_norms``,
    and callers of torch's own multi-tensor ops on local shards (``amp/step.py``, FusedLAMB's global
    grad norm)."""
    if _DTensor is None or not any(isinstance(p, _DTensor) for p in lists[0]):
        return lists
    return tuple(None if lst is None else [t.to_local() if isinstance(t, _DTensor) else t for t in lst]
                 for lst in lists)


def _check_scalar_tensor(op: str, name: str, t: Optional[Tensor], device: torch.device) -> None:
    """As csrc/optim_entry.cpp ``check_flag``: None, or a one-element float32 tensor on ``device``."""
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a 0-dim float32 tensor or None, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the params are on {device}")
    if t.dtype != torch.float32 or t.numel() != 1:
        raise TypeError(f"{op}: {name} must be a one-element float32 tensor, got shape {list(t.shape)} "
                        f"{_c10_name(t.dtype)}")


def _check_optim_args(
    op: str,
    params: Sequence[Tensor],
    grads: Optional[Sequence[Tensor]],
    state: dict,
    steps: Optional[Sequence[Tensor]],
    grad_scale: Optional[Tensor],
    found_inf: Optional[Tensor],
    model_copies: Optional[Sequence[Tensor]],
) -> None:
    """The fallbacks' checks: a port of csrc/optim_entry.cpp ``check_lists`` (same order, messages and
    exception types), except that empty lists are accepted (the public ops do nothing then)."""
    n = len(params)
    lists = ({"grads": grads} if grads is not None else {}) | dict(state)
    if steps is not None:
        lists["steps"] = steps
    for name, lst in lists.items():
        if len(lst) != n:
            raise ValueError(f"{op}: {name} has {len(lst)} tensors but params has {n}; "
                             "all lists must have equal length")
    copies = list(model_copies) if model_copies is not None else []
    if copies and len(copies) != n:
        raise ValueError(f"{op}: model_copies has {len(copies)} tensors but params has {n} "
                         "(give none or one per param)")
    if n == 0:
        return
    for name, lst in (("params", params), *lists.items(), ("model_copies", copies)):
        for i, t in enumerate(lst):
            if not isinstance(t, Tensor):
                raise TypeError(f"{op}: {name}[{i}] is not a tensor")
    device, pdtype = params[0].device, params[0].dtype
    gdtype = grads[0].dtype if grads is not None else pdtype

    def check_like(name: str, t: Tensor, p: Tensor, pn: str) -> None:
        _check_dense(op, name, t)
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {pn} is on {device}")
        if t.shape != p.shape:
            raise ValueError(f"{op}: {name} shape {list(t.shape)} != {pn} shape {list(p.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (got strides {list(t.stride())})")

    for i, p in enumerate(params):
        pn = f"params[{i}]"
        if p.device != device:
            raise ValueError(f"{op}: {pn} is on {p.device} but params[0] is on {device}")
        _check_float_like(op, pn, p)
        if p.dtype != pdtype:
            raise TypeError(f"{op}: params must share one dtype, {pn} is {_c10_name(p.dtype)} but params[0] is "
                            f"{_c10_name(pdtype)}")
        if not p.is_contiguous():
            raise ValueError(f"{op}: {pn} must be contiguous (got strides {list(p.stride())})")
        if grads is not None:
            gn, g = f"grads[{i}]", grads[i]
            if g.device != device:
                raise ValueError(f"{op}: {gn} is on {g.device} but {pn} is on {device}")
            _check_float_like(op, gn, g)
            if g.dtype != gdtype:
                raise TypeError(f"{op}: grads must share one dtype, {gn} is {_c10_name(g.dtype)} but grads[0] is "
                                f"{_c10_name(gdtype)}")
            check_like(gn, g, p, pn)
        for name, lst in state.items():
            sn, t = f"{name}[{i}]", lst[i]
            if t.device != device:
                raise ValueError(f"{op}: {sn} is on {t.device} but {pn} is on {device}")
            if t.dtype != pdtype:
                raise TypeError(f"{op}: {sn} must have its param's dtype {_c10_name(pdtype)}, got {_c10_name(t.dtype)}")
            check_like(sn, t, p, pn)
        if steps is not None:
            t = steps[i]
            if t.device != device:
                raise ValueError(f"{op}: steps[{i}] is on {t.device} but {pn} is on {device}")
            if t.dtype != torch.float32 or t.numel() != 1:
                raise TypeError(f"{op}: steps[{i}] must be a one-element float32 tensor, got shape {list(t.shape)} "
                                f"{_c10_name(t.dtype)}")
        if copies:
            cn, c = f"model_copies[{i}]", copies[i]
            if c.device != device:
                raise ValueError(f"{op}: {cn} is on {c.device} but {pn} is on {device}")
            _check_dense(op, cn, c)
            if pdtype != torch.float32:
                raise TypeError(f"{op}: with model_copies the params are fp32 masters, got {_c10_name(pdtype)}")
            if c.dtype not in (torch.float16, torch.bfloat16):
                raise TypeError(f"{op}: {cn} must be float16 or bfloat16, got {_c10_name(c.dtype)}")
            if c.dtype != copies[0].dtype:
                raise TypeError(f"{op}: model_copies must share one dtype")
            check_like(cn, c, p, pn)
    _check_scalar_tensor(op, "grad_scale", grad_scale, device)
    _check_scalar_tensor(op, "found_inf", found_inf, device)


@contextlib.contextmanager
def _undone_if(found_inf: Optional[Tensor], *groups: Optional[Sequence[Tensor]]) -> Iterator[None]:
    """Run the update in the body, then put back every tensor of ``groups`` where ``found_inf`` is
    non-zero: device ops only (a copy of the touched tensors and a ``torch.where``), no host read."""
    if found_inf is None:
        yield
        return
    tensors = [t for group in groups if group is not None for t in group]
    saved = [t.clone() for t in tensors]
    yield
    skip = found_inf.reshape(()) != 0
    for t, old in zip(tensors, saved):
        t.copy_(torch.where(skip, old, t))


def _unscaled_fp32(grad: Tensor, grad_scale: Optional[Tensor]) -> Tensor:
    """``grad`` in fp32 divided by ``grad_scale``, which is also written back into ``grad`` (rounded to
    its dtype), as the compiled kernels do; the update goes on with the unrounded fp32 value."""
    g = grad.float()
    if grad_scale is None:
        return g
    g = g / grad_scale.reshape(())
    grad.copy_(g)
    return g


def _written(grads: Sequence[Tensor], grad_scale: Optional[Tensor]) -> Optional[Sequence[Tensor]]:
    """The grads when the op writes them (given ``grad_scale``), for :func:`_undone_if`: a skipped step
    leaves them as they were (scaled), as torch's fused optimizers do."""
    return grads if grad_scale is not None else None


def _store(dst: Tensor, src_fp32: Tensor) -> None:
    if dst is not src_fp32:  # an fp32 tensor's .float() is the tensor itself, updated in place already
        dst.copy_(src_fp32)


def _torch_fused_grads(params: Sequence[Tensor], grads: Sequence[Tensor]) -> Optional[list]:
    """Grads as torch's fused optimizer kernels take them (the params' dtype): the caller's own where
    the dtypes agree (given grad_scale, torch's kernels store the unscaled grads back into them, as the
    compiled ops do), fp32 copies of 16-bit grads of fp32 params (:func:`_unscale_back` then writes their
    unscaled values into the caller's grads), or None where they cannot without changing our numerics
    (grads wider than 16-bit params). None under ``torch.compile``: torch's fused CPU kernels have no
    functionalization or fake kernel, so a compiled step takes the per-tensor loop (plain ops)."""
    if torch.compiler.is_compiling():
        return None
    pdtype, gdtype = params[0].dtype, grads[0].dtype
    if gdtype != pdtype:
        return [g.to(pdtype) for g in grads] if pdtype == torch.float32 else None
    return list(grads)


def _unscale_back(grads: Sequence[Tensor], taken: list, grad_scale: Optional[Tensor]) -> None:
    """After torch's fused kernel unscaled ``taken`` in place: the caller's ``grads`` get those values
    where ``taken`` were copies (:func:`_torch_fused_grads`)."""
    if grad_scale is not None and taken[0] is not grads[0]:
        torch._foreach_copy_(list(grads), taken)


def _torch_kernel_keeps_semantics(params: Sequence[Tensor], grads: Sequence[Tensor], model_copies) -> bool:
    """Whether torch's fused kernel can serve these lists with our semantics as they are: grads of the
    params' dtype (torch unscales them in place), no 16-bit model copies to write in the same pass,
    plain tensors, eager mode (torch's fused CPU kernels have no fake kernel for a trace)."""
    return (model_copies is None and len(grads) == len(params) and isinstance(grads[0], Tensor)
            and grads[0].dtype == params[0].dtype and not torch.compiler.is_compiling()
            and not _library.is_dtensor(params))


def _skip_flag(found_inf: Optional[Tensor]) -> Optional[Tensor]:
    """``found_inf`` as torch's fused kernels read it: they skip only on exactly 1.0, ours on any
    non-zero value (a device op, no host read)."""
    return None if found_inf is None else found_inf.reshape(()).ne(0).float()


def _torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                adam_w_mode, grad_scale, found_inf) -> None:
    """One step through torch's fused Adam/AdamW kernel (lists as :func:`_torch_kernel_keeps_semantics`
    allows, bias correction on) with our semantics: the kernel divides the grads by ``grad_scale`` and
    writes them back unscaled, and skips everything (grads included) under the flag; the step counters it
    reads advanced are put back on a skipped step, on the device."""
    steps = list(steps)
    skip = _skip_flag(found_inf)
    torch._foreach_add_(steps, 1.0)
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    fused(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
          list(max_exp_avg_sqs) if max_exp_avg_sqs is not None else [], steps, lr=lr, beta1=beta1, beta2=beta2,
          weight_decay=weight_decay, eps=eps, amsgrad=max_exp_avg_sqs is not None, maximize=False,
          grad_scale=None if grad_scale is None else grad_scale.reshape(()), found_inf=skip)
    if skip is not None:
        torch._foreach_sub_(steps, [skip] * len(steps))


def _torch_sgd_usable(params: Sequence[Tensor], momentum: float) -> bool:
    """torch's fused SGD keeps our numerics for fp32 params, and for 16-bit ones on CUDA without momentum:
    torch 2.13's CPU ``_fused_sgd_`` leaves the vectorised part of bf16/fp16 params unchanged (measured:
    1000 ones, lr 0.1, grad 1 -> only the tail moves), and its CUDA kernel updates 16-bit params with the
    momentum before it is rounded to the buffer's dtype, where ``torch.optim.SGD`` (and our kernels) use
    the stored one."""
    return params[0].dtype == torch.float32 or (params[0].is_cuda and momentum == 0)


def _torch_sgd(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, first_run,
               grad_scale, found_inf) -> None:
    """One step through torch's fused SGD kernel with our semantics (as :func:`_torch_adam`; no counters)."""
    torch._fused_sgd_(list(params), list(grads), list(momentum_buffers) if momentum != 0 else [],
                      weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                      maximize=False, is_first_step=first_run,
                      grad_scale=None if grad_scale is None else grad_scale.reshape(()), found_inf=_skip_flag(found_inf))


def _adam_fallback(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps,
                   weight_decay, adam_w_mode, bias_correction, grad_scale, found_inf, model_copies) -> None:
    """torch's own fused Adam/AdamW kernel (same math: fp32 opmath, decoupled or L2 decay, AMSGrad)
    where it applies (bias correction on, grads convertible), else a per-tensor loop."""
    if bias_correction and _torch_kernel_keeps_semantics(params, grads, model_copies):
        _torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps,
                    weight_decay, adam_w_mode, grad_scale, found_inf)
        return
    with _undone_if(found_inf, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, model_copies,
                    _written(grads, grad_scale)):
        fused_grads = _torch_fused_grads(params, grads) if bias_correction else None
        if fused_grads is not None:
            torch._foreach_add_(list(steps), 1.0)  # torch's kernels read the already advanced step
            fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
            fused(list(params), fused_grads, list(exp_avgs), list(exp_avg_sqs),
                  list(max_exp_avg_sqs) if max_exp_avg_sqs is not None else [], list(steps), lr=lr, beta1=beta1,
                  beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=max_exp_avg_sqs is not None, maximize=False,
                  grad_scale=grad_scale)
            _unscale_back(grads, fused_grads, grad_scale)
            if model_copies is not None:
                torch._foreach_copy_(list(model_copies), list(params))
            return
        for i, p in enumerate(params):
            g = _unscaled_fp32(grads[i], grad_scale)
            steps[i].add_(1)
            step = steps[i].reshape(()).double()  # stays on the device: no host synchronisation
            pf, m, v = p.float(), exp_avgs[i].float(), exp_avg_sqs[i].float()
            if weight_decay != 0:
                if adam_w_mode:
                    pf.mul_(1 - lr * weight_decay)
                else:
                    g = g.add(pf, alpha=weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bc1 = (1 - beta1**step).float() if bias_correction else 1.0
            bc2_sqrt = (1 - beta2**step).sqrt().float() if bias_correction else 1.0
            if max_exp_avg_sqs is not None:
                vmax = max_exp_avg_sqs[i].float()
                torch.maximum(vmax, v, out=vmax)
                _store(max_exp_avg_sqs[i], vmax)
                denom = (vmax.sqrt() / bc2_sqrt).add_(eps)
            else:
                denom = (v.sqrt() / bc2_sqrt).add_(eps)
            pf.add_((m / denom) * (-lr / bc1))
            _store(p, pf)
            _store(exp_avgs[i], m)
            _store(exp_avg_sqs[i], v)
            if model_copies is not None:
                model_copies[i].copy_(pf)


def multi_tensor_adam(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    max_exp_avg_sqs: Optional[Sequence[Tensor]] = None,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    model_copies: Optional[Sequence[Tensor]] = None,
    checked: bool = False,
) -> None:
    """One Adam/AdamW step over lists of tensors, in place (torch.optim.Adam/AdamW semantics).

    ``adam_w_mode``: decoupled weight decay ``p *= 1 - lr * weight_decay`` (AdamW) instead of
    the L2 term ``g += weight_decay * p`` (Adam). ``max_exp_avg_sqs`` given = AMSGrad.
    ``checked=True``: the caller validated the lists (a cached plan), so the fallback skips its
    per-tensor Python checks; the compiled op checks every argument in C++ on every call either way.
    """
    if _compiled(params) and not (bias_correction and _choice.prefers_torch("adam", params[0].device, params[0].dtype)
                                  and _torch_kernel_keeps_semantics(params, grads, model_copies)):
        # DTensors: through DTensor's dispatch (ops._dtensor), on their local shards
        _library.run(
            "multi_tensor_adam", list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
            list(max_exp_avg_sqs) if max_exp_avg_sqs is not None else [], list(steps),
            list(model_copies) if model_copies is not None else [],
            float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adam_w_mode),
            bool(bias_correction), grad_scale, found_inf,
        )
        return
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_copies = local_shards(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_copies)
    state = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if max_exp_avg_sqs is not None:
        state["max_exp_avg_sqs"] = max_exp_avg_sqs
    if not checked:
        _check_optim_args("multi_tensor_adam", params, grads, state, steps, grad_scale, found_inf, model_copies)
    if params:
        _adam_fallback(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps,
                       weight_decay, adam_w_mode, bias_correction, grad_scale, found_inf, model_copies)


def _sgd_fallback(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, first_run,
                  grad_scale, found_inf, model_copies) -> None:
    """torch's own fused SGD kernel (torch.optim.SGD semantics) where it keeps our numerics
    (:func:`_torch_sgd_usable`), else a loop."""
    if _torch_sgd_usable(params, momentum) and _torch_kernel_keeps_semantics(params, grads, model_copies):
        _torch_sgd(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, first_run,
                   grad_scale, found_inf)
        return
    with _undone_if(found_inf, params, momentum_buffers if momentum != 0 else None, model_copies,
                    _written(grads, grad_scale)):
        fused_grads = _torch_fused_grads(params, grads) if _torch_sgd_usable(params, momentum) else None
        if fused_grads is not None:
            torch._fused_sgd_(list(params), fused_grads, list(momentum_buffers) if momentum != 0 else [],
                              weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
                              nesterov=nesterov, maximize=False, is_first_step=first_run, grad_scale=grad_scale)
            _unscale_back(grads, fused_grads, grad_scale)
            if model_copies is not None:
                torch._foreach_copy_(list(model_copies), list(params))
            return
        for i, p in enumerate(params):
            g = _unscaled_fp32(grads[i], grad_scale)
            pf = p.float()
            if weight_decay != 0:
                g = g.add(pf, alpha=weight_decay)
            if momentum != 0:
                buf = momentum_buffers[i].float()
                if first_run:
                    buf.copy_(g)
                else:
                    buf.mul_(momentum).add_(g, alpha=1 - dampening)
                _store(momentum_buffers[i], buf)
                buf = momentum_buffers[i].float()  # the stored (16-bit: rounded) momentum, as torch
                g = g.add(buf, alpha=momentum) if nesterov else buf
            pf.add_(g, alpha=-lr)
            _store(p, pf)
            if model_copies is not None:
                model_copies[i].copy_(pf)


def multi_tensor_sgd(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Optional[Sequence[Tensor]],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    first_run: bool = False,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    model_copies: Optional[Sequence[Tensor]] = None,
    checked: bool = False,
) -> None:
    """One SGD step in place (torch.optim.SGD semantics). ``momentum_buffers`` are required when
    ``momentum != 0``; ``first_run`` means they are initialised to the (decayed) gradient.
    ``checked``: as :func:`multi_tensor_adam`."""
    if momentum != 0 and momentum_buffers is None:
        raise ValueError("multi_tensor_sgd: momentum_buffers are required when momentum != 0")
    if _compiled(params) and not (_choice.prefers_torch("sgd", params[0].device, params[0].dtype)
                                  and _torch_sgd_usable(params, momentum)
                                  and _torch_kernel_keeps_semantics(params, grads, model_copies)):
        # DTensors: through DTensor's dispatch (ops._dtensor), on their local shards
        _library.run(
            "multi_tensor_sgd", list(params), list(grads), list(momentum_buffers) if momentum != 0 else [],
            list(model_copies) if model_copies is not None else [],
            float(lr), float(momentum), float(dampening), float(weight_decay), bool(nesterov), bool(first_run),
            grad_scale, found_inf,
        )
        return
    params, grads, momentum_buffers, model_copies = local_shards(params, grads, momentum_buffers, model_copies)
    state = {"momentum_buffers": momentum_buffers} if momentum != 0 else {}
    if not checked:
        _check_optim_args("multi_tensor_sgd", params, grads, state, None, grad_scale, found_inf, model_copies)
    if params:
        _sgd_fallback(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, first_run,
                      grad_scale, found_inf, model_copies)


def _adadelta_fallback(params, grads, square_avgs, acc_deltas, steps, lr, rho, eps, weight_decay, grad_scale,
                       found_inf, model_copies) -> None:
    with _undone_if(found_inf, params, square_avgs, acc_deltas, steps, model_copies, _written(grads, grad_scale)):
        for i, p in enumerate(params):
            g = _unscaled_fp32(grads[i], grad_scale)
            steps[i].add_(1)
            pf, sq, acc = p.float(), square_avgs[i].float(), acc_deltas[i].float()
            if weight_decay != 0:
                g = g.add(pf, alpha=weight_decay)
            sq.mul_(rho).addcmul_(g, g, value=1 - rho)
            std = sq.add(eps).sqrt_()
            delta = acc.add(eps).sqrt_().div_(std).mul_(g)
            acc.mul_(rho).addcmul_(delta, delta, value=1 - rho)
            pf.add_(delta, alpha=-lr)
            _store(p, pf)
            _store(square_avgs[i], sq)
            _store(acc_deltas[i], acc)
            if model_copies is not None:
                model_copies[i].copy_(pf)


def multi_tensor_adadelta(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    square_avgs: Sequence[Tensor],
    acc_deltas: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float = 0.0,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    model_copies: Optional[Sequence[Tensor]] = None,
) -> None:
    """One Adadelta step in place (torch.optim.Adadelta semantics)."""
    if _compiled(params):  # DTensors: through DTensor's dispatch (ops._dtensor), on their local shards
        _library.run(
            "multi_tensor_adadelta", list(params), list(grads), list(square_avgs), list(acc_deltas), list(steps),
            list(model_copies) if model_copies is not None else [],
            float(lr), float(rho), float(eps), float(weight_decay), grad_scale, found_inf,
        )
        return
    params, grads, square_avgs, acc_deltas, model_copies = local_shards(
        params, grads, square_avgs, acc_deltas, model_copies)
    state = {"square_avgs": square_avgs, "acc_deltas": acc_deltas}
    _check_optim_args("multi_tensor_adadelta", params, grads, state, steps, grad_scale, found_inf, model_copies)
    if params:
        _adadelta_fallback(params, grads, square_avgs, acc_deltas, steps, lr, rho, eps, weight_decay, grad_scale,
                           found_inf, model_copies)


def _reduced_norms(op: str, reduce_norms: Callable[[Tensor], Tensor], squares: Tensor) -> Tensor:
    """``reduce_norms(squares)``, refused unless it is a tensor of ``squares``' shape, dtype and device."""
    out = reduce_norms(squares)
    if not isinstance(out, Tensor) or out.dtype != squares.dtype:
        raise TypeError(f"{op}: reduce_norms must return a {squares.dtype} tensor (the summed squared norms), "
                        f"got {getattr(out, 'dtype', type(out).__name__)}")
    if out.shape != squares.shape or out.device != squares.device:
        raise ValueError(f"{op}: reduce_norms must return shape {tuple(squares.shape)} on {squares.device}, "
                         f"got {tuple(out.shape)} on {out.device}")
    return out


def _lamb_fallback(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                   bias_correction, grad_averaging, adam_w_mode, global_grad_norm, max_grad_norm, use_nvlamb,
                   grad_scale, found_inf, model_copies, reduce_norms=None) -> None:
    """Per-tensor loops (torch has no fused LAMB) with no host synchronisation inside: clip factor,
    bias corrections and trust ratios stay tensors on the device. Two passes, as the kernels: the
    moments and the update with the squared norms of param and update, then (after ``reduce_norms``)
    the update applied with the trust ratio. A set ``found_inf`` puts back what was touched (every rank
    still joins ``reduce_norms``)."""
    with _undone_if(found_inf, params, exp_avgs, exp_avg_sqs, steps, model_copies, _written(grads, grad_scale)):
        gnorm = global_grad_norm.reshape(())
        clip = (gnorm / max_grad_norm).clamp_min(1.0) if max_grad_norm > 0 else 1.0
        beta3 = 1 - beta1 if grad_averaging else 1.0
        trust_ratio = weight_decay != 0 or use_nvlamb
        updates, squares = [], []
        for i, p in enumerate(params):
            g = _unscaled_fp32(grads[i], grad_scale) / clip
            steps[i].add_(1)
            step = steps[i].reshape(()).double()
            bc1 = (1 - beta1**step).float() if bias_correction else 1.0
            bc2 = (1 - beta2**step).float() if bias_correction else 1.0
            pf, m, v = p.float(), exp_avgs[i].float(), exp_avg_sqs[i].float()
            if weight_decay != 0 and not adam_w_mode:
                g = g.add(pf, alpha=weight_decay)
            m.mul_(beta1).add_(g, alpha=beta3)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = (m / bc1).div_((v / bc2).sqrt_().add_(eps))
            if weight_decay != 0 and adam_w_mode:
                update.add_(pf, alpha=weight_decay)
            _store(exp_avgs[i], m)
            _store(exp_avg_sqs[i], v)
            updates.append((pf, update))
            if trust_ratio:
                squares.append(torch.stack([pf.square().sum(), update.square().sum()]))
        if trust_ratio and params:
            squares = torch.stack(squares)
            if reduce_norms is not None:
                squares = _reduced_norms("multi_tensor_lamb", reduce_norms, squares)
            norms = squares.sqrt()
            trust = torch.where((norms[:, 0] != 0) & (norms[:, 1] != 0), norms[:, 0] / norms[:, 1], 1.0) * lr
        for i, (pf, update) in enumerate(updates):
            if trust_ratio:
                pf.sub_(update * trust[i])
            else:
                pf.add_(update, alpha=-lr)
            _store(params[i], pf)
            if model_copies is not None:
                model_copies[i].copy_(pf)


def multi_tensor_lamb(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    global_grad_norm: Tensor,
    max_grad_norm: float = 1.0,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    adam_w_mode: bool = True,
    use_nvlamb: bool = False,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    model_copies: Optional[Sequence[Tensor]] = None,
    reduce_norms: Optional[Callable[[Tensor], Tensor]] = None,
) -> None:
    """One LAMB step in place with apex FusedLAMB semantics.

    ``global_grad_norm`` (0-dim fp32) is the L2 norm of all *unscaled* grads of the optimizer;
    grads are divided by ``global_grad_norm / max_grad_norm`` when it exceeds ``max_grad_norm``
    (``max_grad_norm <= 0`` disables clipping). The per-tensor trust ratio
    ``||p|| / ||update||`` scales ``lr`` when ``weight_decay != 0`` or ``use_nvlamb``.

    ``reduce_norms`` (for sharded params: the tensors are local shards or DTensors): called with the
    ``[len(params), 2]`` squared norms of each local param and update (fp64 from the compiled
    kernels, fp32 from the fallback), it returns them summed over the ranks that hold the other
    shards of each tensor, same shape and dtype (the trust ratio is that of the whole tensor). The
    compiled kernels then run as two calls (``multi_tensor_lamb_moments``, the reduction,
    ``multi_tensor_lamb_apply``); with ``found_inf`` set both write nothing and the reduction still
    runs, so every rank joins it.
    """
    if global_grad_norm is None:
        raise TypeError("multi_tensor_lamb: global_grad_norm is required")
    trust_ratio = bool(weight_decay or use_nvlamb)
    if reduce_norms is not None and not trust_ratio:
        reduce_norms = None  # no trust ratio: the norms are not needed
    compiled = _compiled(params)
    dtensors = _library.is_dtensor(params)
    if dtensors and (reduce_norms is not None or not compiled):
        # the caller's reduction, or the fallback: on the local shards
        sharded = params if reduce_norms is None and trust_ratio else None
        params, grads, exp_avgs, exp_avg_sqs, model_copies = local_shards(
            params, grads, exp_avgs, exp_avg_sqs, model_copies)
        if sharded is not None:  # the fallback's squared norms summed by DTensor, as the kernels' (ops._dtensor)
            reduce_norms = _dtensor.partial_sum_reducer("multi_tensor_lamb", sharded)
        dtensors = False
    copies = list(model_copies) if model_copies is not None else []
    if compiled and reduce_norms is None and not (dtensors and trust_ratio):
        _library.run(
            "multi_tensor_lamb", list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps), copies,
            float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(bias_correction),
            bool(grad_averaging), bool(adam_w_mode), global_grad_norm, float(max_grad_norm), bool(use_nvlamb),
            grad_scale, found_inf,
        )
    elif compiled:
        squares = _library.run(
            "multi_tensor_lamb_moments", list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps),
            float(beta1), float(beta2), float(eps), float(weight_decay), bool(bias_correction), bool(grad_averaging),
            bool(adam_w_mode), global_grad_norm, float(max_grad_norm), grad_scale, found_inf,
        )
        if reduce_norms is not None:
            squares = _reduced_norms("multi_tensor_lamb", reduce_norms, squares)
        # DTensors: squares is Partial("sum") over the sharded mesh dims; lamb_apply takes it replicated, so
        # DTensor all-reduces it here (every rank joins, found_inf set or not)
        _library.run(
            "multi_tensor_lamb_apply", list(params), list(exp_avgs), list(exp_avg_sqs), list(steps), copies,
            float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(bias_correction),
            bool(adam_w_mode), bool(use_nvlamb), squares, found_inf,
        )
    else:
        state = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
        _check_optim_args("multi_tensor_lamb", params, grads, state, steps, grad_scale, found_inf, model_copies)
        if not params:
            return
        _check_scalar_tensor("multi_tensor_lamb", "global_grad_norm", global_grad_norm, params[0].device)
        _lamb_fallback(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                       bias_correction, grad_averaging, adam_w_mode, global_grad_norm, max_grad_norm, use_nvlamb,
                       grad_scale, found_inf, model_copies, reduce_norms)
