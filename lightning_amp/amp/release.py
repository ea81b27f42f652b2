"""The model a run hands back: a plain ``nn.Module``, as Lightning's own precisions leave it.

:func:`release_module_` is the inverse of a level's module preparation, applied when the run ends
(Lightning's ``Precision.teardown``, after ``fit``/``validate``/``test``/``predict``). It takes off
every hook and patch lightning_amp put on the module tree (the output cast, the fp32-BatchNorm
hooks, O2's input casts, the metrics' ``_apply``), so ``torch.jit.script``, ``torch.export``,
``copy.deepcopy`` and ``torch.save`` of the model work, and the saved model loads where
lightning_amp is not installed. The next run's preparation puts them back.

What the user then holds, per level (calling it directly, outside any Trainer):

* O0, O1: the fp32 model, unchanged (as after ``32-true`` / ``bf16-mixed``).
* O2 (master weights): the fp32 Parameters, and the buffers the run kept half upcast to fp32 (exact:
  a half value is an fp32 value). The model is then the one its checkpoint loads into a plain fp32
  model (the checkpoint stores those buffers as fp32 too): a direct call computes in fp32, as after
  ``bf16-mixed``.
* O3: the half model, as after ``bf16-true`` (feed it half inputs). With ``keep_batchnorm_fp32``
  the BatchNorm layers stay fp32 without their hooks: torch's ``batch_norm`` takes a half input with
  fp32 weights and statistics natively (CPU and CUDA), computes in fp32 and returns the input's dtype,
  which is what the hooks did during the run.
"""
from __future__ import annotations

import torch
from torch import nn

from lightning_amp.amp.half_inputs import remove_half_inputs_hooks
from lightning_amp.amp.levels import AmpProperties
from lightning_amp.amp.module_cast import outside_metrics, remove_cast_hooks_


@torch.no_grad()
def release_module_(module: nn.Module, props: AmpProperties) -> nn.Module:
    """Hand ``module`` (prepared for the level ``props``) back as a plain module (module docstring); in
    place, returns it."""
    remove_cast_hooks_(module)
    remove_half_inputs_hooks(module)
    if props.cast_model and props.master_weights:
        for sub in outside_metrics(module):
            for name, buffer in sub._buffers.items():
                if buffer is not None and buffer.dtype in (torch.float16, torch.bfloat16):
                    sub._buffers[name] = buffer.float()
    return module
