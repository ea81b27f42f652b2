"""The model a run hands back: a plain ``nn.Module``, as Lightning's own precisions leave it.

:func:`release_module_` is the inverse of a level's module preparation, applied when the run ends
(Lightning's ``Precision.teardown``, after ``fit``/``validate``/``test``/``predict``). It takes off
every hook and patch lightning_amp put on the module tree (the output cast, the fp32-BatchNorm
hooks, the metrics' ``_apply``), so ``torch.jit.script``, ``torch.export``, ``copy.deepcopy`` and
``torch.save`` of the model work, and the saved model loads where lightning_amp is not installed. The
next run's preparation puts them back. (O2's op policy, :mod:`~lightning_amp.amp.o2.policy`, is no
part of the model: the plugin releases its hold beside this.)

What the user then holds, per level (calling it directly, outside any Trainer):

* O0, O1: the fp32 model, unchanged (as after ``32-true`` / ``bf16-mixed``).
* O2 (master weights): the fp32 Parameters and the buffers as the model had them. Buffers the run
  stored half (``half_buffers=True``, or BatchNorm statistics with ``keep_batchnorm_fp32=False``) are
  upcast to fp32 (exact: a half value is an fp32 value), as the checkpoint stores them, so the model
  equals its checkpoint loaded into a plain fp32 model: a direct call computes in fp32, as after
  ``bf16-mixed``.
* O3: the half model, as after ``bf16-true`` (feed it half inputs). With ``keep_batchnorm_fp32``
  the BatchNorm layers stay fp32 without their hooks: torch's ``batch_norm`` takes a half input with
  fp32 weights and statistics natively (CPU and CUDA), computes in fp32 and returns the input's dtype,
  which is what the hooks did during the run.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_amp.amp.levels import AmpProperties
from lightning_amp.amp.module_cast import outside_metrics, remove_cast_hooks_


@torch.no_grad()
def release_module_(module: nn.Module, props: AmpProperties) -> nn.Module:
    """Hand ``module`` (prepared for the level ``props``) back as a plain module (module docstring); in
    place, returns it."""
    remove_cast_hooks_(module)
    if props.cast_model and props.fp32_params:
        for sub in outside_metrics(module):
            stored_half = (not props.keep_batchnorm_fp32) if isinstance(sub, _BatchNorm) else props.half_buffers
            if not stored_half:
                continue
            for name, buffer in sub._buffers.items():
                if buffer is not None and buffer.dtype in (torch.float16, torch.bfloat16):
                    sub._buffers[name] = buffer.float()
    return module
