"""ColumnParallelLinear and RowParallelLinear (Megatron semantics) and their one GEMM autograd function.

Column: ``W`` [out, in] is split along ``out``; each rank holds ``W[r*out/tp:(r+1)*out/tp]`` and its
bias slice. Row: ``W`` is split along ``in``; the bias is replicated and added after the reduction.

Backward of the GEMM (:class:`LinearWithAsyncGradComm`): ``grad_input = grad_output @ W`` is computed
first and its collective (all-reduce for a column layer, reduce-scatter under sequence parallelism)
is launched with ``async_op=True``; the weight gradient is then accumulated *while it is in flight*,
straight into the fp32 ``weight.main_grad`` by ``ops.wgrad_gemm_accum_fp32`` when
``config.gradient_accumulation_fusion`` is on *and* a ``main_grad`` is attached to the weight (the
"tp_fused" strategy's :class:`~lightning_amp.parallel.main_grad.MainGradBuffer` does; by hand:
``w.main_grad = torch.zeros_like(w, dtype=torch.float32)``); otherwise (a standalone layer with a plain
optimizer) it is returned as an ordinary ``weight.grad``. Finally the collective is waited on.

After a fused accumulation the layer tells the owner of ``main_grad`` as Megatron-LM does: a weight
that carries the attribute ``grad_added_to_main_grad`` (a :class:`MainGradBuffer` sets it to False on
its params) gets it set to True and receives a dummy gradient, so that its post-accumulate-grad hook
runs, skips the add and marks the param ready for the data-parallel all-reduce; a weight without the
attribute (``main_grad`` attached by hand) receives no gradient. The dummy is zeros when the param still
holds a ``.grad`` (autograd adds into it in place) or anomaly detection is on, uninitialised memory
otherwise (the hook drops it unread).

Under ``torch.compile`` the same function traces without a graph break (its backward has no Python side
effect: ``main_grad`` is a tensor input, the collectives are functional, no flag is set; see
:class:`LinearWithAsyncGradComm` and :meth:`_ParallelLinearBase._gemm`); eager calls take the path above.

Sharded weights carry ``tensor_model_parallel = True``, ``partition_dim`` (0 column, 1 row) and a
:class:`ShardLayout` (``shard_layout``) that maps between the shard and the *original* module's tensor
(which may be transposed, as GPT-2's ``Conv1D``, or a fused ``[q; k; v]`` split per chunk);
replicated params whose gradient is partial under sequence parallelism carry ``sequence_parallel = True``
(their grads must be all-reduced over the TP group; see ``main_grad.py``).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_amp import ops
from lightning_amp.parallel import comm
from lightning_amp.parallel.config import TensorParallelConfig
from lightning_amp.parallel.groups import group_rank, group_size

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # others (fp64) take the ordinary weight.grad path
_DEFAULT_CONFIG = TensorParallelConfig()


class ShardLayout:
    """How one sharded param relates to the full tensor of the module it replaced.

    ``dim``: the split dim in the parallel layer's own ``[out, in]`` layout (0 or 1; 0 for biases).
    ``chunks``: the full tensor is ``chunks`` equal blocks along ``dim`` (a fused ``[q; k; v]`` has 3)
    and every rank holds its slice *of each block*, concatenated. ``blocks``: the block sizes when they
    differ (litgpt's ``[q | k | v]`` with fewer key/value heads: ``(n_head*hs, groups*hs, groups*hs)``);
    it overrides ``chunks``. ``transposed``: the original module stores the 2-D weight as ``[in, out]``
    (``transformers``' ``Conv1D``). :meth:`shard` and :meth:`gather` are exact inverses; ``gather`` is a
    collective over ``group``.
    """

    def __init__(self, dim: int, group: Any, chunks: int = 1, transposed: bool = False,
                 blocks: Optional[tuple[int, ...]] = None) -> None:
        self.dim, self.group, self.transposed = dim, group, transposed
        self.blocks = tuple(blocks) if blocks is not None else None
        self.chunks = len(self.blocks) if self.blocks is not None else chunks
        self.size, self.rank = group_size(group), group_rank(group)

    def _split(self, tensor: Tensor, parts: int) -> tuple[Tensor, ...]:
        """``tensor`` (the full tensor when ``parts`` is 1, one rank's shard when ``parts`` is the TP size)
        as its blocks along ``dim``."""
        if self.blocks is None:
            return tensor.chunk(self.chunks, self.dim)
        return tensor.split([b // parts for b in self.blocks], self.dim)

    def shard(self, full: Tensor) -> Tensor:
        """This rank's shard (a new tensor, parallel-layer layout) of a full original-layout tensor."""
        if self.transposed and full.dim() == 2:
            full = full.t()
        blocks = self._split(full.detach(), 1)
        return torch.cat([b.chunk(self.size, self.dim)[self.rank] for b in blocks], self.dim).clone()

    def gather(self, shard: Tensor) -> Tensor:
        """The full tensor in the original module's layout from every rank's shard (collective)."""
        full = comm.gather_along(shard.detach(), self.dim, self.group)
        if self.chunks > 1 and self.size > 1:  # rank-major [r0: b0 b1 b2, r1: ...] -> block-major
            pieces = [self._split(p, self.size) for p in full.chunk(self.size, self.dim)]
            full = torch.cat([pieces[r][b] for b in range(self.chunks) for r in range(self.size)], self.dim)
        if self.transposed and full.dim() == 2:
            full = full.t().contiguous()
        return full


def _compute_dtype(x: Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class LinearWithAsyncGradComm(torch.autograd.Function):
    """``y = x W^T + b``; see the module docstring for the backward schedule.

    ``dgrad_comm``: "none" | "all_reduce" | "reduce_scatter" applied to grad_input over ``group``;
    ``sequence_parallel``: all-gather ``x`` along ``seq_dim`` in forward (the reduce-scatter of
    grad_input is then the adjoint). Under autocast the GEMM runs in the autocast dtype.

    Eager: ``param`` is the layer's registered weight Parameter, whose ``main_grad`` (read in backward)
    takes the fused wgrad (``weight`` is what forward reads: the same Parameter, or FSDP2's all-gathered
    one), and ``main_grad`` is None. Under ``torch.compile`` (:meth:`_ParallelLinearBase._gemm`)
    ``param`` is None (dynamo refuses one tensor passed twice, and a trace makes no Python side effects
    in backward): ``main_grad`` is then the tensor the fused wgrad accumulates into, a graph input
    whose mutation the wgrad operator declares, or None with ``fusion`` on for a weight whose
    ``main_grad`` has an owner (a :class:`MainGradBuffer`): that weight gets an ordinary gradient
    accumulated in fp32 by the same GEMM, which the owner's hook adds to ``main_grad``. The collectives
    are then the functional ones (:mod:`comm`): the input-gradient one is traced before the weight-gradient
    GEMM, but a graph has no work handle to wait on later, so whether the two overlap is the compiler's
    schedule (inductor's comm reordering), not this function's ``async_comm``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, dgrad_comm, async_comm, fusion, sequence_parallel, seq_dim, param,
                main_grad):
        dtype = _compute_dtype(x)
        x_c, w_c = x.to(dtype), weight.to(dtype)
        b_c = bias.to(dtype) if bias is not None else None
        total = comm.gather_along(x_c, seq_dim, group) if sequence_parallel else x_c
        with torch.autocast(x.device.type, enabled=False):
            out = F.linear(total, w_c, b_c)
        ctx.save_for_backward(total, w_c)
        ctx.weight, ctx.weight_dtype, ctx.main_grad = param, weight.dtype, main_grad
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.group, ctx.dgrad_comm, ctx.async_comm = group, dgrad_comm, async_comm
        ctx.fusion, ctx.seq_dim, ctx.in_dtype, ctx.dtype = fusion, seq_dim, x.dtype, dtype
        return out

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.weight is None:
            return LinearWithAsyncGradComm._traced_backward(ctx, grad_output)
        total, w = ctx.saved_tensors
        weight = ctx.weight
        grad_output = grad_output.to(ctx.dtype).contiguous()
        grad_input = grad_output.matmul(w)
        handle, rs_out = None, None
        multi_rank = group_size(ctx.group) > 1
        if multi_rank and ctx.dgrad_comm == "reduce_scatter":
            rs_out, handle = comm.reduce_scatter_along(grad_input, ctx.seq_dim, ctx.group, async_op=ctx.async_comm)
        elif multi_rank and ctx.dgrad_comm == "all_reduce":
            handle = comm.all_reduce(grad_input, ctx.group, async_op=ctx.async_comm)

        grad_weight = None
        if weight.requires_grad:
            if ctx.fusion and ctx.dtype in _FUSED_DTYPES and getattr(weight, "main_grad", None) is not None:
                ops.wgrad_gemm_accum_fp32(total, grad_output, weight.main_grad)
                if hasattr(weight, "grad_added_to_main_grad"):  # a MainGradBuffer's param: its hook must run
                    weight.grad_added_to_main_grad = True
                    held = weight.grad is not None or torch.is_anomaly_enabled()  # added in place / checked for NaN
                    make = torch.zeros if held else torch.empty
                    grad_weight = make(w.shape, dtype=ctx.weight_dtype, device=w.device)
            else:
                grad_weight = _plain_wgrad(total, grad_output, ctx.weight_dtype)
        grad_bias = _bias_grad(ctx, grad_output)

        if handle is not None and ctx.async_comm:
            handle.wait()
        if rs_out is not None:
            grad_input = comm.finish_reduce_scatter(rs_out, ctx.seq_dim)
        return grad_input.to(ctx.in_dtype), grad_weight, grad_bias, None, None, None, None, None, None, None, None

    @staticmethod
    def _traced_backward(ctx, grad_output):
        """The backward under ``torch.compile`` (see the class docstring): no side effect but the wgrad
        operator's declared write into ``main_grad``; functional collectives, no work handles."""
        total, w = ctx.saved_tensors
        grad_output = grad_output.to(ctx.dtype).contiguous()
        grad_input = grad_output.matmul(w)
        if ctx.dgrad_comm == "reduce_scatter":
            grad_input = comm.reduce_scatter_value(grad_input, ctx.seq_dim, ctx.group)
        elif ctx.dgrad_comm == "all_reduce":
            grad_input = comm.all_reduce_value(grad_input, ctx.group)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            if ctx.fusion and ctx.dtype in _FUSED_DTYPES:
                if ctx.main_grad is not None:
                    ops.wgrad_gemm_accum_fp32(total, grad_output, ctx.main_grad)
                else:  # for the owner's hook: the fused GEMM's fp32 sum, as an ordinary gradient
                    acc = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                    ops.wgrad_gemm_accum_fp32(total, grad_output, acc)
                    grad_weight = acc.to(ctx.weight_dtype)
            else:
                grad_weight = _plain_wgrad(total, grad_output, ctx.weight_dtype)
        grad_bias = _bias_grad(ctx, grad_output)
        return grad_input.to(ctx.in_dtype), grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _plain_wgrad(total: Tensor, grad_output: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight gradient as an ordinary tensor of ``dtype`` (no ``main_grad``)."""
    go2 = grad_output.reshape(-1, grad_output.shape[-1])
    return (go2.t() @ total.reshape(-1, total.shape[-1])).to(dtype)


def _bias_grad(ctx, grad_output: Tensor) -> Optional[Tensor]:
    if ctx.has_bias and ctx.needs_input_grad[2]:
        return grad_output.reshape(-1, grad_output.shape[-1]).sum(0).to(ctx.bias_dtype)
    return None


def _validate_common(sequence_parallel: bool, sequence_dim: int) -> None:
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if not isinstance(sequence_dim, int):
        raise TypeError(f"sequence_dim must be an int, got {sequence_dim!r}")


def _layer_config(config: Optional[TensorParallelConfig], owner: str, **legacy: Optional[bool]) -> TensorParallelConfig:
    """``config`` (the default one when None) with the deprecated per-layer keywords that were given applied."""
    if config is not None and not isinstance(config, TensorParallelConfig):
        raise TypeError(f"{owner}: config must be a TensorParallelConfig, got {config!r}")
    config = _DEFAULT_CONFIG if config is None else config
    given = {name: value for name, value in legacy.items() if value is not None}
    if not given:
        return config
    warnings.warn(f"{owner}({', '.join(f'{k}={v!r}' for k, v in given.items())}) is deprecated; pass "
                  f"config=TensorParallelConfig({', '.join(f'{k}={v!r}' for k, v in given.items())}) instead",
                  DeprecationWarning, stacklevel=3)
    return config.replace(**{name: bool(value) for name, value in given.items()})


def _init_full_weight(out_features: int, in_features: int, bias: bool, device, dtype):
    """The full weight/bias initialised like ``nn.Linear`` (so shards do not depend on the TP size)."""
    ref = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    return ref.weight.detach(), (ref.bias.detach() if bias else None)


class _ParallelLinearBase(nn.Module):
    partition_dim: int

    def __init__(self, group, config: TensorParallelConfig, sequence_parallel: bool, sequence_dim: int) -> None:
        super().__init__()
        _validate_common(sequence_parallel, sequence_dim)
        self.group = group
        self.tp_size = group_size(group)
        self.tp_rank = group_rank(group)
        self.config = config
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim

    @property
    def gradient_accumulation_fusion(self) -> bool:
        """``config.gradient_accumulation_fusion``: the weight grad goes into an attached fp32 ``main_grad``."""
        return self.config.gradient_accumulation_fusion

    @property
    def async_grad_allreduce(self) -> bool:
        """``config.async_grad_allreduce``: the input-gradient collective overlaps the weight-gradient GEMM."""
        return self.config.async_grad_allreduce

    def _take_full(self, weight: Tensor, bias: Optional[Tensor], bias_is_sharded: bool,
                   chunks: int = 1, transposed: bool = False, blocks: Optional[tuple[int, ...]] = None) -> None:
        """Keep this rank's shard of the full (original-layout) ``weight``/``bias`` as the params."""
        layout = ShardLayout(self.partition_dim, self.group, chunks, transposed, blocks)
        self.weight = nn.Parameter(layout.shard(weight))
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = self.partition_dim
        self.weight.shard_layout = layout
        if bias is None:
            self.register_parameter("bias", None)
        elif bias_is_sharded:
            bias_layout = ShardLayout(0, self.group, chunks, blocks=blocks)
            self.bias = nn.Parameter(bias_layout.shard(bias))
            self.bias.tensor_model_parallel = True
            self.bias.partition_dim = 0
            self.bias.shard_layout = bias_layout
        else:
            self.bias = nn.Parameter(bias.detach().clone())
            self.bias.tensor_model_parallel = False
            if self.sequence_parallel:
                self.bias.sequence_parallel = True

    def full_weight(self) -> Tensor:
        """The gathered full weight in the original module's layout (collective over the TP group)."""
        return self.weight.shard_layout.gather(self.weight)

    def full_state(self) -> dict:
        """Gathered ``weight``/``bias`` under the original module's keys (collective over the TP group)."""
        state = {"weight": self.full_weight()}
        if self.bias is not None:
            state["bias"] = self.full_bias()
        return state

    def load_full_state(self, state: dict) -> None:
        """Copy this rank's slice of a full original-layout state into the shard."""
        with torch.no_grad():
            self.weight.copy_(self.weight.shard_layout.shard(state["weight"]))
            if self.bias is not None:
                layout = getattr(self.bias, "shard_layout", None)
                self.bias.copy_(layout.shard(state["bias"]) if layout is not None else state["bias"])

    def full_bias(self) -> Optional[Tensor]:
        if self.bias is None:
            return None
        layout = getattr(self.bias, "shard_layout", None)
        return layout.gather(self.bias) if layout is not None else self.bias.detach()

    def _gemm(self, x: Tensor, bias: Optional[Tensor], dgrad: str, async_comm: bool, sequence_parallel: bool) -> Tensor:
        """:class:`LinearWithAsyncGradComm` on ``x``. Eager: the registered weight Parameter goes along, its
        ``main_grad`` is read in backward. Under ``torch.compile`` its ``main_grad`` is read now and passed as
        a tensor: a weight whose ``main_grad`` a :class:`MainGradBuffer` owns (it carries
        ``grad_added_to_main_grad``, a flag a trace cannot set in backward) gets an fp32-accumulated
        ordinary gradient for the buffer's hook instead (see :class:`LinearWithAsyncGradComm`)."""
        param, fusion = self._parameters["weight"], self.gradient_accumulation_fusion
        if not comm.tracing():
            return LinearWithAsyncGradComm.apply(x, self.weight, bias, self.group, dgrad, async_comm, fusion,
                                                 sequence_parallel, self.sequence_dim, param, None)
        main_grad = getattr(param, "main_grad", None) if fusion else None
        if main_grad is None:
            fusion = False
        elif hasattr(param, "grad_added_to_main_grad"):
            main_grad = None
        return LinearWithAsyncGradComm.apply(x, self.weight, bias, self.group, dgrad, async_comm, fusion,
                                             sequence_parallel, self.sequence_dim, None, main_grad)


class ColumnParallelLinear(_ParallelLinearBase):
    """``Y = X A^T + b`` with ``A`` split along its output dim.

    Args:
        gather_output: all-gather the output so every rank holds the full ``[..., out]``;
            else each rank returns its ``[..., out/tp]`` slice.
        skip_bias_add: return ``(output, bias)`` without adding the bias (for fusion downstream).
        sequence_parallel: the input is split along ``sequence_dim`` across the TP group and is
            all-gathered before the GEMM; grad_input is reduce-scattered.
        config: the :class:`~lightning_amp.parallel.TensorParallelConfig` whose ``gradient_accumulation_fusion``
            and ``async_grad_allreduce`` the layer follows (default: both on). The keywords of those names are
            deprecated (DeprecationWarning; they override the config's values).
    """

    partition_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: Optional[Any] = None,
        gather_output: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        gradient_accumulation_fusion: Optional[bool] = None,
        async_grad_allreduce: Optional[bool] = None,
        device=None,
        dtype=None,
        config: Optional[TensorParallelConfig] = None,
        _full: Optional[tuple] = None,
        _layout: tuple = (1, False, None),
    ) -> None:
        config = _layer_config(config, "ColumnParallelLinear", gradient_accumulation_fusion=gradient_accumulation_fusion,
                               async_grad_allreduce=async_grad_allreduce)
        super().__init__(group, config, sequence_parallel, sequence_dim)
        blocks = _layout[2] or (out_features // _layout[0],) * _layout[0]
        if sum(blocks) != out_features or any(b % self.tp_size for b in blocks):
            raise ValueError(
                f"ColumnParallelLinear: out_features={out_features} is not divisible by the tensor-parallel size {self.tp_size}"
            )
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True is not allowed with sequence_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = out_features // self.tp_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.shared_input = None  # a SharedInput: its unit's columns take one input collective (share_input)
        if _full is None:
            _full = _init_full_weight(out_features, in_features, bias, device, dtype)
        self._take_full(_full[0], _full[1], True, *_layout)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[Any] = None, **kwargs) -> "ColumnParallelLinear":
        """A column-parallel copy of ``linear`` holding this rank's rows of its *existing* weight."""
        return cls.from_weights(linear.weight, linear.bias, group, **kwargs)

    @classmethod
    def from_weights(cls, weight: Tensor, bias: Optional[Tensor], group: Optional[Any] = None,
                     chunks: int = 1, transposed: bool = False, blocks: Optional[tuple[int, ...]] = None,
                     **kwargs) -> "ColumnParallelLinear":
        """From a full weight ``[out, in]`` (``[in, out]`` when ``transposed``) and bias ``[out]``.

        ``chunks``: the output dim is that many equal blocks (a fused ``[q; k; v]``: 3), each split
        over the ranks separately, so every rank gets its slice of each block (its heads of q, k, v).
        ``blocks``: the block sizes when they differ (they must sum to ``out``); overrides ``chunks``.
        """
        out_features, in_features = weight.shape[::-1] if transposed else weight.shape
        sizes = tuple(blocks) if blocks is not None else (out_features // chunks,) * chunks
        if sum(sizes) != out_features or any(b % group_size(group) for b in sizes):
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} as blocks {list(sizes)}: each block "
                             f"must divide by the tensor-parallel size {group_size(group)}")
        return cls(in_features, out_features, bias=bias is not None, group=group, _full=(weight, bias),
                   _layout=(chunks, transposed, blocks), **kwargs)

    def forward(self, x: Tensor):
        bias = None if self.skip_bias_add else self.bias
        if self.shared_input is not None and not comm.tracing():  # the unit's one input collective (comm.SharedInput)
            out = self._gemm(self.shared_input(x), bias, "none", False, False)
        else:
            dgrad = "reduce_scatter" if self.sequence_parallel else ("all_reduce" if self.tp_size > 1 else "none")
            out = self._gemm(x, bias, dgrad, self.async_grad_allreduce, self.sequence_parallel and self.tp_size > 1)
        if self.gather_output:
            out = comm.gather_from_tensor_parallel_region(out, self.group)
        return (out, self.bias) if self.skip_bias_add else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_per_rank}/rank), "
                f"tp={self.tp_size}, gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


def share_input(columns: list[nn.Module], group: Any) -> None:
    """Give the column layers of one unit (``q``, ``k``, ``v``; ``gate``, ``up``) one entry into the TP region, a
    :class:`~lightning_amp.parallel.comm.SharedInput` set as their ``shared_input``, when two or more of them take
    their input alike (the same sequence-parallel mode, outputs not gathered) over a group of more than one rank.
    Layers without a ``shared_input`` (their entry is their own) are left as they are."""
    columns = [c for c in columns if hasattr(c, "shared_input") and not getattr(c, "gather_output", False)]
    modes = {(c.sequence_parallel, c.sequence_dim) for c in columns}
    if len(columns) > 1 and len(modes) == 1 and group_size(group) > 1:
        ((sequence_parallel, sequence_dim),) = modes
        shared = comm.SharedInput(group, sequence_parallel, sequence_dim)
        for column in columns:
            column.shared_input = shared


class RowParallelLinear(_ParallelLinearBase):
    """``Y = X A^T + b`` with ``A`` split along its input dim; ``b`` replicated, added after the reduction.

    Args:
        input_is_parallel: the input is already split along its last dim (e.g. a column layer's
            output with ``gather_output=False``); else it is scattered here.
        skip_bias_add: return ``(output, bias)`` without adding the bias.
        sequence_parallel: the output is reduce-scattered along ``sequence_dim`` instead of all-reduced.
        config: as for :class:`ColumnParallelLinear`.
    """

    partition_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: Optional[Any] = None,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        gradient_accumulation_fusion: Optional[bool] = None,
        async_grad_allreduce: Optional[bool] = None,
        device=None,
        dtype=None,
        config: Optional[TensorParallelConfig] = None,
        _full: Optional[tuple] = None,
        _transposed: bool = False,
    ) -> None:
        config = _layer_config(config, "RowParallelLinear", gradient_accumulation_fusion=gradient_accumulation_fusion,
                               async_grad_allreduce=async_grad_allreduce)
        super().__init__(group, config, sequence_parallel, sequence_dim)
        if in_features % self.tp_size != 0:
            raise ValueError(
                f"RowParallelLinear: in_features={in_features} is not divisible by the tensor-parallel size {self.tp_size}"
            )
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = in_features // self.tp_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        if _full is None:
            _full = _init_full_weight(out_features, in_features, bias, device, dtype)
        self._take_full(_full[0], _full[1], False, transposed=_transposed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[Any] = None, **kwargs) -> "RowParallelLinear":
        """A row-parallel copy of ``linear`` holding this rank's columns of its *existing* weight."""
        return cls.from_weights(linear.weight, linear.bias, group, **kwargs)

    @classmethod
    def from_weights(cls, weight: Tensor, bias: Optional[Tensor], group: Optional[Any] = None,
                     transposed: bool = False, **kwargs) -> "RowParallelLinear":
        """From a full weight ``[out, in]`` (``[in, out]`` when ``transposed``) and bias ``[out]``."""
        out_features, in_features = weight.shape[::-1] if transposed else weight.shape
        if in_features % group_size(group) != 0:
            raise ValueError(f"RowParallelLinear: in_features={in_features} is not divisible by the "
                             f"tensor-parallel size {group_size(group)}")
        return cls(in_features, out_features, bias=bias is not None, group=group, _full=(weight, bias),
                   _transposed=transposed, **kwargs)

    def forward(self, x: Tensor):
        if not self.input_is_parallel:
            x = comm.scatter_to_tensor_parallel_region(x, self.group)
        out = self._gemm(x, None, "none", False, False)
        if self.sequence_parallel:
            out = comm.reduce_scatter_to_sequence_parallel_region(out, self.group, self.sequence_dim)
        else:
            out = comm.reduce_from_tensor_parallel_region(out, self.group)
        if self.skip_bias_add:
            return out, self.bias
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank}/rank), out_features={self.out_features}, "
                f"tp={self.tp_size}, input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")
