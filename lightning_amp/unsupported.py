"""Strategies that lightning-amp's precision plugins cannot run under, refused before anything is cast.

The precision ladder (``opt_level="auto"``) runs under one device and under DDP only, where a rollback restores
whole replicated state dicts and its moves are proven equal to one process (tests/precision/test_auto_ddp.py).
Under a strategy that shards the model or converts its layers (FSDP2's ModelParallelStrategy, tp_fused, FSDP) a
rollback would restore sharded params, optimizer states and tp_fused's ``main_grad`` buffers, which no test has
shown to resume the run as one process would: it is refused at setup (tp_fused: at ``Trainer(...)``/``Fabric(...)``).

DeepSpeed (Trainer or Fabric, any ZeRO stage) owns the mixed precision itself: its engine keeps
fp32 master weights, scales the loss and runs the backward (``engine.backward``) and the step, so our
plugin's casts, loss scale and skip would be bypassed or applied twice. The strategy is recognised by
Lightning's class, which is importable without deepspeed installed.
"""
from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import DDPStrategy as _FabricDDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as _FabricDeepSpeedStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as _FabricSingleDeviceStrategy
from lightning.pytorch.strategies import DDPStrategy as _TrainerDDPStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as _TrainerDeepSpeedStrategy
from lightning.pytorch.strategies import SingleDeviceStrategy as _TrainerSingleDeviceStrategy

_LADDER_STRATEGIES = (_FabricSingleDeviceStrategy, _FabricDDPStrategy, _TrainerSingleDeviceStrategy,
                      _TrainerDDPStrategy)
_LADDER_USE = ('strategy="auto"/"single_device"/"ddp"/"ddp_spawn" with opt_level="auto", or a fixed opt_level '
               '(e.g. "O2") under this strategy')


def refuse_ladder(plugin: Any, strategy_name: str) -> None:
    """ValueError when ``plugin`` runs the precision ladder (``opt_level="auto"``) under ``strategy_name``, one the
    ladder does not support (see the module docstring)."""
    if getattr(plugin, "ladder", None) is not None:
        raise ValueError(f'opt_level="auto" (the precision ladder) is not supported under {strategy_name}: a rollback '
                         "there would restore sharded or converted state that no test has shown to resume the run as "
                         f"one process would. Allowed: {_LADDER_USE}.")


def refuse_strategy(plugin: Any, strategy: Any) -> None:
    """TypeError naming ``plugin``, ``strategy`` and what to use instead when they cannot work together."""
    if isinstance(strategy, (_FabricDeepSpeedStrategy, _TrainerDeepSpeedStrategy)):
        raise TypeError(
            f"{plugin!r} cannot run under DeepSpeed ({type(strategy).__name__}): DeepSpeed keeps its own fp32 master "
            "weights, loss scaling and backward, which this plugin would bypass. Use DeepSpeed's own mixed precision "
            "(strategy='deepspeed', precision='bf16-mixed' or '16-mixed'), or keep lightning-amp with strategy='ddp', "
            "'tp_fused' or ModelParallelStrategy (FSDP2)."
        )
    if strategy is not None and not isinstance(strategy, _LADDER_STRATEGIES):  # tp_fused: refused at construction
        refuse_ladder(plugin, type(strategy).__name__)


def refuse_precision_under_tp_fused(precision: Any, plain: type, supported: tuple, use: str) -> None:
    """TypeError unless ``precision`` is exactly ``plain`` (fp32) or one of ``supported``: tp_fused converts the
    model's Linear layers and accumulates their grads in an fp32 ``main_grad`` (no fp64, no layer swaps of its
    own, no sharding strategy's plugin). ``use`` names what to use instead."""
    if precision is None or type(precision) is plain or isinstance(precision, supported):
        refuse_ladder(precision, "strategy='tp_fused'")
        return
    raise TypeError(
        f"strategy='tp_fused' does not work with the precision plugin {type(precision).__name__}"
        f"(precision={getattr(precision, 'precision', '?')!r}): it converts the model's Linear layers and accumulates "
        f"their grads in fp32. Use {use}."
    )
