"""What a precision level does to a model's residual stream, counted on one training step (any device).

For each level (Lightning's ``32-true``, ``bf16-mixed``, ``bf16-true`` and lightning-amp's O1, O2, O3) one
Trainer step of a fresh copy of the model on the same batch, observed three ways, none of them a timing (the
counts are the same on every machine):

* **saved for backward**: every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``), counted
  once per storage in bytes by dtype; a tensor that is a Parameter, shares a Parameter's storage or has a
  Parameter's shape (a half copy of a weight) counts as a weight, one a loss saves (``log_softmax``,
  ``nll_loss``, ``*_loss``: O2 keeps losses fp32 on purpose) as the loss's, every other one as an activation;
* **dtype casts**: every ``_to_copy`` and cross-dtype ``copy_`` of the step, forward, backward and optimizer
  (a ``TorchDispatchMode``), counted and summed in bytes written, split the same way into weights and
  activations (a tensor of one element is a scalar, the cast of a loss's input the loss's: counted apart);
* **the stream**: each block's output dtype (the children of the model's ``nn.ModuleList``s, which is where
  transformers keep their layers), and the first op of the forward that turns a half activation into an fp32
  one of the same size outside a loss: the op, its operand shapes and dtypes, and the path of the module that ran it.

:func:`stream_report` runs it on any LightningModule factory; ``lightning-amp bench --stream`` on the example
models; ``benchmarks/o2_stream.py`` on the example, tiny Hugging Face models and LitGPT.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import Counter
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: the levels compared: Lightning's own precisions and lightning-amp's mixed levels
STREAM_LEVELS = ("32-true", "bf16-mixed", "bf16-true", "O1", "O2", "O3")
_HALF = (torch.float16, torch.bfloat16)
_CASTS = {torch.ops.aten._to_copy.default}
_LOSSES = ("loss", "nll", "cross_entropy", "kl_div", "binary_cross_entropy")
_LOSS_INPUTS = _LOSSES + ("log_softmax",)  # what a cross-entropy decomposes into


@dataclasses.dataclass
class StreamRecord:
    """One level's step (bytes are bytes; counts per step)."""

    level: str
    saved_bytes: Dict[str, Dict[str, int]]  # {"activation"|"weight"|"loss": {dtype name: bytes}}
    casts: Dict[str, int]  # {"activation"|"weight"|"scalar"|"loss": casts}
    cast_bytes: Dict[str, int]  # {"activation"|"weight"|"scalar"|"loss": bytes written}
    block_dtypes: List[str]  # each block's output dtype, in forward order (first forward of the step)
    first_promotion: Optional[str]  # "op(operands) in module 'path' (Class)", or None
    cast_kinds: Dict[str, int] = dataclasses.field(default_factory=dict)  # "kind from->to [shape] (phase)": count
    saved_kinds: Dict[str, int] = dataclasses.field(default_factory=dict)  # "kind dtype [shape] bytes": count

    @property
    def saved_activation_bytes(self) -> int:
        return sum(self.saved_bytes["activation"].values())

    @property
    def activation_casts(self) -> int:
        return self.casts["activation"]

    def as_dict(self) -> Dict[str, Any]:
        return {**dataclasses.asdict(self), "saved_activation_bytes": self.saved_activation_bytes}


