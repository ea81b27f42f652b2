"""The one door to the compiled core ``lightning_amp._C``.

Every op here dispatches to the compiled extension when it is built for the tensors'
device (or to torch's own fused kernel where that measured faster, :mod:`._choice`) and falls back
to a pure-PyTorch implementation otherwise. The fallback is loud: a
RuntimeWarning at import names why the extension is not in use (not built, or built but
failing to load, with the loader's error), and ``lightning-amp info`` prints it.
Environment switches (read once, at import):

* ``LIGHTNING_AMP_DISABLE_EXT=1`` forces the fallback everywhere (tests compare both paths);
  it wins over the next one.
* ``LIGHTNING_AMP_REQUIRE_EXT=1`` turns the fallback into an ImportError: the extension must
  load, and must have CUDA kernels when torch sees a CUDA device (CI and GPU checks set it).
* ``LIGHTNING_AMP_NO_BUILD=1``: load a prebuilt or cached build only, never compile at import
  (where no prebuilt extension matches the running torch, the first import otherwise builds one into
  the per-user cache, :mod:`._build`: ``LIGHTNING_AMP_CACHE_DIR``, default ``~/.cache/lightning_amp``).
* ``LIGHTNING_AMP_WGRAD_CPU_GEMM=auto|fastest|onednn|mkl|aten`` picks the CPU GEMM path of
  :func:`wgrad_gemm_accum_fp32` for 16-bit operands (default ``auto``: the fastest, measured once per
  machine and cached beside the build, :mod:`._wgrad_choice`, else a rule of the CPU; the same path in every
  process, so a resumed run and every rank sum in the same order; ``fastest``: measured once per
  process, which two processes may answer differently); any other value is a ValueError naming the variable.

``backend(device)`` tells which implementation serves a device.

Conventions shared by all ops:

* ``found_inf`` is a 0-dim float32 tensor on the tensors' device: 0.0 when every value
  seen was finite, 1.0 otherwise. Ops that *produce* it overwrite nothing else on overflow
  that the caller would need to roll back; ops that *consume* it leave every output
  untouched when it is non-zero. The pure-PyTorch fallbacks honour it without reading it on
  the host: they update, then put back what they touched where it is set (``torch.where``, at
  the cost of one copy of the touched tensors).
* ``grad_scale`` is the loss scale the gradients were multiplied by: the optimizer steps divide by it
  and write the unscaled gradients back in the same pass (as torch's fused optimizers); without it they
  only read the gradients.
* The ops take DTensors (FSDP2 / DTensor tensor-parallel shards): the compiled operators through
  DTensor's own dispatch (:mod:`._dtensor`: the local shards updated in place, placements kept;
  norms and flags returned ``Partial``, reduced by DTensor; LAMB's trust ratio from DTensor's
  all-reduce between its two passes), the pure-PyTorch fallbacks on the local shards
  (:func:`local_shards`). ``found_inf`` written by an op is this rank's flag either way.

The pure-PyTorch implementations are also reachable as private functions
(``_wgrad_fallback``, ``_scale_fallback``, ``_check_finite_fallback``, ``_l2norm_fallback``) so tests
can compare both.

Layout of the package (everything public is re-exported here):

* :mod:`._ext`: loading the extension (prebuilt, else a first-use build), the switches, :func:`backend`;
* :mod:`._build`: what a build is made of and for, the per-user cache of first-use builds;
* :mod:`._wgrad_choice`: the CPU wgrad GEMM path of this machine, measured once and cached beside the build;
* :mod:`._choice`: per device and dtype, our kernel or torch's fused one (Adam/AdamW, SGD, the L2 norm),
  whichever measured faster, where torch's keeps our semantics;
* :mod:`._library`: the compiled kernels as torch.library operators ``torch.ops.lightning_amp.*``
  (schemas with their writes declared, fake kernels), so ``torch.compile`` traces through them;
  their arguments are checked in C++ only. ``_library.run`` calls the operator under a trace or a
  dispatch mode or for DTensor arguments, and the C++ entry point directly in eager code on plain
  tensors (no custom-op dispatch cost);
* :mod:`._dtensor`: the DTensor sharding strategy of the multi-tensor operators;
* :mod:`.wgrad`, :mod:`.multi_tensor`, :mod:`.optim`: the public ops and their fallbacks (which
  check their own arguments: there is no C++ on that path).

A private attribute is patched where it is read: ``ops._ext._EXT = None`` switches the extension off,
``ops.optim._lamb_fallback = ...`` replaces a fallback.
"""
from __future__ import annotations

from . import _ext, _library, multi_tensor, optim, wgrad
from ._ext import (
    _EXT_DTYPES,
    _built_extension_files,
    _check_dense,
    _ext_accepts,
    _ext_for,
    _load_extension,
    backend,
    extension_error,
    extension_module,
    extension_origin,
    extension_path,
    wgrad_cpu_gemm,
    wgrad_cpu_gemm_origin,
)
from .multi_tensor import (
    _check_finite_fallback,
    _l2norm_fallback,
    _new_flag,
    _scale_fallback,
    multi_tensor_check_finite,
    multi_tensor_l2norm,
    multi_tensor_scale,
)
from .optim import (
    _OPT_DTYPES,
    _DTensor,
    _adadelta_fallback,
    _adam_fallback,
    _check_optim_args,
    _check_scalar_tensor,
    _lamb_fallback,
    _reduced_norms,
    _sgd_fallback,
    _store,
    _torch_fused_grads,
    _undone_if,
    _unscaled_fp32,
    local_shards,
    multi_tensor_adadelta,
    multi_tensor_adam,
    multi_tensor_lamb,
    multi_tensor_sgd,
)
from .wgrad import (
    _MM_OUT_DTYPE,
    _check_wgrad_args,
    _mm_has_out_dtype,
    _product_fp32,
    _wgrad_fallback,
    wgrad_gemm_accum_fp16,
    wgrad_gemm_accum_fp32,
)

__all__ = [
    "backend", "extension_error", "extension_module", "extension_origin", "extension_path", "local_shards", "multi_tensor_adadelta",
    "multi_tensor_adam", "multi_tensor_check_finite", "multi_tensor_l2norm", "multi_tensor_lamb",
    "multi_tensor_scale", "multi_tensor_sgd", "wgrad_cpu_gemm", "wgrad_cpu_gemm_origin", "wgrad_gemm_accum_fp16", "wgrad_gemm_accum_fp32",
]
