"""Strategies that lightning-amp's precision plugins cannot run under, refused before anything is cast.

DeepSpeed (Trainer or Fabric, any ZeRO stage) owns the mixed precision itself: its engine keeps
fp32 master weights, scales the loss and runs the backward (``engine.backward``) and the step, so our
plugin's casts, loss scale and skip would be bypassed or applied twice. The strategy is recognised by
Lightning's class, which is importable without deepspeed installed.
"""
from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import DeepSpeedStrategy as _FabricDeepSpeedStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as _TrainerDeepSpeedStrategy


def refuse_strategy(plugin: Any, strategy: Any) -> None:
    """TypeError naming ``plugin``, ``strategy`` and what to use instead when they cannot work together."""
    if isinstance(strategy, (_FabricDeepSpeedStrategy, _TrainerDeepSpeedStrategy)):
        raise TypeError(
            f"{plugin!r} cannot run under DeepSpeed ({type(strategy).__name__}): DeepSpeed keeps its own fp32 master "
            "weights, loss scaling and backward, which this plugin would bypass. Use DeepSpeed's own mixed precision "
            "(strategy='deepspeed', precision='bf16-mixed' or '16-mixed'), or keep lightning-amp with strategy='ddp', "
            "'tp_fused' or ModelParallelStrategy (FSDP2)."
        )


def refuse_precision_under_tp_fused(precision: Any, plain: type, supported: tuple, use: str) -> None:
    """TypeError unless ``precision`` is exactly ``plain`` (fp32) or one of ``supported``: tp_fused converts the
    model's Linear layers and accumulates their grads in an fp32 ``main_grad`` (no fp64, no layer swaps of its
    own, no sharding strategy's plugin). ``use`` names what to use instead."""
    if precision is None or type(precision) is plain or isinstance(precision, supported):
        return
    raise TypeError(
        f"strategy='tp_fused' does not work with the precision plugin {type(precision).__name__}"
        f"(precision={getattr(precision, 'precision', '?')!r}): it converts the model's Linear layers and accumulates "
        f"their grads in fp32. Use {use}."
    )
