"""The one door to the compiled core ``lightning_amp._C``.

Every op here dispatches to the compiled extension when it is built for the tensors'
device and falls back to a pure-PyTorch implementation otherwise. The fallback is loud: a
RuntimeWarning at import names why the extension is not in use (not built, or built but
failing to load, with the loader's error), and ``lightning-amp info`` prints it.
Environment switches (read once, at import):

* ``LIGHTNING_AMP_DISABLE_EXT=1`` forces the fallback everywhere (tests compare both paths);
  it wins over the next one.
* ``LIGHTNING_AMP_REQUIRE_EXT=1`` turns the fallback into an ImportError: the extension must
  load, and must have CUDA kernels when torch sees a CUDA device (CI and GPU checks set it).
* ``LIGHTNING_AMP_WGRAD_CPU_GEMM=auto|onednn|mkl|aten`` pins the CPU GEMM path of
  :func:`wgrad_gemm_accum_fp32` for 16-bit operands (default ``auto``: measured once per process);
  any other value is a ValueError naming the variable.

``backend(device)`` tells which implementation serves a device.

Conventions shared by all ops:

* ``found_inf`` is a 0-dim float32 tensor on the tensors' device: 0.0 when every value
  seen was finite, 1.0 otherwise. Ops that *produce* it overwrite nothing else on overflow
  that the caller would need to roll back; ops that *consume* it leave every output
  untouched when it is non-zero. The pure-PyTorch fallbacks honour it without reading it on
  the host: they update, then put back what they touched where it is set (``torch.where``, at
  the cost of one copy of the touched tensors).
* ``grad_scale`` is the loss scale the gradients were multiplied by (the op divides by it).
* The optimizer ops take DTensors (FSDP2 / DTensor tensor-parallel shards) and update their local
  shards in place (:func:`local_shards`); norms over whole tensors are the caller's (see
  ``multi_tensor_lamb``'s ``reduce_norms``).

The pure-PyTorch implementations are also reachable as private functions
(``_wgrad_fallback``, ``_scale_fallback``, ``_check_finite_fallback``, ``_l2norm_fallback``) so tests
can compare both.
"""
from __future__ import annotations

import contextlib
import glob
import importlib
import os
import warnings
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed
    _DTensor = None

_EXT = None
_EXT_ERROR: Optional[str] = None


