"""O2 under FSDP2 (``fully_shard``): FSDP2's own mixed precision makes the half copies.

Under FSDP2 the module's Parameters are fp32 DTensor shards (1/N per rank): they are O2's fp32
params, stepped shard by shard by the optimizer. Autocast alone would cast them after FSDP2's
all-gather, which would then gather fp32 (twice the bytes) and hold fp32 and half whole params at
once. FSDP2's ``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)`` does what O2 needs
in the all-gather itself: each group of params is gathered as half for its forward and backward and
freed after, and the half grads are reduce-scattered in fp32 into fp32 sharded grads, so the fp32
params are never gathered whole on one rank.

:func:`fsdp2_half_compute_` gives every FSDP2 group of ``module`` that policy, before the first
forward:

* a group left at the default policy (``fully_shard`` without ``mp_policy``) gets it set;
* a group whose policy already says ``param_dtype=dtype, reduce_dtype=torch.float32`` is kept (other
  fields, such as ``output_dtype``, are the user's);
* any other policy raises ValueError naming the module, its policy and the one to pass;
* with ``keep_batchnorm_fp32``, a group holding only BatchNorm params keeps fp32 compute
  (``param_dtype=None``); a BatchNorm sharded in one group with other layers would be computed in
  half and raises ValueError saying to ``fully_shard`` it on its own first;
* a floating param that no ``fully_shard`` manages, or a managed param that is not fp32, raises
  ValueError (the fix is in the message).

Setting a policy after ``fully_shard`` writes FSDP2's private state (the policy is read at its lazy
initialisation, on the first forward): the state's copy (inputs' and outputs' casts) and each param's; up to
torch 2.14 also the group's, from which the params' dtypes are set (from 2.15 each param's own is read; checked
with torch 2.11, 2.13 and 2.15). Where that state is not as expected, or the model already ran forward, the
ValueError asks for ``mp_policy`` in ``fully_shard``.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _fsdp2():
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    return FSDPModule, MixedPrecisionPolicy, fully_shard


def _groups(state) -> list:
    """The FSDPParamGroups of one FSDP2 state (a list from torch 2.13, one group or None before)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _states(module: nn.Module) -> List[Tuple[str, object]]:
    """(name of the first module, state) of every FSDP2 state in ``module``, each once, outermost first."""
    FSDPModule, _, fully_shard = _fsdp2()
    seen, found = set(), []
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            state = fully_shard.state(sub)
            if id(state) not in seen:
                seen.add(id(state))
                found.append((name or "<root>", state))
    return found


