"""TensorParallelConfig: the options of ``strategy="tp_fused"``, validated once, immutable.

One frozen object is built where the user states the options (``TensorParallelStrategy(...)`` for the
Trainer or for Fabric, or ``TensorParallelConfig(...)`` directly) and passed down unchanged: the
runtime, the plan and the parallel layers read it, none re-validates it.

Construction raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value), naming the argument and
the values it allows. Nothing here needs ``torch.distributed`` or Lightning.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from lightning_amp._keywords import checks_keywords
from lightning_amp.parallel.plan import TensorParallelPlan, validate_unsplit_ok
from lightning_amp.parallel.sequence import validate_sequence_dim

_BOOLS = ("sequence_parallel", "gradient_accumulation_fusion", "async_grad_allreduce", "overlap_grad_reduce",
          "allow_replicated")


@checks_keywords
@dataclass(frozen=True, eq=True)
class TensorParallelConfig:
    """The tp_fused options (see :class:`lightning_amp.TensorParallelStrategy` for their meaning).

    Attributes:
        tensor_parallel_size: ranks per TP group, a positive int, or ``"auto"`` (every device of a node).
        sequence_parallel: Megatron sequence parallelism inside the planned blocks.
        gradient_accumulation_fusion: parallel Linear weight gradients are accumulated straight into the
            fp32 ``weight.main_grad`` (when one is attached) by one GEMM.
        async_grad_allreduce: overlap the input-gradient collective with the weight-gradient GEMM.
        plan: ``"auto"``, or an explicit plan in any form
            :meth:`~lightning_amp.parallel.plan.TensorParallelPlan.parse` takes (a plan value or its dict/JSON form,
            torch's ``ColwiseParallel()``/``RowwiseParallel()``/``SequenceParallel()`` dicts, ``"column"`` |
            ``"row"`` | ``"replicate"`` per module path or glob), kept as the parsed
            :class:`~lightning_amp.parallel.plan.TensorParallelPlan` (no torch style objects: it pickles for
            spawned ranks).
        sequence_dim: ``None`` (infer), 0 (``[seq, batch, hidden]``) or 1 (``[batch, seq, hidden]``).
        bucket_numel: data-parallel all-reduce bucket size, in fp32 elements (4 bytes each).
        overlap_grad_reduce: launch each bucket's all-reduce during backward once it is complete.
        allow_replicated: train the whole model replicated when the plan finds nothing to split.
        unsplit_ok: fnmatch globs of module paths (``"transformer.h.*.self_attention"``) whose attention
            ``plan="auto"`` may leave whole on every rank; any other attention it cannot split is refused at
            setup (kept as a tuple).
    """

    tensor_parallel_size: Union[int, str] = "auto"
    sequence_parallel: bool = False
    gradient_accumulation_fusion: bool = True
    async_grad_allreduce: bool = True
    plan: Union[str, Mapping[str, Any]] = "auto"
    sequence_dim: Optional[int] = None
    bucket_numel: int = 2**22
    overlap_grad_reduce: bool = True
    allow_replicated: bool = False
    unsplit_ok: Sequence[str] = ()

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if size != "auto" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"tensor_parallel_size must be 'auto' or a positive int, got {size!r}")
        for name in _BOOLS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        validate_sequence_dim(self.sequence_dim)
        if not isinstance(self.bucket_numel, int) or isinstance(self.bucket_numel, bool) or self.bucket_numel < 1:
            raise ValueError(f"bucket_numel must be a positive int, got {self.bucket_numel!r}")
        if self.plan != "auto":  # parsed now (a copy: later edits of the caller's dict do not reach it)
            object.__setattr__(self, "plan", TensorParallelPlan.parse(self.plan))
        object.__setattr__(self, "unsplit_ok", validate_unsplit_ok(self.unsplit_ok))

    def tp_size(self, devices_per_node: int) -> int:
        """The TP size for ``devices_per_node`` devices per node (``"auto"``: all of them, at least 1)."""
        if self.tensor_parallel_size == "auto":
            return max(devices_per_node, 1)
        return int(self.tensor_parallel_size)

    def replace(self, **changes: Any) -> "TensorParallelConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, config: Optional["TensorParallelConfig"] = None, **kwargs: Any) -> "TensorParallelConfig":
        """``config`` or, when None, one built from ``kwargs``. Strategies call this with every option they
        accept as a keyword: passing both ``config`` and an option that differs from its default raises
        ``ValueError`` naming that option (which of the two would win is not obvious)."""
        if config is None:
            return cls(**kwargs)
        if not isinstance(config, cls):
            raise TypeError(f"config must be a TensorParallelConfig, got {config!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        given = sorted(name for name, value in kwargs.items() if not _same(value, defaults[name]))
        if given:
            raise ValueError(f"pass the tensor-parallel options either in config=TensorParallelConfig(...) or as "
                             f"keywords, not both: got config and {', '.join(given)}")
        return config


def _same(a: Any, b: Any) -> bool:
    """Equal and of one type (``True`` is not ``1``); a list and a tuple of the same items are the same (LightningCLI
    hands a sequence's default ``()`` over as ``[]``)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return type(a) is type(b) and a == b
