"""Sequence parallelism for the automatic plan: where the sequence is scattered and gathered.

Megatron semantics: between the tensor-parallel layers of a *block* (LayerNorm, dropout, residual
adds) activations are split along the sequence dim over the TP group; a column layer all-gathers
its input along the sequence (its backward reduce-scatters), a row layer reduce-scatters its output
along the sequence. Replicated params inside a block then see only this rank's tokens: they are
marked ``sequence_parallel`` and their grads all-reduced over TP (``main_grad.py``).

A block is the ancestor of a converted layer that is an entry of an ``nn.ModuleList`` or
``nn.Sequential`` (``nn.TransformerEncoder.layers``, ``model.layers[i]``, ``model.h[i]`` ...). Blocks
that are consecutive entries of one container form a *run*: the run's first block scatters its
first positional input, its last block gathers its output (first element when a tuple), so the
model outside the run, and the user's loss, see full sequences. Inside a run each block must be
called with the previous block's output (checked at run time).

The sequence dim of a block's input: ``nn.TransformerEncoderLayer``/``DecoderLayer`` know it from
``batch_first`` (0 for ``[s, b, h]``, 1 for ``[b, s, h]``); other blocks take ``sequence_dim``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

from torch import Tensor, nn

from lightning_amp.parallel import comm

_TORCH_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def validate_sequence_dim(sequence_dim: Optional[int]) -> None:
    if sequence_dim is not None and (isinstance(sequence_dim, bool) or sequence_dim not in (0, 1)):
        raise ValueError(
            f"sequence_dim must be None (infer from nn.Transformer*Layer.batch_first), 0 ([seq, batch, hidden]) "
            f"or 1 ([batch, seq, hidden]), got {sequence_dim!r}"
        )


@dataclass
class Run:
    """Consecutive blocks of one container; ``names`` in call order."""

    container: str
    names: list[str] = field(default_factory=list)
    seq_dim: int = 0
    gathered_inputs: list[str] = field(default_factory=list)  # sub-modules gathered at their input (along seq_dim)


def _block_of(module: nn.Module, name: str) -> Optional[str]:
    """Nearest ancestor of ``name`` (excluding itself) that is an entry of a ModuleList/Sequential."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = module.get_submodule(".".join(parts[:i - 1])) if i > 1 else module
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            return ".".join(parts[:i])
    return None


def _block_seq_dim(block_name: str, block: nn.Module, sequence_dim: Optional[int]) -> int:
    if isinstance(block, _TORCH_LAYERS):
        own = 1 if block.self_attn.batch_first else 0
        if sequence_dim is not None and sequence_dim != own:
            raise ValueError(
                f"sequence_dim={sequence_dim} contradicts {block_name!r} ({type(block).__name__}, "
                f"batch_first={block.self_attn.batch_first}); leave sequence_dim=None"
            )
        return own
    if sequence_dim is None:
        raise ValueError(
            f"sequence_parallel=True: the sequence dim of block {block_name!r} ({type(block).__name__}) is unknown; "
            "pass sequence_dim=0 ([seq, batch, hidden]) or 1 ([batch, seq, hidden])"
        )
    return sequence_dim


@dataclass
class SequencePlan:
    """Where sequence parallelism splits the sequence: the runs of blocks holding the planned layers, and per planned
    layer the keywords its parallel layer takes (``sequence_parallel``, ``sequence_dim``, ``kv_sequence_parallel``)."""

    runs: list[Run]
    layer_kwargs: dict[str, dict]

    def describe(self) -> list[str]:
        """One line per run, as the plan and the conversion report print it."""
        return [f"{run.container}: {len(run.names)} block(s), sequence dim {run.seq_dim} split between them"
                for run in self.runs]