def blocks_of(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The blocks of ``model``: the children of each ``nn.ModuleList`` or ``nn.ModuleDict`` whose children are all
    one class with submodules of its own (transformer layers), with their paths."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            children = list(module.named_children())
            if children and len({type(child) for _, child in children}) == 1 and any(True for _ in children[0][1].children()):
                found.extend((f"{name}.{key}", child) for key, child in children)
    return found


class _Observer(TorchDispatchMode):
    """Counts casts and finds the first promotion of the half stream (see the module docstring)."""

    def __init__(self, weights: "_Weights", module_path: Callable[[], str]) -> None:
        super().__init__()
        self.weights, self.module_path = weights, module_path
        self.casts: Counter = Counter()
        self.cast_bytes: Counter = Counter()
        self.cast_kinds: Counter = Counter()  # "activation bfloat16->float32 [4, 32]" -> count
        self.forward = True
        self.first_promotion: Optional[str] = None
        self.in_loss = False  # the op that ran last belongs to a loss (what autograd saves now is the loss's)
        self._last_cast: Optional[Tuple[str, torch.Tensor, int]] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.in_loss = any(n in func.__name__ for n in _LOSS_INPUTS)
        if self.in_loss and self._last_cast is not None:  # the cast that fed a loss is the loss's
            kind, cast, nbytes = self._last_cast
            if any(t is cast for t in tree_leaves((args, kwargs))):
                self._count(kind, -1, -nbytes)
                self._count("loss", 1, nbytes)
        self._last_cast = None
        source = args[0] if args else None
        if isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor):
            cast = func in _CASTS and out.dtype != source.dtype
            if func is torch.ops.aten.copy_.default and isinstance(args[1], torch.Tensor):
                source, cast = args[1], args[1].dtype != out.dtype
            if cast:
                kind = "scalar" if out.numel() <= 1 else "weight" if self.weights.holds(source) else "activation"
                nbytes = out.numel() * out.element_size()
                self._count(kind, 1, nbytes)
                self._last_cast = (kind, out, nbytes)
                phase = "forward" if self.forward else "backward/step"
                self.cast_kinds[f"{kind} {_name(source.dtype)}->{_name(out.dtype)} {list(out.shape)} ({phase})"] += 1
        if self.forward and self.first_promotion is None and func not in _CASTS:
            self._promotion(func, args, kwargs, out)
        return out

    def _count(self, kind: str, casts: int, nbytes: int) -> None:
        self.casts[kind] += casts
        self.cast_bytes[kind] += nbytes

    def _promotion(self, func, args, kwargs, out) -> None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or any(n in func.__name__ for n in _LOSSES):
            return
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.dtype in _HALF and t.numel() == out.numel() and t.numel() > 1 and not self.weights.holds(t)
               for t in inputs):
            operands = ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in inputs)
            self.first_promotion = f"{func.__name__}({operands}) in {self.module_path()}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class _Weights:
    """Which tensors are weights: a Parameter, a tensor sharing a Parameter's storage, or one with a
    Parameter's shape or a matrix Parameter's transposed shape (a half copy of a weight, a weight's grad)."""

    def __init__(self, model: nn.Module) -> None:
        params = list(model.parameters())
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.shapes = {tuple(p.shape) for p in params} | {tuple(p.shape)[::-1] for p in params if p.dim() == 2}

    def holds(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or tuple(t.shape) in self.shapes:
            return True
        try:
            return t.untyped_storage().data_ptr() in self.storages
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a meta tensor)
            return False