def _built_extension_files() -> list:
    """Compiled ``_C`` files next to this module (present = built, whether or not it loads)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd")))


def _load_extension() -> None:
    global _EXT, _EXT_ERROR
    if os.environ.get("LIGHTNING_AMP_DISABLE_EXT") == "1":
        _EXT_ERROR = "disabled by LIGHTNING_AMP_DISABLE_EXT=1"
        return
    required = os.environ.get("LIGHTNING_AMP_REQUIRE_EXT") == "1"
    try:
        _EXT = importlib.import_module("lightning_amp._C")
    except ImportError as err:  # the package keeps working without the build, loudly
        built = _built_extension_files()
        _EXT_ERROR = (f"lightning_amp/{os.path.basename(built[0])} is built but failed to load: {err}" if built
                      else f"lightning_amp._C is not built ({err})")
        if required:
            raise ImportError(f"lightning_amp: LIGHTNING_AMP_REQUIRE_EXT=1 but {_EXT_ERROR}") from err
        warnings.warn(
            f"lightning_amp: {_EXT_ERROR}; using the pure-PyTorch fallback ops. "
            "Rebuild with `make install` (or `pip install --no-build-isolation -e .`).",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    if required and not _EXT.WITH_CUDA and torch.cuda.is_available():
        raise ImportError("lightning_amp: LIGHTNING_AMP_REQUIRE_EXT=1 but lightning_amp._C was built without CUDA "
                          "kernels on a machine with a CUDA device (rebuild with nvcc on PATH / CUDA_HOME set)")


_load_extension()


def _apply_wgrad_cpu_gemm_env() -> None:
    value = os.environ.get("LIGHTNING_AMP_WGRAD_CPU_GEMM")
    if value is None or _EXT is None:
        return
    try:
        _EXT._set_wgrad_cpu_gemm_policy(value)
    except ValueError as err:
        raise ValueError(f"LIGHTNING_AMP_WGRAD_CPU_GEMM={value!r}: {err}") from None


_apply_wgrad_cpu_gemm_env()


def extension_error() -> Optional[str]:
    """Why the compiled extension is not in use, or None when it is loaded."""
    return _EXT_ERROR


def extension_path() -> Optional[str]:
    """The file the compiled extension was loaded from, or None when it is not loaded."""
    return getattr(_EXT, "__file__", None)


def extension_module():
    """The loaded compiled extension, or None (for the parts that are no per-device op: O2's autocast
    policy, :mod:`lightning_amp.amp.o2_policy`)."""
    return _EXT


def _ext_for(device: torch.device | str):
    """The extension module if it has kernels for ``device``, else None."""
    if _EXT is None:
        return None
    kind = torch.device(device).type
    if kind == "cpu":
        return _EXT
    if kind == "cuda" and getattr(_EXT, "WITH_CUDA", False):
        return _EXT
    return None


def backend(device: torch.device | str = "cpu") -> str:
    """Which implementation serves ``device``: ``"cpu-ext"``, ``"cuda-ext"`` or ``"torch"``."""
    kind = torch.device(device).type
    return f"{kind}-ext" if _ext_for(device) is not None else "torch"


# --------------------------------------------------------------------------------------
# Weight-gradient GEMM with accumulation (Megatron gradient_accumulation_fusion)
# --------------------------------------------------------------------------------------


def wgrad_cpu_gemm(dtype: torch.dtype) -> Optional[str]:
    """The CPU GEMM path that serves :func:`wgrad_gemm_accum_fp32` for ``dtype`` operands in this
    process: ``"onednn"``, ``"mkl"`` or ``"aten"`` (for 16-bit dtypes this runs the one-time
    measurement if it has not run yet), or None without the compiled extension."""
    if _EXT is None:
        return None
    return _EXT._wgrad_cpu_gemm_backend(str(dtype).replace("torch.", ""))


def _check_dense(op: str, name: str, t: Tensor) -> None:
    """Sparse (and other non-strided) tensors have no dense storage for the kernels to walk."""
    if t.layout != torch.strided:
        raise TypeError(f"{op}: {name} must be a dense (strided) tensor, got layout {t.layout}")


def _check_wgrad_args(input: Tensor, grad_output: Tensor, main_grad: Tensor, main_dtypes) -> None:
    if not isinstance(input, Tensor) or not isinstance(grad_output, Tensor) or not isinstance(main_grad, Tensor):
        raise TypeError("wgrad_gemm_accum: input, grad_output and main_grad must be tensors")
    for name, t in (("input", input), ("grad_output", grad_output), ("main_grad", main_grad)):
        _check_dense("wgrad_gemm_accum", name, t)
    floating = (torch.float32, torch.float16, torch.bfloat16)
    if input.dtype not in floating or grad_output.dtype not in floating:
        raise TypeError(
            f"wgrad_gemm_accum: input and grad_output must be float32/float16/bfloat16, "
            f"got input={input.dtype}, grad_output={grad_output.dtype}"
        )
    if input.dtype != grad_output.dtype:
        raise TypeError(f"wgrad_gemm_accum: input ({input.dtype}) and grad_output ({grad_output.dtype}) must share a dtype")
    if main_grad.dtype not in main_dtypes:
        raise TypeError(f"wgrad_gemm_accum: main_grad must be {' or '.join(map(str, main_dtypes))}, got {main_grad.dtype}")
    if not (input.device == grad_output.device == main_grad.device):
        raise ValueError(
            f"wgrad_gemm_accum: all tensors must be on one device, got input={input.device}, "
            f"grad_output={grad_output.device}, main_grad={main_grad.device}"
        )
    if main_grad.dim() != 2:
        raise ValueError(f"wgrad_gemm_accum: main_grad must be 2-D [out, in], got shape {tuple(main_grad.shape)}")
    if input.dim() < 1 or grad_output.dim() < 1 or input.shape[:-1] != grad_output.shape[:-1]:
        raise ValueError(
            f"wgrad_gemm_accum: input [..., in] and grad_output [..., out] must share leading dims, "
            f"got {tuple(input.shape)} and {tuple(grad_output.shape)}"
        )
    if tuple(main_grad.shape) != (grad_output.shape[-1], input.shape[-1]):
        raise ValueError(
            f"wgrad_gemm_accum: main_grad shape {tuple(main_grad.shape)} != [out, in] = "
            f"{(grad_output.shape[-1], input.shape[-1])}"
        )
    if not main_grad.is_contiguous():
        raise ValueError("wgrad_gemm_accum: main_grad must be contiguous (it is accumulated in place)")


def _mm_has_out_dtype() -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` takes 16-bit operands (a 16-bit GEMM
    with fp32 accumulation and an fp32 result; CUDA kernels only, probed on meta tensors)."""
    a = torch.empty(2, 2, dtype=torch.bfloat16, device="meta")
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


_MM_OUT_DTYPE = _mm_has_out_dtype()