def plan_runs(module: nn.Module, units: list, decisions: dict[str, str], sequence_dim: Optional[int]) -> SequencePlan:
    """The :class:`SequencePlan` of a plan checked for ``module``: its ``units`` and ``decisions`` (per split layer,
    "column", "row" or "attention"); ValueError, naming the layers, for a plan that splits nothing, a column layer
    without a row partner, or a layer outside any block (see the module docstring)."""
    if not units:
        raise ValueError(f"sequence_parallel=True: the plan found no layer of {type(module).__name__} to split")
    lone = [c for u in units if not u.rows for c in u.columns]
    if lone:
        raise ValueError(f"sequence_parallel=True: column layers {lone} have no row-parallel partner")
    blocks: dict[str, int] = {}
    layer_kwargs: dict[str, dict] = {}
    gathered: list[str] = []
    for name, kind in decisions.items():
        block_name = _block_of(module, name)
        if block_name is None:
            raise ValueError(
                f"sequence_parallel=True: {name!r} is not inside a block held by an nn.ModuleList/nn.Sequential, "
                "so the sequence scatter/gather boundaries cannot be placed; use sequence_parallel=False"
            )
        block = module.get_submodule(block_name)
        seq_dim = blocks.setdefault(block_name, _block_seq_dim(block_name, block, sequence_dim))
        if kind == "attention":
            cross = isinstance(block, nn.TransformerDecoderLayer) and module.get_submodule(name) is block.multihead_attn
            layer_kwargs[name] = dict(sequence_parallel=True, kv_sequence_parallel=not cross)
        else:
            parent_name = name.rpartition(".")[0]
            if parent_name != block_name and not isinstance(block, _TORCH_LAYERS):
                # a sub-module (attention, MLP) of the block: gathered once at its input, so its own code
                # (which may read the sequence length from its input) sees the full sequence
                if parent_name not in gathered:
                    gathered.append(parent_name)
                layer_kwargs[name] = dict(sequence_parallel=kind == "row", sequence_dim=seq_dim)
            else:
                layer_kwargs[name] = dict(sequence_parallel=True, sequence_dim=seq_dim)
    runs: list[Run] = []
    for block_name in sorted(blocks, key=lambda n: module_index(module, n)):
        container, _, index = block_name.rpartition(".")
        last = runs[-1] if runs else None
        if (last is not None and last.container == container and last.seq_dim == blocks[block_name]
                and int(last.names[-1].rpartition(".")[2]) + 1 == int(index)):
            last.names.append(block_name)
        else:
            runs.append(Run(container, [block_name], blocks[block_name]))
    for parent_name in gathered:
        run = next(r for r in runs if any(parent_name.startswith(b + ".") for b in r.names))
        run.gathered_inputs.append(parent_name)
    return SequencePlan(runs, layer_kwargs)


def module_index(module: nn.Module, name: str) -> int:
    """Position of ``name`` in ``named_modules()`` order (registration order)."""
    for i, (n, _) in enumerate(module.named_modules()):
        if n == name:
            return i
    raise KeyError(name)


def mark_replicated_params(block: nn.Module) -> list[str]:
    """Mark every param of ``block`` that is not a tensor-parallel shard ``sequence_parallel``; returns their names.
    Params whose gradient autograd already sums over the TP group (``grad_reduced_over_tp``: replicated
    key/value heads, :mod:`~lightning_amp.parallel.fused_qkv`) are left alone."""
    marked = []
    for name, p in block.named_parameters():
        if not getattr(p, "tensor_model_parallel", False) and not getattr(p, "grad_reduced_over_tp", False):
            p.sequence_parallel = True
            marked.append(name)
    return marked