class _ModuleStack:
    """The path of the module whose forward runs now (global forward hooks)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name or "<root>" for name, m in model.named_modules()}
        self.stack: List[str] = []

    def __enter__(self):
        self.handles = [nn.modules.module.register_module_forward_pre_hook(self._enter),
                        nn.modules.module.register_module_forward_hook(self._exit, always_call=True)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _enter(self, module, args):
        self.stack.append(f"module '{self.names.get(id(module), '?')}' ({type(module).__name__})")

    def _exit(self, module, args, output):
        if self.stack:
            self.stack.pop()

    def path(self) -> str:
        return self.stack[-1] if self.stack else "code outside any module"


def _callback(model: nn.Module):
    import lightning as L

    class _Watch(L.Callback):
        """Observes the first training batch: its forward, backward and optimizer step."""

        def __init__(self) -> None:
            self.saved: Dict[str, Dict[str, int]] = {"activation": Counter(), "weight": Counter(), "loss": Counter()}
            self.seen_storages: set = set()
            self.saved_kinds: Counter = Counter()
            self.block_dtypes: List[str] = []
            self.observer: Optional[_Observer] = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx:
                return
            weights = _Weights(pl_module)
            modules = _ModuleStack(pl_module)
            self.observer = _Observer(weights, modules.path)
            self.stack = contextlib.ExitStack()
            self.stack.enter_context(modules)
            self.stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, weights),
                                                                              lambda t: t))
            self.stack.enter_context(self.observer)
            for name, block in blocks_of(pl_module):
                self.stack.callback(block.register_forward_hook(self._block_output).remove)

        def on_before_backward(self, trainer, pl_module, loss):
            if self.observer is not None:
                self.observer.forward = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.observer is not None and not batch_idx:
                self.stack.close()

        def _pack(self, t: torch.Tensor, weights: _Weights) -> torch.Tensor:
            try:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                nbytes = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                return t
            if key not in self.seen_storages:
                self.seen_storages.add(key)
                kind = "loss" if self.observer.in_loss else "weight" if weights.holds(t) else "activation"
                self.saved[kind][str(t.dtype).replace("torch.", "")] += nbytes
                self.saved_kinds[f"{kind} {_name(t.dtype)} {list(t.shape)} {nbytes}B"] += 1
            return t

        def _block_output(self, module, args, output):
            if self.observer is not None and self.observer.forward:
                first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
                self.block_dtypes.append(str(first.dtype).replace("torch.", "") if first is not None else "none")

    return _Watch()


def _trainer_precision(level: str, dtype: torch.dtype, plugin_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    if level in ("O0", "O1", "O2", "O3"):
        from lightning_amp import AmpPrecision

        return {"plugins": [AmpPrecision(opt_level=level, dtype=dtype, **plugin_kwargs)]}
    half = "16" if dtype == torch.float16 else "bf16"
    return {"precision": level.replace("bf16", half)}


def measure_level(make_module: Callable[[], Any], batches: Sequence[Any], level: str, dtype: torch.dtype = torch.bfloat16,
                  accelerator: str = "cpu", **plugin_kwargs: Any) -> StreamRecord:
    """One Trainer step of ``make_module()`` (a fresh LightningModule, seeded by the factory) on ``batches[0]``
    at ``level``, observed (the module docstring). ``plugin_kwargs`` go to lightning-amp's plugin."""
    import lightning as L

    module = make_module()
    watch = _callback(module)
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[watch], **_trainer_precision(level, dtype, plugin_kwargs))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(does not have many workers|GPU available|precision).*")
        trainer.fit(module, torch.utils.data.DataLoader(list(batches), batch_size=None))
    observer = watch.observer
    return StreamRecord(level=level, saved_bytes={k: dict(v) for k, v in watch.saved.items()},
                        casts={k: observer.casts[k] for k in ("activation", "weight", "scalar", "loss")},
                        cast_bytes={k: observer.cast_bytes[k] for k in ("activation", "weight", "scalar", "loss")},
                        block_dtypes=watch.block_dtypes, first_promotion=observer.first_promotion,
                        cast_kinds=dict(observer.cast_kinds), saved_kinds=dict(watch.saved_kinds))


def stream_report(make_module: Callable[[], Any], batches: Sequence[Any], levels: Iterable[str] = STREAM_LEVELS,
                  dtype: torch.dtype = torch.bfloat16, accelerator: str = "cpu",
                  **plugin_kwargs: Any) -> Dict[str, StreamRecord]:
    """:func:`measure_level` at each of ``levels``, each on a fresh module from ``make_module``."""
    return {level: measure_level(make_module, batches, level, dtype, accelerator, **plugin_kwargs) for level in levels}


def format_report(title: str, records: Dict[str, StreamRecord], baseline: str = "bf16-true") -> str:
    """A plain-text table of ``records``: saved activation MiB (its fp32 part) and its ratio to ``baseline``,
    casts (of activations) and their MiB, block output dtypes, the first promotion."""
    mib = 2.0 ** 20
    base = records.get(baseline)
    lines = [title, f"{'level':<11} {'saved act MiB (fp32)':>21} {'x ' + baseline:>13} {'casts (act)':>12} "
                    f"{'cast MiB':>9}  blocks out  first promotion of the half stream"]
    for level, r in records.items():
        ratio = f"{r.saved_activation_bytes / base.saved_activation_bytes:.2f}" if base and base.saved_activation_bytes else "-"
        fp32 = r.saved_bytes["activation"].get("float32", 0)
        kinds = sorted(set(r.block_dtypes))
        lines.append(f"{level:<11} {r.saved_activation_bytes / mib:>13.2f} ({fp32 / mib:>5.2f}) {ratio:>13} "
                     f"{sum(r.casts.values()):>6} ({r.activation_casts:>3}) {sum(r.cast_bytes.values()) / mib:>9.2f}  "
                     f"{'/'.join(kinds) or '-':<10}  {r.first_promotion or '-'}")
    return "\n".join(lines)