def _product_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` as an fp32 tensor with fp32 accumulation and no rounding of the result to 16 bits.

    CUDA runs the 16-bit GEMM at its own speed (``out_dtype=torch.float32``); elsewhere the
    operands are upcast (exact) and multiplied in fp32.
    """
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _wgrad_fallback(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """Pure-PyTorch ``main_grad += grad_output^T @ input``: the fp32 product (a temporary of
    main_grad's size, see :func:`_product_fp32`), then one add computed in fp32, so a 16-bit
    main_grad is rounded once per element."""
    inp = input.reshape(-1, input.shape[-1])
    gout = grad_output.reshape(-1, grad_output.shape[-1])
    if inp.numel() == 0 or gout.numel() == 0:
        return
    main_grad.add_(_product_fp32(gout.t(), inp))


def wgrad_gemm_accum_fp32(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """``main_grad += grad_output[..., out]^T @ input[..., in]`` in place, fp32 accumulation.

    ``input`` and ``grad_output`` are fp32/fp16/bf16 with identical leading dims (flattened);
    ``main_grad`` is a contiguous fp32 ``[out, in]`` buffer.

    Backends: CUDA ``cublasGemmEx`` with beta = 1 into ``main_grad`` (CUBLAS_COMPUTE_32F).
    CPU: fp32 operands via ``addmm_`` (sgemm, beta = 1); 16-bit operands through the fastest of
    three paths, measured once per process and dtype at the first call (four 2048 x 1024 x 1024
    products per usable path): ``onednn`` (oneDNN's micro-kernel inside torch, on AMX or AVX-512 BF16/FP16
    units), ``mkl`` (MKL's ``cblas_gemm_bf16bf16f32`` / ``cblas_gemm_f16f16f32``) or ``aten``
    (token blocks upcast to fp32, then ``addmm_``). All three sum exact products in fp32 with
    beta = 1 (they differ only in the order of the sums); ``LIGHTNING_AMP_WGRAD_CPU_GEMM`` pins one.
    No path materialises the full product. The fallback (no extension) builds the fp32 product
    (on CUDA with the 16-bit GEMM, ``out_dtype=torch.float32``) and adds it.
    """
    _check_wgrad_args(input, grad_output, main_grad, (torch.float32,))
    ext = _ext_for(main_grad.device)
    if ext is not None and hasattr(ext, "wgrad_gemm_accum_fp32"):
        ext.wgrad_gemm_accum_fp32(input.contiguous(), grad_output.contiguous(), main_grad)
    else:
        _wgrad_fallback(input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """As :func:`wgrad_gemm_accum_fp32` for a 16-bit ``main_grad`` (fp16/bf16), computed in fp32.

    Each element of ``main_grad`` is rounded once (the result is the 16-bit rounding of the
    fp32-accumulated sum): CPU and CUDA upcast row tiles of main_grad into an fp32 workspace
    (16 / 64 MiB at most), accumulate the GEMM into it with beta = 1 and round it back once;
    the fallback adds the fp32 product in one fp32 add.
    """
    _check_wgrad_args(input, grad_output, main_grad, (torch.float16, torch.bfloat16))
    ext = _ext_for(main_grad.device)
    if ext is not None and hasattr(ext, "wgrad_gemm_accum_fp16"):
        ext.wgrad_gemm_accum_fp16(input.contiguous(), grad_output.contiguous(), main_grad)
    else:
        _wgrad_fallback(input, grad_output, main_grad)


# --------------------------------------------------------------------------------------
# Multi-tensor ops
# --------------------------------------------------------------------------------------


def _new_flag(tensors: Sequence[Tensor], device=None) -> Tensor:
    dev = device if device is not None else (tensors[0].device if len(tensors) else "cpu")
    return torch.zeros((), dtype=torch.float32, device=dev)


def multi_tensor_scale(
    src: Sequence[Tensor], dst: Sequence[Tensor], scale: float, per_tensor: bool = False
) -> tuple[Tensor, Optional[Tensor]]:
    """``dst[i] = src[i] * scale`` (dtypes may differ, e.g. fp16 grads into fp32 masters' grads).

    Returns ``(found_inf, per_tensor_flags)``: ``found_inf`` is 1.0 if any element of any
    ``src`` is inf/nan; ``per_tensor_flags`` (float32 ``[len(src)]``, only when ``per_tensor``)
    marks which tensors held non-finite values. ``dst`` may alias ``src`` (in-place unscale).
    """
    if len(src) != len(dst):
        raise ValueError(f"multi_tensor_scale: src and dst must have equal length, got {len(src)} and {len(dst)}")
    for i, (s, d) in enumerate(zip(src, dst)):
        for name, t in ((f"src[{i}]", s), (f"dst[{i}]", d)):
            _check_dense("multi_tensor_scale", name, t)
            if not t.is_floating_point():
                raise TypeError(f"multi_tensor_scale: {name} must be floating point, got {t.dtype}")
        if s.shape != d.shape or s.device != d.device:
            raise ValueError(
                f"multi_tensor_scale: tensor {i}: src {tuple(s.shape)}@{s.device} != dst {tuple(d.shape)}@{d.device}"
            )
    found_inf = _new_flag(src)
    if not src:
        return found_inf, (torch.zeros(0) if per_tensor else None)
    ext = _ext_for(src[0].device)
    if ext is not None and hasattr(ext, "multi_tensor_scale") and _ext_accepts(src) and _ext_accepts(dst):
        flags = ext.multi_tensor_scale(list(src), list(dst), float(scale), found_inf)
        return found_inf, (flags if per_tensor else None)
    flags = _scale_fallback(src, dst, scale, found_inf)
    return found_inf, (flags if per_tensor else None)


_EXT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ext_accepts(tensors: Sequence[Tensor]) -> bool:
    """The multi-tensor kernels take contiguous fp32/fp16/bf16 tensors; others use the fallback."""
    return all(t.dtype in _EXT_DTYPES and t.is_contiguous() for t in tensors)


def _scale_fallback(src: Sequence[Tensor], dst: Sequence[Tensor], scale: float, found_inf: Tensor) -> Tensor:
    """Pure-PyTorch multi_tensor_scale: returns the per-tensor flags, ORs them into found_inf."""
    flags = torch.stack([(~torch.isfinite(s)).any() for s in src]).float()
    found_inf.copy_(torch.maximum(found_inf, flags.max().to(found_inf.device)))
    for s, d in zip(src, dst):
        d.copy_(s.float().mul(scale) if s.dtype != d.dtype else s.mul(scale))
    return flags


def multi_tensor_check_finite(tensors: Sequence[Tensor], found_inf: Tensor) -> Tensor:
    """Set ``found_inf`` (0-dim float32, on the tensors' device) to 1.0 if any element of ``tensors``
    (dense, floating) is inf or nan, reading them only; it is never cleared. Returns ``found_inf``.

    The check before a step that unscales inside its own kernel: ``torch._amp_foreach_non_finite_check_and_unscale_``
    with an inverse scale of 1 gives the same flag but writes every tensor back (CPU: one read-only
    parallel pass here instead; CUDA: torch's op)."""
    for i, t in enumerate(tensors):
        _check_dense("multi_tensor_check_finite", f"tensors[{i}]", t)
        if not t.is_floating_point():
            raise TypeError(f"multi_tensor_check_finite: tensors[{i}] must be floating point, got {t.dtype}")
        if t.device != found_inf.device:
            raise ValueError(f"multi_tensor_check_finite: tensors[{i}] is on {t.device} but found_inf is on "
                             f"{found_inf.device}")
    if found_inf.dtype != torch.float32 or found_inf.numel() != 1:
        raise TypeError(f"multi_tensor_check_finite: found_inf must be one float32 element, got {found_inf.dtype} "
                        f"of shape {tuple(found_inf.shape)}")
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return found_inf
    ext = _ext_for(found_inf.device)
    if ext is not None and hasattr(ext, "multi_tensor_check_finite") and _ext_accepts(tensors):
        ext.multi_tensor_check_finite(list(tensors), found_inf)
    else:
        _check_finite_fallback(tensors, found_inf)
    return found_inf


def _check_finite_fallback(tensors: Sequence[Tensor], found_inf: Tensor) -> None:
    """Pure-PyTorch multi_tensor_check_finite (no host read)."""
    bad = torch.stack([(~torch.isfinite(t)).any() for t in tensors]).any().float()
    torch.maximum(found_inf, bad.reshape(found_inf.shape), out=found_inf)


def multi_tensor_l2norm(tensors: Sequence[Tensor], per_tensor: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Global L2 norm (fp32, 0-dim) of all ``tensors`` (dense, floating) and, if ``per_tensor``, each one's norm."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32), (torch.zeros(0) if per_tensor else None)
    ext = _ext_for(tensors[0].device)
    if ext is not None and hasattr(ext, "multi_tensor_l2norm") and _ext_accepts(tensors):
        total, each = ext.multi_tensor_l2norm(list(tensors), per_tensor)
    else:
        total, each = _l2norm_fallback(tensors)
    return total, (each if per_tensor else None)


def _l2norm_fallback(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Pure-PyTorch multi_tensor_l2norm: (global norm, per-tensor norms), fp32. Checks what the kernels refuse."""
    for i, t in enumerate(tensors):
        _check_dense("multi_tensor_l2norm", f"tensors[{i}]", t)
        if not t.is_floating_point():
            raise TypeError(f"multi_tensor_l2norm: tensors[{i}] must be floating point, got {t.dtype}")
    each = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    return torch.linalg.vector_norm(each), each


# --------------------------------------------------------------------------------------
# Fused optimizer updates (one call per param group and dtype over lists of tensors)
#
# Shared conventions: ``steps`` are per-tensor 0-dim float32 step counters that the op
# increments itself; ``grad_scale`` (0-dim fp32) divides the grads in the kernel;
# ``found_inf`` (0-dim fp32) non-zero means the op changes NOTHING (params, state, steps,
# model copies). ``model_copies`` (optional, 16-bit) receive the updated fp32 ``params``
# rounded to their dtype in the same pass (fp32 master weights + half model copy).
# All math is fp32; state tensors have the dtype of their param.
# --------------------------------------------------------------------------------------

_OPT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def local_shards(*lists: Optional[Sequence[Tensor]]) -> tuple:
    """``lists`` with every DTensor replaced by its local shard (``to_local()``, same storage), so an
    elementwise kernel updates this rank's part of each tensor in place; ``None`` stays ``None``.
    Returned as given when the first list (the params) holds no DTensor."""
    if _DTensor is None or not any(isinstance(p, _DTensor) for p in lists[0]):
        return lists
    return tuple(None if lst is None else [t.to_local() if isinstance(t, _DTensor) else t for t in lst]
                 for lst in lists)


def _check_scalar_tensor(op: str, name: str, t: Optional[Tensor], device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a 0-dim float32 tensor or None, got {type(t).__name__}")
    if t.numel() != 1 or t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be a one-element float32 tensor, got shape {tuple(t.shape)} {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the params are on {device}")


def _check_optim_args(
    op: str,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: dict,
    steps: Optional[Sequence[Tensor]],
    grad_scale: Optional[Tensor],
    found_inf: Optional[Tensor],
    model_copies: Optional[Sequence[Tensor]],
) -> None:
    """Raise TypeError/ValueError naming the list and index of the first bad tensor."""
    n = len(params)
    lists = {"grads": grads, **state}
    if steps is not None:
        lists["steps"] = steps
    if model_copies is not None:
        lists["model_copies"] = model_copies
    for name, lst in lists.items():
        if len(lst) != n:
            raise ValueError(f"{op}: {name} has {len(lst)} tensors but params has {n}; all lists must have equal length")
    if n == 0:
        return
    device = params[0].device
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"{op}: params[{i}] is not a tensor")
        for name, lst in (("params", params), *lists.items()):
            if isinstance(lst[i], Tensor):
                _check_dense(op, f"{name}[{i}]", lst[i])
        if p.dtype not in _OPT_DTYPES:
            raise TypeError(f"{op}: params[{i}] must be float32/float16/bfloat16, got {p.dtype}")
        if p.device != device:
            raise ValueError(f"{op}: params[{i}] is on {p.device} but params[0] is on {device}; one call per device")
        if not p.is_contiguous():
            raise ValueError(f"{op}: params[{i}] must be contiguous (updated in place)")
        g = grads[i]
        if not isinstance(g, Tensor) or g.dtype not in _OPT_DTYPES:
            raise TypeError(f"{op}: grads[{i}] must be a float32/float16/bfloat16 tensor, got {getattr(g, 'dtype', type(g))}")
        if g.dtype != grads[0].dtype:
            raise TypeError(f"{op}: grads must share one dtype, grads[{i}] is {g.dtype} but grads[0] is {grads[0].dtype}")
        if g.shape != p.shape or g.device != device:
            raise ValueError(
                f"{op}: grads[{i}] {tuple(g.shape)}@{g.device} does not match params[{i}] {tuple(p.shape)}@{device}"
            )
        for name, lst in state.items():
            s = lst[i]
            if not isinstance(s, Tensor):
                raise TypeError(f"{op}: {name}[{i}] is not a tensor")
            if s.dtype != p.dtype:
                raise TypeError(f"{op}: {name}[{i}] must have its param's dtype {p.dtype}, got {s.dtype}")
            if s.shape != p.shape or s.device != device:
                raise ValueError(
                    f"{op}: {name}[{i}] {tuple(s.shape)}@{s.device} does not match params[{i}] {tuple(p.shape)}@{device}"
                )
            if not s.is_contiguous():
                raise ValueError(f"{op}: {name}[{i}] must be contiguous (updated in place)")
        if steps is not None:
            s = steps[i]
            if not isinstance(s, Tensor) or s.numel() != 1 or s.dtype != torch.float32 or s.device != device:
                raise TypeError(f"{op}: steps[{i}] must be a one-element float32 tensor on {device}")
        if model_copies is not None:
            c = model_copies[i]
            if p.dtype != torch.float32:
                raise TypeError(f"{op}: with model_copies the params are fp32 masters, params[{i}] is {p.dtype}")
            if not isinstance(c, Tensor) or c.dtype not in (torch.float16, torch.bfloat16):
                raise TypeError(f"{op}: model_copies[{i}] must be float16/bfloat16, got {getattr(c, 'dtype', type(c))}")
            if c.shape != p.shape or c.device != device or not c.is_contiguous():
                raise ValueError(f"{op}: model_copies[{i}] must be contiguous and match params[{i}] {tuple(p.shape)}@{device}")
    if len(set(p.dtype for p in params)) != 1:
        raise TypeError(f"{op}: params must share one dtype, got {sorted(set(str(p.dtype) for p in params))}")
    _check_scalar_tensor(op, "grad_scale", grad_scale, device)
    _check_scalar_tensor(op, "found_inf", found_inf, device)


@contextlib.contextmanager
def _undone_if(found_inf: Optional[Tensor], *groups: Optional[Sequence[Tensor]]) -> Iterator[None]:
    """Run the update in the body, then put back every tensor of ``groups`` where ``found_inf`` is
    non-zero: device ops only (a copy of the touched tensors and a ``torch.where``), no host read."""
    if found_inf is None:
        yield
        return
    tensors = [t for group in groups if group is not None for t in group]
    saved = [t.clone() for t in tensors]
    yield
    skip = found_inf.reshape(()) != 0
    for t, old in zip(tensors, saved):
        t.copy_(torch.where(skip, old, t))


def _unscaled_fp32(grad: Tensor, grad_scale: Optional[Tensor]) -> Tensor:
    g = grad.float()
    return g / grad_scale.reshape(()) if grad_scale is not None else g


def _store(dst: Tensor, src_fp32: Tensor) -> None:
    if dst.data_ptr() != src_fp32.data_ptr():
        dst.copy_(src_fp32)


def _torch_fused_grads(params: Sequence[Tensor], grads: Sequence[Tensor], grad_scale: Optional[Tensor]):
    """Grads as torch's fused optimizer kernels take them (the params' dtype), or None where they
    cannot without changing our numerics (grads wider than 16-bit params). Never the caller's
    tensors when the kernel writes them: given grad_scale, torch's kernels store the unscaled
    grads back; ours leave grads untouched."""
    pdtype, gdtype = params[0].dtype, grads[0].dtype
    if gdtype != pdtype:
        return [g.to(pdtype) for g in grads] if pdtype == torch.float32 else None
    return [g.clone() for g in grads] if grad_scale is not None else list(grads)


def _adam_fallback(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps,
                   weight_decay, adam_w_mode, bias_correction, grad_scale, found_inf, model_copies) -> None:
    """torch's own fused Adam/AdamW kernel (same math: fp32 opmath, decoupled or L2 decay, AMSGrad)
    where it applies (bias correction on, grads convertible), else a per-tensor loop."""
    with _undone_if(found_inf, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, model_copies):
        fused_grads = _torch_fused_grads(params, grads, grad_scale) if bias_correction else None
        if fused_grads is not None:
            torch._foreach_add_(list(steps), 1.0)  # torch's kernels read the already advanced step
            fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
            fused(list(params), fused_grads, list(exp_avgs), list(exp_avg_sqs),
                  list(max_exp_avg_sqs) if max_exp_avg_sqs is not None else [], list(steps), lr=lr, beta1=beta1,
                  beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=max_exp_avg_sqs is not None, maximize=False,
                  grad_scale=grad_scale)
            if model_copies is not None:
                torch._foreach_copy_(list(model_copies), list(params))
            return
        for i, p in enumerate(params):
            g = _unscaled_fp32(grads[i], grad_scale)
            steps[i].add_(1)
            step = steps[i].reshape(()).double()  # stays on the device: no host synchronisation
            pf, m, v = p.float(), exp_avgs[i].float(), exp_avg_sqs[i].float()
            if weight_decay != 0:
                if adam_w_mode:
                    pf.mul_(1 - lr * weight_decay)
                else:
                    g = g.add(pf, alpha=weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bc1 = (1 - beta1**step).float() if bias_correction else 1.0
            bc2_sqrt = (1 - beta2**step).sqrt().float() if bias_correction else 1.0
            if max_exp_avg_sqs is not None:
                vmax = max_exp_avg_sqs[i].float()
                torch.maximum(vmax, v, out=vmax)
                _store(max_exp_avg_sqs[i], vmax)
                denom = (vmax.sqrt() / bc2_sqrt).add_(eps)
            else:
                denom = (v.sqrt() / bc2_sqrt).add_(eps)
            pf.add_((m / denom) * (-lr / bc1))
            _store(p, pf)
            _store(exp_avgs[i], m)
            _store(exp_avg_sqs[i], v)
            if model_copies is not None:
                model_copies[i].copy_(pf)


def multi_tensor_adam(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    max_exp_avg_sqs: Optional[Sequence[Tensor]] = None,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    model_copies: Optional[Sequence[Tensor]] = None,
    checked: bool = False,
) -> None:
    """One Adam/AdamW step over lists of tensors, in place (torch.optim.Adam/AdamW semantics).

    ``adam_w_mode``: decoupled weight decay ``p *= 1 - lr * weight_decay`` (AdamW) instead of
    the L2 term ``g += weight_decay * p`` (Adam). ``max_exp_avg_sqs`` given = AMSGrad.
    ``checked=True``: the caller validated the lists (cached), the per-tensor Python checks are
    skipped (the compiled entry point still checks every argument).
    """
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_copies = local_shards(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_copies)
    state = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if max_exp_avg_sqs is not None:
        state["max_exp_avg_sqs"] = max_exp_avg_sqs
    if not checked:
        _check_optim_args("multi_tensor_adam", params, grads, state, steps, grad_scale, found_inf, model_copies)
    if not params:
        return
    ext = _ext_for(params[0].device)
    if ext is not None and hasattr(ext, "multi_tensor_adam"):
        ext.multi_tensor_adam(
            list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
            list(max_exp_avg_sqs) if max_exp_avg_sqs is not None else [], list(steps),
            list(model_copies) if model_copies is not None else [],
            float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adam_w_mode),
            bool(bias_correction), grad_scale, found_inf,
        )
    else:
        _adam_fallback(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps,
                       weight_decay, adam_w_mode, bias_correction, grad_scale, found_inf, model_copies)


def _sgd_fallback(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, first_run,
                  grad_scale, found_inf, model_copies) -> None:
    """torch's own fused SGD kernel (torch.optim.SGD semantics) where the grads allow, else a loop.

    Not for 16-bit params on the CPU: torch 2.13's CPU ``_fused_sgd_`` leaves the vectorised part
    of bf16/fp16 params unchanged (measured: 1000 ones, lr 0.1, grad 1 -> only the tail moves)."""
    with _undone_if(found_inf, params, momentum_buffers if momentum != 0 else None, model_copies):
        usable = params[0].dtype == torch.float32 or params[0].is_cuda
        fused_grads = _torch_fused_grads(params, grads, grad_scale) if usable else None
        if fused_grads is not None:
            torch._fused_sgd_(list(params), fused_grads, list(momentum_buffers) if momentum != 0 else [],
                              weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
                              nesterov=nesterov, maximize=False, is_first_step=first_run, grad_scale=grad_scale)
            if model_copies is not None:
                torch._foreach_copy_(list(model_copies), list(params))
            return
        for i, p in enumerate(params):
            g = _unscaled_fp32(grads[i], grad_scale)
            pf = p.float()
            if weight_decay != 0:
                g = g.add(pf, alpha=weight_decay)
            if momentum != 0:
                buf = momentum_buffers[i].float()
                if first_run:
                    buf.copy_(g)
                else:
                    buf.mul_(momentum).add_(g, alpha=1 - dampening)
                _store(momentum_buffers[i], buf)
                g = g.add(buf, alpha=momentum) if nesterov else buf
            pf.add_(g, alpha=-lr)
            _store(p, pf)
            if model_copies is not None:
                model_copies[i].copy_(pf)


def multi_tensor_sgd(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Optional[Sequence[Tensor]],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    first_run: bool = False,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    model_copies: Optional[Sequence[Tensor]] = None,
    checked: bool = False,
) -> None:
    """One SGD step in place (torch.optim.SGD semantics). ``momentum_buffers`` are required when
    ``momentum != 0``; ``first_run`` means they are initialised to the (decayed) gradient.
    ``checked``: as :func:`multi_tensor_adam`."""
    params, grads, momentum_buffers, model_copies = local_shards(params, grads, momentum_buffers, model_copies)
    state = {}
    if momentum != 0:
        if momentum_buffers is None:
            raise ValueError("multi_tensor_sgd: momentum_buffers are required when momentum != 0")
        state["momentum_buffers"] = momentum_buffers
    if not checked:
        _check_optim_args("multi_tensor_sgd", params, grads, state, None, grad_scale, found_inf, model_copies)
    if not params:
        return
    ext = _ext_for(params[0].device)
    if ext is not None and hasattr(ext, "multi_tensor_sgd"):
        ext.multi_tensor_sgd(
            list(params), list(grads), list(momentum_buffers) if momentum != 0 else [],
            list(model_copies) if model_copies is not None else [],
            float(lr), float(momentum), float(dampening), float(weight_decay), bool(nesterov), bool(first_run),
            grad_scale, found_inf,
        )
    else:
        _sgd_fallback(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, first_run,
                      grad_scale, found_inf, model_copies)


def _adadelta_fallback(params, grads, square_avgs, acc_deltas, steps, lr, rho, eps, weight_decay, grad_scale,
                       found_inf, model_copies) -> None:
    with _undone_if(found_inf, params, square_avgs, acc_deltas, steps, model_copies):
        for i, p in enumerate(params):
            g = _unscaled_fp32(grads[i], grad_scale)
            steps[i].add_(1)
            pf, sq, acc = p.float(), square_avgs[i].float(), acc_deltas[i].float()
            if weight_decay != 0:
                g = g.add(pf, alpha=weight_decay)
            sq.mul_(rho).addcmul_(g, g, value=1 - rho)
            std = sq.add(eps).sqrt_()
            delta = acc.add(eps).sqrt_().div_(std).mul_(g)
            acc.mul_(rho).addcmul_(delta, delta, value=1 - rho)
            pf.add_(delta, alpha=-lr)
            _store(p, pf)
            _store(square_avgs[i], sq)
            _store(acc_deltas[i], acc)
            if model_copies is not None:
                model_copies[i].copy_(pf)


def multi_tensor_adadelta(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    square_avgs: Sequence[Tensor],
    acc_deltas: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float = 0.0,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    model_copies: Optional[Sequence[Tensor]] = None,
) -> None:
    """One Adadelta step in place (torch.optim.Adadelta semantics)."""
    params, grads, square_avgs, acc_deltas, model_copies = local_shards(
        params, grads, square_avgs, acc_deltas, model_copies)
    state = {"square_avgs": square_avgs, "acc_deltas": acc_deltas}
    _check_optim_args("multi_tensor_adadelta", params, grads, state, steps, grad_scale, found_inf, model_copies)
    if not params:
        return
    ext = _ext_for(params[0].device)
    if ext is not None and hasattr(ext, "multi_tensor_adadelta"):
        ext.multi_tensor_adadelta(
            list(params), list(grads), list(square_avgs), list(acc_deltas), list(steps),
            list(model_copies) if model_copies is not None else [],
            float(lr), float(rho), float(eps), float(weight_decay), grad_scale, found_inf,
        )
    else:
        _adadelta_fallback(params, grads, square_avgs, acc_deltas, steps, lr, rho, eps, weight_decay, grad_scale,
                           found_inf, model_copies)


def _reduced_norms(op: str, reduce_norms: Callable[[Tensor], Tensor], squares: Tensor) -> Tensor:
    """``reduce_norms(squares)``, refused unless it is a tensor of ``squares``' shape, dtype and device."""
    out = reduce_norms(squares)
    if not isinstance(out, Tensor) or out.dtype != squares.dtype:
        raise TypeError(f"{op}: reduce_norms must return a {squares.dtype} tensor (the summed squared norms), "
                        f"got {getattr(out, 'dtype', type(out).__name__)}")
    if out.shape != squares.shape or out.device != squares.device:
        raise ValueError(f"{op}: reduce_norms must return shape {tuple(squares.shape)} on {squares.device}, "
                         f"got {tuple(out.shape)} on {out.device}")
    return out


def _lamb_fallback(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                   bias_correction, grad_averaging, adam_w_mode, global_grad_norm, max_grad_norm, use_nvlamb,
                   grad_scale, found_inf, model_copies, reduce_norms=None) -> None:
    """Per-tensor loops (torch has no fused LAMB) with no host synchronisation inside: clip factor,
    bias corrections and trust ratios stay tensors on the device. Two passes, as the kernels: the
    moments and the update with the squared norms of param and update, then (after ``reduce_norms``)
    the update applied with the trust ratio. A set ``found_inf`` puts back what was touched (every rank
    still joins ``reduce_norms``)."""
    with _undone_if(found_inf, params, exp_avgs, exp_avg_sqs, steps, model_copies):
        gnorm = global_grad_norm.reshape(())
        clip = (gnorm / max_grad_norm).clamp_min(1.0) if max_grad_norm > 0 else 1.0
        beta3 = 1 - beta1 if grad_averaging else 1.0
        trust_ratio = weight_decay != 0 or use_nvlamb
        updates, squares = [], []
        for i, p in enumerate(params):
            g = _unscaled_fp32(grads[i], grad_scale) / clip
            steps[i].add_(1)
            step = steps[i].reshape(()).double()
            bc1 = (1 - beta1**step).float() if bias_correction else 1.0
            bc2 = (1 - beta2**step).float() if bias_correction else 1.0
            pf, m, v = p.float(), exp_avgs[i].float(), exp_avg_sqs[i].float()
            if weight_decay != 0 and not adam_w_mode:
                g = g.add(pf, alpha=weight_decay)
            m.mul_(beta1).add_(g, alpha=beta3)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = (m / bc1).div_((v / bc2).sqrt_().add_(eps))
            if weight_decay != 0 and adam_w_mode:
                update.add_(pf, alpha=weight_decay)
            _store(exp_avgs[i], m)
            _store(exp_avg_sqs[i], v)
            updates.append((pf, update))
            if trust_ratio:
                squares.append(torch.stack([pf.square().sum(), update.square().sum()]))
        if trust_ratio and params:
            squares = torch.stack(squares)
            if reduce_norms is not None:
                squares = _reduced_norms("multi_tensor_lamb", reduce_norms, squares)
            norms = squares.sqrt()
            trust = torch.where((norms[:, 0] != 0) & (norms[:, 1] != 0), norms[:, 0] / norms[:, 1], 1.0) * lr
        for i, (pf, update) in enumerate(updates):
            if trust_ratio:
                pf.sub_(update * trust[i])
            else:
                pf.add_(update, alpha=-lr)
            _store(params[i], pf)
            if model_copies is not None:
                model_copies[i].copy_(pf)


def multi_tensor_lamb(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    global_grad_norm: Tensor,
    max_grad_norm: float = 1.0,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    adam_w_mode: bool = True,
    use_nvlamb: bool = False,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    model_copies: Optional[Sequence[Tensor]] = None,
    reduce_norms: Optional[Callable[[Tensor], Tensor]] = None,
) -> None:
    """One LAMB step in place with apex FusedLAMB semantics.

    ``global_grad_norm`` (0-dim fp32) is the L2 norm of all *unscaled* grads of the optimizer;
    grads are divided by ``global_grad_norm / max_grad_norm`` when it exceeds ``max_grad_norm``
    (``max_grad_norm <= 0`` disables clipping). The per-tensor trust ratio
    ``||p|| / ||update||`` scales ``lr`` when ``weight_decay != 0`` or ``use_nvlamb``.

    ``reduce_norms`` (for sharded params: the tensors are local shards or DTensors): called with the
    ``[len(params), 2]`` squared norms of each local param and update (fp64 from the compiled
    kernels, fp32 from the fallback), it returns them summed over the ranks that hold the other
    shards of each tensor, same shape and dtype (the trust ratio is that of the whole tensor). The
    compiled kernels then run as two calls (``multi_tensor_lamb_moments``, the reduction,
    ``multi_tensor_lamb_apply``); with ``found_inf`` set both write nothing and the reduction still
    runs, so every rank joins it.
    """
    params, grads, exp_avgs, exp_avg_sqs, model_copies = local_shards(params, grads, exp_avgs, exp_avg_sqs, model_copies)
    state = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    _check_optim_args("multi_tensor_lamb", params, grads, state, steps, grad_scale, found_inf, model_copies)
    if not params:
        return
    if global_grad_norm is None:
        raise TypeError("multi_tensor_lamb: global_grad_norm is required")
    _check_scalar_tensor("multi_tensor_lamb", "global_grad_norm", global_grad_norm, params[0].device)
    ext = _ext_for(params[0].device)
    copies = list(model_copies) if model_copies is not None else []
    if reduce_norms is not None and not (weight_decay or use_nvlamb):
        reduce_norms = None  # no trust ratio: the norms are not needed
    if ext is not None and hasattr(ext, "multi_tensor_lamb") and reduce_norms is None:
        ext.multi_tensor_lamb(
            list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps), copies,
            float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(bias_correction),
            bool(grad_averaging), bool(adam_w_mode), global_grad_norm, float(max_grad_norm), bool(use_nvlamb),
            grad_scale, found_inf,
        )
    elif ext is not None and hasattr(ext, "multi_tensor_lamb_apply"):
        squares = ext.multi_tensor_lamb_moments(
            list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps), float(beta1), float(beta2),
            float(eps), float(weight_decay), bool(bias_correction), bool(grad_averaging), bool(adam_w_mode),
            global_grad_norm, float(max_grad_norm), grad_scale, found_inf,
        )
        squares = _reduced_norms("multi_tensor_lamb", reduce_norms, squares)
        ext.multi_tensor_lamb_apply(
            list(params), list(exp_avgs), list(exp_avg_sqs), list(steps), copies, float(lr), float(beta1),
            float(beta2), float(eps), float(weight_decay), bool(bias_correction), bool(adam_w_mode), bool(use_nvlamb),
            squares, found_inf,
        )
    else:
        _lamb_fallback(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                       bias_correction, grad_averaging, adam_w_mode, global_grad_norm, max_grad_norm, use_nvlamb,
                       grad_scale, found_inf, model_copies, reduce_norms)