class _RunBoundaries:
    """The forward hooks of one run of ``module`` (see the module docstring): the sequence is split at the first
    block's input and gathered at the last block's output and at the input of every sub-module in
    ``run.gathered_inputs``; a column layer that relies on such a gather refuses a call from outside its parent's
    forward. ``handles``: every hook's removable handle."""

    def __init__(self, module: nn.Module, run: Run, group: Any) -> None:
        self.run, self.group = run, group
        self._handed: Optional[Tensor] = None  # output of the previous block of the run, in flight
        self._running = dict.fromkeys(run.gathered_inputs, 0)  # per gathered sub-module: its forward calls running
        self.handles = []
        last = len(run.names) - 1
        for i, name in enumerate(run.names):
            block = module.get_submodule(name)
            self.handles.append(block.register_forward_pre_hook(partial(self._block_input, i), with_kwargs=True))
            self.handles.append(block.register_forward_hook(partial(self._block_output, i == last)))
        for name in run.gathered_inputs:
            sub = module.get_submodule(name)
            self.handles.append(sub.register_forward_pre_hook(partial(self._sub_input, name), with_kwargs=True))
            self.handles.append(sub.register_forward_hook(partial(self._sub_output, name)))
            for child_name, child in sub.named_children():
                if getattr(child, "sequence_parallel", None) is False and hasattr(child, "gather_output"):
                    self.handles.append(child.register_forward_pre_hook(partial(self._only_inside, name, f"{name}.{child_name}")))

    def _block_input(self, i: int, block: nn.Module, args: tuple, kwargs: dict):
        """Pre-hook of block ``i``: the first one splits its hidden states; the others must get the previous one's."""
        if not args or not isinstance(args[0], Tensor):
            raise RuntimeError(f"sequence_parallel: block {self.run.names[i]!r} must take the hidden states as its first "
                               "positional argument")
        if i == 0:
            self._handed = None
            return (self._split(args[0]), *args[1:]), kwargs
        handed, self._handed = self._handed, None
        if handed is None or args[0] is not handed:
            raise RuntimeError(
                f"sequence_parallel: block {self.run.names[i]!r} was not called with the output of "
                f"{self.run.names[i - 1]!r}; blocks of one container must be chained (x = block(x)) "
                "for the sequence to stay split between them. Use sequence_parallel=False for this model"
            )
        return None

    def _block_output(self, last: bool, block: nn.Module, args: tuple, output: Any):
        """Post-hook of a block: hands its hidden states to the next block, or (the last) gathers them whole."""
        hidden = output[0] if isinstance(output, tuple) else output
        if not last:
            self._handed = hidden
            return None
        full = self._gather(hidden)
        return (full, *output[1:]) if isinstance(output, tuple) else full

    def _sub_input(self, name: str, sub: nn.Module, args: tuple, kwargs: dict):
        """Pre-hook of a sub-module whose column layers take the full sequence: gathers its hidden states (first
        positional argument, else ``hidden_states=``)."""
        self._running[name] += 1
        if args and isinstance(args[0], Tensor):
            return (self._gather(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), Tensor):
            return args, {**kwargs, "hidden_states": self._gather(kwargs["hidden_states"])}
        raise RuntimeError(f"sequence_parallel: {name!r} must take the hidden states as its first positional "
                           "argument or as hidden_states=")

    def _sub_output(self, name: str, sub: nn.Module, args: tuple, output: Any) -> None:
        self._running[name] -= 1

    def _only_inside(self, parent: str, child: str, layer: nn.Module, args: tuple) -> None:
        """Pre-hook of a column layer that relies on its parent's gathered input: it must be called from there."""
        if self._running[parent] <= 0:
            raise RuntimeError(
                f"sequence_parallel: {child!r} was called outside {parent!r}.forward, so its input was not "
                "gathered along the sequence; call the projections from their parent module's forward or use "
                "sequence_parallel=False"
            )

    def _split(self, x: Tensor) -> Tensor:
        """``x`` entering the run: this rank's chunk of the sequence (gathered back in backward)."""
        return comm.scatter_to_sequence_parallel_region(x, self.group, self.run.seq_dim)

    def _gather(self, x: Tensor) -> Tensor:
        """``x`` leaving the run, or entering a sub-module that takes the full sequence: the whole sequence. What
        follows is computed alike on every TP rank (the column layers all-reduce their input gradient), so its gradient
        is whole: the backward keeps this rank's chunk."""
        return comm.gather_from_sequence_parallel_region(x, self.group, self.run.seq_dim,
                                                         tensor_parallel_output_grad=False)


def install_boundaries(module: nn.Module, runs: list[Run], group: Any) -> list[_RunBoundaries]:
    """Mark the replicated params of every run's blocks and hook its boundaries (:class:`_RunBoundaries`)."""
    for run in runs:
        for name in run.names:
            mark_replicated_params(module.get_submodule(name))
    return [_RunBoundaries(module, run, group) for run in runs]