def is_fsdp2(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or one of its submodules."""
    FSDPModule, _, _ = _fsdp2()
    return any(isinstance(sub, FSDPModule) for sub in module.modules())


def _policy_text(policy) -> str:
    return f"MixedPrecisionPolicy(param_dtype={policy.param_dtype}, reduce_dtype={policy.reduce_dtype})"


def _fix(dtype: torch.dtype) -> str:
    return f"fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype=torch.float32))"


def _check_fp32(name: str, params: list, managed: set) -> None:
    """Every managed param fp32 (O2's params); records the ids of the params in ``managed``."""
    for fp in params:
        param = fp.sharded_param
        managed.add(id(param))
        if param.is_floating_point() and param.dtype != torch.float32:
            raise ValueError(
                f"lightning_amp O2 under FSDP2: param {fp._module_info.param_name!r} of fully_shard group {name!r} is "
                f"{param.dtype}; O2's params are the fp32 sharded params: leave the model fp32 before fully_shard "
                "(the plugin's policy makes the half copies)."
            )


def _batchnorm_only(name: str, params: list, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> bool:
    """Whether the group holds only kept-fp32 BatchNorm params; raises if it holds them with others."""
    if not keep_batchnorm_fp32:
        return False
    is_bn = [isinstance(fp._module_info.module, _BatchNorm) for fp in params]
    if not any(is_bn):
        return False
    if not all(is_bn):
        bns = sorted({type(fp._module_info.module).__name__ for fp, bn in zip(params, is_bn) if bn})
        raise ValueError(
            f"lightning_amp O2 under FSDP2: fully_shard group {name!r} holds {', '.join(bns)} params together with "
            f"other layers, so FSDP2 would compute that BatchNorm in {dtype}; O2 keeps BatchNorm fp32 "
            "(keep_batchnorm_fp32=True): call fully_shard(<the BatchNorm>, mesh=...) on each BatchNorm before its "
            "parent's fully_shard, or pass keep_batchnorm_fp32=False."
        )
    return True


def _policy_to_set(name: str, state, params: list, dtype: torch.dtype, bn_only: bool):
    """None when the group's policy already is O2's; O2's policy when the group has FSDP2's default;
    raises otherwise."""
    _, MixedPrecisionPolicy, _ = _fsdp2()
    policy = getattr(state, "_mp_policy", None)
    if policy is None:
        raise ValueError(f"lightning_amp O2 under FSDP2: cannot read the policy of fully_shard group {name!r} with "
                         f"this torch; pass {_fix(dtype)} to fully_shard.")
    fp32 = (None, torch.float32)
    if bn_only:
        if policy.param_dtype in fp32 and policy.reduce_dtype in fp32:
            return None  # FSDP2's default: computes in the params' fp32
        raise ValueError(
            f"lightning_amp O2 under FSDP2: fully_shard group {name!r} (BatchNorm only) has {_policy_text(policy)}; "
            "O2 keeps BatchNorm fp32 (keep_batchnorm_fp32=True): pass no mp_policy to that fully_shard."
        )
    if (policy.param_dtype, policy.reduce_dtype) == (dtype, torch.float32):
        return None
    if policy != MixedPrecisionPolicy():
        raise ValueError(
            f"lightning_amp O2 under FSDP2: fully_shard group {name!r} has {_policy_text(policy)}; O2 at {dtype} "
            f"computes in {dtype} and reduces gradients in fp32: pass {_fix(dtype)} to that fully_shard, or no "
            "mp_policy (the plugin sets it)."
        )
    if getattr(state, "_is_root", None) is not None or not all(hasattr(fp, "mp_policy") for fp in params):
        raise ValueError(
            f"lightning_amp O2 under FSDP2: cannot set the policy of fully_shard group {name!r} (it already ran "
            f"forward, or this torch's FSDP2 keeps it elsewhere); pass {_fix(dtype)} to fully_shard."
        )
    # the inputs as they come, as on one device (autocast reconciles them), not cast at every group's entry
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def fsdp2_half_compute_(module: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
    """Check or set the O2 policy of every FSDP2 group of ``module`` (see the module docstring).

    Raises ValueError, before anything is changed, when a group cannot compute O2 as asked."""
    managed: set = set()  # ids of the params some fully_shard manages
    plans = []
    for name, state in _states(module):
        groups = _groups(state)
        params = [fp for group in groups for fp in group.fsdp_params]
        _check_fp32(name, params, managed)
        wanted = _policy_to_set(name, state, params, dtype, _batchnorm_only(name, params, dtype, keep_batchnorm_fp32))
        if wanted is not None:
            plans.append((state, groups, wanted))
    unmanaged = [name for name, p in module.named_parameters() if p.is_floating_point() and id(p) not in managed]
    if unmanaged:
        raise ValueError(
            f"lightning_amp O2 under ModelParallelStrategy needs every param sharded by fully_shard (FSDP2 makes O2's "
            f"half copies); not sharded: {', '.join(unmanaged[:5])}{' ...' if len(unmanaged) > 5 else ''}. Call "
            "fully_shard on the root module last (Trainer: fully_shard(self, mesh=self.device_mesh['data_parallel']) "
            "in configure_model; Fabric: in parallelize_fn), also with data_parallel_size=1, or use O1."
        )
    for state, groups, wanted in plans:
        state._mp_policy = wanted
        for group in groups:
            if hasattr(group, "mp_policy"):  # torch <= 2.14: the params' dtypes are set from the group's policy
                group.mp_policy = wanted
            for fp in group.fsdp_params:
                fp.mp_policy = wanted
