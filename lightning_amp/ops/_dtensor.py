"""DTensor sharding strategies for the multi-tensor operators ``torch.ops.lightning_amp.multi_tensor_*``.

Called with DTensors (FSDP2's ``fully_shard`` params, grads and optimizer state, DTensor tensor
parallelism), an operator goes through DTensor's own dispatch: DTensor asks the strategy registered
here for the placements, runs the operator on the local shards (the compiled kernel, in place) and
wraps what it returns. The strategy is one ``OpSpec`` that keeps every tensor where it is:

* the first list of the op (``params``, ``src``, ``tensors``) sets, element by element, the placements
  of every other per-element list (``grads``, ``exp_avgs``, ``model_copies``, ...): a list the op writes
  must already have them (a redistributed copy would take the writes, so a mismatch is refused: DTensor
  raises it as a RuntimeError naming the tensor); a list
  it only reads (``grads`` without a ``grad_scale``: the optimizer steps write them back unscaled only when
  given one) is redistributed to them by DTensor (a ``Partial`` grad is reduced first);
* single tensors (``found_inf``, ``grad_scale``, ``global_grad_norm``, ``sq_norms``) and the ``steps``
  counters are replicated: plain 0-dim tensors count as replicated (DTensor's rule for scalars), a
  ``Partial`` one is reduced before the kernel reads it. A ``found_inf`` the op writes is this rank's
  flag, as without DTensors (the AMP step all-reduces it across ranks);
* the per-element lists must not be ``Partial`` (an elementwise update of partial sums is not the update
  of their sum), except for ``multi_tensor_scale``, which is linear.

What the operators return (results of the local shards) gets the placement that DTensor reduces into
the value of the whole tensors, per mesh dimension: replicated where every input is replicated, else

* ``multi_tensor_scale``'s per-tensor flags: ``Partial("max")``;
* ``multi_tensor_l2norm``'s total and per-tensor norms: a 2-norm partial (DTensor's ``_NormPartial(2)``:
  squared, summed over the ranks, square root);
* ``multi_tensor_lamb_moments``' squared norms of param and update: ``Partial("sum")``, which
  ``multi_tensor_lamb_apply`` takes replicated: DTensor all-reduces them between the two passes, so LAMB's
  trust ratio is that of the whole tensor.

Those two reductions need one placement per mesh dimension for all the op's tensors: a call mixing, on
one mesh dimension, tensors sharded with tensors replicated is refused (call once per placement). The
one-pass ``multi_tensor_lamb`` computes the trust ratio from what it holds, so with the trust ratio on
it takes replicated params only (sharded ones use the two passes, see ``ops.multi_tensor_lamb``).

Registered with ``ShardingPropagator.register_op_strategy`` (an ``OpStrategy`` function), the mechanism
DTensor's own ops use: torch 2.13's public ``torch.distributed.tensor.experimental.register_sharding``
reads list arguments as one entry per list (its ``expand_to_full_mesh_op_strategy`` counts the
flattened inputs, a ``TupleStrategy`` is not flattened) and its per-mesh-dimension combinations cannot say
"every tensor keeps its placement" for lists of tensors with different placements; the foreach expansion
of ``register_single_dim_strategy`` is reserved to names starting ``aten::_foreach_``/``_fused_``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

try:  # the one import of the class for lightning_amp.ops (local_shards, the dispatch test, the strategies)
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None
try:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, RuntimeSchemaInfo, TupleStrategy
    from torch.distributed.tensor._ops._math_ops import _NormPartial
    from torch.distributed.tensor.placement_types import Partial, Replicate
except ImportError:  # no distributed, or a torch whose DTensor internals moved: no strategy is registered
    DTensorSpec = None

#: per-element lists that are not shaped like the params: one 0-dim counter per param, replicated
_SCALAR_LISTS = frozenset({"steps"})
#: the ops whose output DTensor reduces: one mesh per call (the elementwise ones take each element on its mesh,
#: as FSDP2 over a tensor-parallel model gives: some params on the 2-D mesh, others on the data-parallel one)
_REDUCED_OUTPUT = frozenset({"multi_tensor_scale", "multi_tensor_l2norm", "multi_tensor_lamb_moments"})
#: the ops whose per-element lists may be Partial (linear in them)
_LINEAR = frozenset({"multi_tensor_scale"})


def _spec(strategy) -> DTensorSpec:
    return strategy.strategies[0].output_spec


def _flat_args(op_schema) -> List[Tuple[str, Optional[int], DTensorSpec, bool, bool]]:
    """(arg name, list index or None, current spec, written by the op, is a list) for every tensor argument,
    in the order of ``op_schema.args_spec`` (DTensor's flattening of the args)."""
    out = []
    for arg, value in zip(op_schema.op._schema.arguments, op_schema.args_schema):
        written = arg.alias_info is not None and arg.alias_info.is_write
        if arg.name == "grads":  # the optimizer steps write the grads (unscaled) only when given a grad_scale
            written = written and _arg(op_schema, "grad_scale") is not None
        if isinstance(value, OpStrategy):
            out.append((arg.name, None, _spec(value), written, False))
        elif isinstance(value, TupleStrategy):
            out.extend((arg.name, i, _spec(child), written, True) for i, child in enumerate(value.children))
        elif isinstance(value, (list, tuple)):
            out.extend((arg.name, i, _spec(child), written, True) for i, child in enumerate(value)
                       if isinstance(child, OpStrategy))
    return out


def _arg(op_schema, name: str):
    for arg, value in zip(op_schema.op._schema.arguments, op_schema.args_schema):
        if arg.name == name:
            return value
    raise KeyError(name)


def _describe(spec: DTensorSpec) -> str:
    return f"{tuple(spec.placements)} on {spec.mesh}"


def _reduced_placements(op: str, specs: List[DTensorSpec], mesh, partial) -> tuple:
    """Per mesh dim: Replicate where every spec is replicated, ``partial`` where every one is not;
    a mix is refused (one output placement cannot reduce some rows and not others)."""
    placements = []
    for dim in range(mesh.ndim):
        replicated = [s.placements[dim].is_replicate() for s in specs]
        if all(replicated):
            placements.append(Replicate())
        elif not any(replicated):
            placements.append(partial)
        else:
            raise NotImplementedError(
                f"lightning_amp::{op} with DTensors: mesh dimension {dim} holds both replicated and sharded "
                "tensors; its reduced output needs one placement per mesh dimension (call it once per "
                "placement)")
    return tuple(placements)


def _strategy(op_schema) -> OpStrategy:
    op = op_schema.op.name().split("::")[-1]
    flat = _flat_args(op_schema)
    lists = [entry for entry in flat if entry[4] and entry[0] not in _SCALAR_LISTS]
    if not lists:
        raise NotImplementedError(f"lightning_amp::{op}: no tensor list among the DTensor arguments")
    lead = lists[0][0]
    reference = {i: spec for name, i, spec, _, _ in lists if name == lead}
    mesh = next(iter(reference.values())).mesh
    replicate = (Replicate(),) * mesh.ndim
    for i, spec in reference.items():
        if spec.mesh != mesh and op in _REDUCED_OUTPUT:
            raise NotImplementedError(f"lightning_amp::{op}: {lead}[{i}] is on {spec.mesh}, {lead}[0] on {mesh}: "
                                      "its reduced output needs one mesh per call")
        if op not in _LINEAR and any(p.is_partial() for p in spec.placements):
            raise NotImplementedError(f"lightning_amp::{op}: {lead}[{i}] is Partial ({_describe(spec)}); "
                                      "an elementwise update needs the values themselves (redistribute it first)")
    desired = []
    for name, i, spec, written, is_list in flat:
        if is_list and name not in _SCALAR_LISTS:
            want = reference[i] if name != lead else spec
            if written and (spec.mesh != want.mesh or spec.placements != want.placements):
                raise ValueError(f"lightning_amp::{op}: {name}[{i}] is {_describe(spec)} but {lead}[{i}] is "
                                 f"{_describe(want)}; a tensor the op writes must have the placements of {lead}[{i}]")
        else:  # steps, found_inf, grad_scale, global_grad_norm, sq_norms
            want = DTensorSpec(spec.mesh, replicate[:spec.mesh.ndim], tensor_meta=spec.tensor_meta)
            if written and spec.placements != want.placements:
                raise ValueError(f"lightning_amp::{op}: {name} is {_describe(spec)}; the op writes it: give a "
                                 "replicated DTensor or a plain tensor")
        desired.append(DTensorSpec(want.mesh, want.placements, tensor_meta=spec.tensor_meta,
                                   use_strided_shard_as_shard_order=want.use_strided_shard_as_shard_order))
    specs = [reference[i] for i in sorted(reference)]
    if op == "multi_tensor_scale":
        output = DTensorSpec(mesh, tuple(Replicate() if all(s.placements[d].is_replicate() for s in specs)
                                         else Partial("max") for d in range(mesh.ndim)))
    elif op == "multi_tensor_l2norm":
        placements = _reduced_placements(op, specs, mesh, _NormPartial(2))
        output = (DTensorSpec(mesh, placements), DTensorSpec(mesh, placements))
    elif op == "multi_tensor_lamb_moments":
        output = DTensorSpec(mesh, _reduced_placements(op, specs, mesh, Partial("sum")))
    else:
        output = None
        if op == "multi_tensor_lamb" and (_arg(op_schema, "weight_decay") or _arg(op_schema, "use_nvlamb")):
            if any(not p.is_replicate() for s in specs for p in s.placements):
                raise NotImplementedError(
                    "lightning_amp::multi_tensor_lamb: the trust ratio of sharded params needs the norms of the "
                    "whole tensors, which this one-pass kernel does not see; call multi_tensor_lamb_moments, "
                    "then multi_tensor_lamb_apply (DTensor all-reduces the squared norms between them), as "
                    "lightning_amp.ops.multi_tensor_lamb does")
    return OpStrategy([OpSpec(output_specs=output, input_specs=desired,
                              redistribute_cost=[[0.0] for _ in desired])])


#: the operators that take lists of tensors (the wgrad GEMMs take single tensors: not registered)
MULTI_TENSOR_OPS = ("multi_tensor_scale", "multi_tensor_check_finite", "multi_tensor_l2norm", "multi_tensor_adam",
                    "multi_tensor_sgd", "multi_tensor_adadelta", "multi_tensor_lamb", "multi_tensor_lamb_moments",
                    "multi_tensor_lamb_apply")


def register(namespace) -> bool:
    """Register :func:`_strategy` for every op of :data:`MULTI_TENSOR_OPS` in ``namespace``
    (``torch.ops.lightning_amp``); False when this torch has no DTensor or not the internals used here."""
    if DTensor is None or DTensorSpec is None:
        return False
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in MULTI_TENSOR_OPS:
        # needs_pytree: the lists are flattened into their tensors; the floats and flags after them are part of
        # the cache key (static_argnum past the last list: every non-tensor argument is hashed)
        propagator.register_op_strategy(getattr(namespace, name).default, _strategy,
                                        RuntimeSchemaInfo(static_argnum=0, needs_pytree=True))
    return True


def partial_sum_reducer(op: str, tensors):
    """A ``reduce_norms`` for the pure-PyTorch LAMB on the local shards of the DTensors ``tensors``: the
    rows of local squared norms are made a ``Partial("sum")`` DTensor on the sharded mesh dims (as
    ``multi_tensor_lamb_moments``' output) and DTensor reduces them to replicated values."""
    specs = [t._spec for t in tensors]
    mesh = specs[0].mesh
    placements = _reduced_placements(op, specs, mesh, Partial("sum"))
    replicate = (Replicate(),) * mesh.ndim

    def reduce(squares: torch.Tensor) -> torch.Tensor:
        partial = DTensor.from_local(squares, mesh, placements, run_check=False)
        return partial.redistribute(mesh, replicate).to_local()

    return reduce
