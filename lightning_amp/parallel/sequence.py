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
    gathered_inputs: dict[str, int] = field(default_factory=dict)  # sub-module -> seq dim gathered at its input


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


def plan_runs(module: nn.Module, decisions: dict[str, str], sequence_dim: Optional[int]) -> tuple[list[Run], dict[str, dict]]:
    """The runs of blocks holding the planned layers, and per planned layer the extra kwargs
    (``sequence_parallel``, ``sequence_dim``, ``kv_sequence_parallel`` for attention)."""
    blocks: dict[str, int] = {}
    layer_kwargs: dict[str, dict] = {}
    gathered: dict[str, int] = {}
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
                gathered[parent_name] = seq_dim
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
    for parent_name, seq_dim in gathered.items():
        run = next(r for r in runs if any(parent_name.startswith(b + ".") for b in r.names))
        run.gathered_inputs[parent_name] = seq_dim
    return runs, layer_kwargs


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
    """Forward hooks of one run: scatter at the first block's input, gather at the last block's output."""

    def __init__(self, run: Run, blocks: list[nn.Module], group: Any) -> None:
        self.run, self.blocks, self.group = run, blocks, group
        self._handed: Optional[Tensor] = None  # output of the previous block of the run, in flight
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post(i)))

    def _pre(self, i: int):
        def hook(block, args, kwargs):
            if not args or not isinstance(args[0], Tensor):
                raise RuntimeError(f"sequence_parallel: block {self.run.names[i]!r} must take the hidden states as its first positional argument")
            x = args[0]
            if i == 0:
                self._handed = None
                x = comm.scatter_to_sequence_parallel_region(x, self.group, self.run.seq_dim)
                return (x, *args[1:]), kwargs
            handed, self._handed = self._handed, None
            if handed is None or x is not handed:
                raise RuntimeError(
                    f"sequence_parallel: block {self.run.names[i]!r} was not called with the output of "
                    f"{self.run.names[i - 1]!r}; blocks of one container must be chained (x = block(x)) "
                    "for the sequence to stay split between them. Use sequence_parallel=False for this model"
                )
            return None
        return hook

    def _post(self, i: int):
        last = i == len(self.blocks) - 1

        def hook(block, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if not last:
                self._handed = hidden
                return None
            # what follows the run is computed redundantly on every TP rank: its grad is whole, keep own chunk
            full = comm.gather_from_sequence_parallel_region(hidden, self.group, self.run.seq_dim, tensor_parallel_output_grad=False)
            return (full, *output[1:]) if isinstance(output, tuple) else full
        return hook


def _gather_input_hook(name: str, group: Any, seq_dim: int, inside: list):
    """Pre-hook of a block's sub-module whose column layers take the full sequence: all-gather its
    hidden states (first positional arg, else ``hidden_states=``). Its column layers all-reduce their
    input grad, so the gather's backward only keeps this rank's chunk."""
    def hook(sub, args, kwargs):
        inside[0] += 1
        if args and isinstance(args[0], Tensor):
            x = comm.gather_from_sequence_parallel_region(args[0], group, seq_dim, tensor_parallel_output_grad=False)
            return (x, *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), Tensor):
            x = comm.gather_from_sequence_parallel_region(kwargs["hidden_states"], group, seq_dim, tensor_parallel_output_grad=False)
            return args, {**kwargs, "hidden_states": x}
        raise RuntimeError(f"sequence_parallel: {name!r} must take the hidden states as its first positional "
                           "argument or as hidden_states=")
    return hook


def install_boundaries(module: nn.Module, runs: list[Run], group: Any) -> list[_RunBoundaries]:
    """Hook every run's scatter/gather (and the gathers at sub-module inputs) and mark the replicated
    params of its blocks."""
    installed = []
    for run in runs:
        blocks = [module.get_submodule(n) for n in run.names]
        for block in blocks:
            mark_replicated_params(block)
        installed.append(_RunBoundaries(run, blocks, group))
        for name, seq_dim in run.gathered_inputs.items():
            sub = module.get_submodule(name)
            inside = [0]  # > 0 while sub.forward runs
            handles = installed[-1].handles
            handles.append(sub.register_forward_pre_hook(_gather_input_hook(name, group, seq_dim, inside), with_kwargs=True))
            handles.append(sub.register_forward_hook(lambda *_, inside=inside: inside.__setitem__(0, inside[0] - 1)))
            for child_name, child in sub.named_children():
                if getattr(child, "sequence_parallel", None) is False and hasattr(child, "gather_output"):
                    handles.append(child.register_forward_pre_hook(_only_inside(f"{name}.{child_name}", name, inside)))
    return installed


def _only_inside(child: str, parent: str, inside: list):
    """A column layer that relies on its parent's gathered input must not be called from elsewhere."""
    def hook(layer, args):
        if inside[0] <= 0:
            raise RuntimeError(
                f"sequence_parallel: {child!r} was called outside {parent!r}.forward, so its input was not gathered "
                "along the sequence; call the projections from their parent module's forward or use sequence_parallel=False"
            )
    return hook
