"""Every entry point of the compiled extension refuses bad input with a Python exception, and so does
the pure-PyTorch fallback behind the public op (``ops.<name>`` without the extension): the same
exception type and message.

One test per (entry point, case, device). Each case starts from a valid call (checked to
succeed first), breaks one thing, and expects a ValueError/TypeError whose message names the
problem. "home" is the device of the valid call; "stray" the device a misplaced tensor is on:
CPU tensors into CUDA calls and the reverse run on a GPU machine (cuda marker), meta tensors
everywhere. Meta tensors have no data: an entry point that touched a pointer or a stream before
checking devices would crash the interpreter here instead of raising.
"""
import pytest
import torch

from lightning_amp import ops
from lightning_amp.ops import _choice

EXT = ops._ext_for("cpu")
needs_ext = pytest.mark.skipif(EXT is None, reason=f"compiled extension not loaded: {ops.extension_error()}")
HAS_CUDA = torch.cuda.is_available()
EXT_CUDA = bool(EXT is not None and EXT.WITH_CUDA)


def _r(*shape, device, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).to(device)


def _z(device):
    return torch.zeros((), device=device)


def _wgrad(main_dtype):
    def build(d):
        return dict(input=_r(4, 6, device=d, dtype=torch.bfloat16), grad_output=_r(4, 5, device=d, dtype=torch.bfloat16),
                    main_grad=_r(5, 6, device=d, dtype=main_dtype))
    return build


def _pair(d):
    return [_r(8, device=d), _r(3, device=d)]


# name -> (build(device) -> ordered dict of the call's arguments, input slot, output slot, list slots)
OPS = {
    "wgrad_gemm_accum_fp32": (_wgrad(torch.float32), "input", "main_grad", ()),
    "wgrad_gemm_accum_fp16": (_wgrad(torch.bfloat16), "input", "main_grad", ()),
    "multi_tensor_scale": (lambda d: dict(src=_pair(d), dst=_pair(d), scale=0.5, found_inf=_z(d)),
                           "src", "dst", ("src", "dst")),
    "multi_tensor_l2norm": (lambda d: dict(tensors=_pair(d), per_tensor=True), "tensors", "tensors", ("tensors",)),
    "multi_tensor_check_finite": (lambda d: dict(tensors=_pair(d), found_inf=_z(d)), "tensors", "tensors",
                                  ("tensors",)),
    "multi_tensor_adam": (lambda d: dict(params=_pair(d), grads=_pair(d), exp_avgs=_pair(d), exp_avg_sqs=_pair(d),
                                         max_exp_avg_sqs=[], steps=[_z(d), _z(d)], model_copies=[], lr=1e-3,
                                         beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=True,
                                         bias_correction=True, grad_scale=None, found_inf=None),
                          "grads", "params", ("params", "grads", "exp_avgs", "exp_avg_sqs", "steps")),
    "multi_tensor_sgd": (lambda d: dict(params=_pair(d), grads=_pair(d), momentum_buffers=_pair(d), model_copies=[],
                                        lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                                        first_run=True, grad_scale=None, found_inf=None),
                         "grads", "params", ("params", "grads", "momentum_buffers")),
    "multi_tensor_adadelta": (lambda d: dict(params=_pair(d), grads=_pair(d), square_avgs=_pair(d),
                                             acc_deltas=_pair(d), steps=[_z(d), _z(d)], model_copies=[], lr=1.0,
                                             rho=0.9, eps=1e-6, weight_decay=0.0, grad_scale=None, found_inf=None),
                              "grads", "params", ("params", "grads", "square_avgs", "acc_deltas", "steps")),
    "multi_tensor_lamb": (lambda d: dict(params=_pair(d), grads=_pair(d), exp_avgs=_pair(d), exp_avg_sqs=_pair(d),
                                         steps=[_z(d), _z(d)], model_copies=[], lr=1e-3, beta1=0.9, beta2=0.999,
                                         eps=1e-6, weight_decay=0.01, bias_correction=True, grad_averaging=True,
                                         adam_w_mode=True, global_grad_norm=_z(d) + 1.0, max_grad_norm=1.0,
                                         use_nvlamb=False, grad_scale=None, found_inf=None),
                          "grads", "params", ("params", "grads", "exp_avgs", "exp_avg_sqs", "steps")),
    "multi_tensor_lamb_moments": (lambda d: dict(params=_pair(d), grads=_pair(d), exp_avgs=_pair(d),
                                                 exp_avg_sqs=_pair(d), steps=[_z(d), _z(d)], beta1=0.9, beta2=0.999,
                                                 eps=1e-6, weight_decay=0.01, bias_correction=True,
                                                 grad_averaging=True, adam_w_mode=True,
                                                 global_grad_norm=_z(d) + 1.0, max_grad_norm=1.0, grad_scale=None,
                                                 found_inf=None),
                                  "grads", "exp_avgs", ("params", "grads", "exp_avgs", "exp_avg_sqs", "steps")),
    "multi_tensor_lamb_apply": (lambda d: dict(params=_pair(d), exp_avgs=_pair(d), exp_avg_sqs=_pair(d),
                                               steps=[_z(d), _z(d)], model_copies=[], lr=1e-3, beta1=0.9, beta2=0.999,
                                               eps=1e-6, weight_decay=0.01, bias_correction=True, adam_w_mode=True,
                                               use_nvlamb=False,
                                               sq_norms=torch.rand(2, 2, dtype=torch.float64).to(d), found_inf=None),
                                "params", "exp_avg_sqs", ("params", "exp_avgs", "exp_avg_sqs", "steps")),
}


def _last(args, slot, new):
    """Replace the slot's tensor (or the last tensor of its list) by new(old)."""
    if isinstance(args[slot], list):
        args[slot][-1] = new(args[slot][-1])
    else:
        args[slot] = new(args[slot])


def _non_contiguous(t):
    if t.dim() == 2:
        return torch.empty(t.shape[1], t.shape[0], dtype=t.dtype, device=t.device).t()
    return torch.empty(t.numel() * 2, dtype=t.dtype, device=t.device)[::2]


def _all_to(args, device):
    for key, value in args.items():
        if isinstance(value, torch.Tensor):
            args[key] = value.to(device)
        elif isinstance(value, list):
            args[key] = [t.to(device) for t in value]


# case -> (applies to op?, break(args, op spec, stray device), exception, message regex)
def _stray(args, spec, stray):
    _last(args, spec[1], lambda t: t.to(stray))


CASES = {
    "stray_device": (lambda spec: True, _stray, ValueError, r"is on {stray}(:\d+)? but"),
    "wrong_dtype": (lambda spec: True, lambda a, spec, s: _last(a, spec[1], lambda t: t.double()), TypeError,
                    r"must be float32, float16 or bfloat16"),
    "wrong_shape": (lambda spec: spec[1] != spec[2],
                    lambda a, spec, s: _last(a, spec[2], lambda t: torch.empty(t.shape[0] + 1, *t.shape[1:],
                                                                               dtype=t.dtype, device=t.device)),
                    ValueError, r"shape"),
    "non_contiguous": (lambda spec: True, lambda a, spec, s: _last(a, spec[2], _non_contiguous), ValueError,
                       r"must be contiguous"),
    "unequal_lengths": (lambda spec: len(spec[3]) > 1, lambda a, spec, s: a[spec[3][1]].pop(), ValueError,
                        r"equal length"),
    "sparse": (lambda spec: True, lambda a, spec, s: _last(a, spec[1], lambda t: t.to_sparse()), TypeError,
               r"must be a dense \(strided\) tensor, got layout"),
    "complex": (lambda spec: True, lambda a, spec, s: _last(a, spec[1], lambda t: t.to(torch.complex64)), TypeError,
                r"must be float32, float16 or bfloat16, got ComplexFloat"),
    "empty_lists": (lambda spec: bool(spec[3]), lambda a, spec, s: [a[k].clear() for k in spec[3]], ValueError,
                    r"is empty"),
}

# (home, stray): the device of the valid call and, for "stray_device", of the misplaced tensor.
PAIRS = [("cpu", "meta"), ("cpu", "cuda"), ("cuda", "cpu"), ("cuda", "meta")]


def _params():
    for name, spec in OPS.items():
        for case, (applies, *_) in CASES.items():
            if not applies(spec):  # e.g. list lengths of a single-list op
                continue
            pairs = PAIRS if case == "stray_device" else [("cpu", None), ("cuda", None)]
            for home, stray in pairs:
                marks = [pytest.mark.cuda] if "cuda" in (home, stray) else []
                ident = f"{name}-{case}-{home}" + (f"+{stray}" if stray else "")
                yield pytest.param(name, case, home, stray, id=ident, marks=marks)


def _call(name, args):
    return getattr(EXT, name)(*args.values())


def _opt(lst):
    return lst if lst else None


# name -> the public op called with the entry point's arguments (its fallback when ops._ext._EXT is None)
PUBLIC = {
    "wgrad_gemm_accum_fp32": lambda a: ops.wgrad_gemm_accum_fp32(a["input"], a["grad_output"], a["main_grad"]),
    "wgrad_gemm_accum_fp16": lambda a: ops.wgrad_gemm_accum_fp16(a["input"], a["grad_output"], a["main_grad"]),
    "multi_tensor_scale": lambda a: ops.multi_tensor_scale(a["src"], a["dst"], a["scale"]),
    "multi_tensor_l2norm": lambda a: ops.multi_tensor_l2norm(a["tensors"], a["per_tensor"]),
    "multi_tensor_check_finite": lambda a: ops.multi_tensor_check_finite(a["tensors"], a["found_inf"]),
    "multi_tensor_adam": lambda a: ops.multi_tensor_adam(
        a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["steps"], lr=a["lr"], beta1=a["beta1"],
        beta2=a["beta2"], eps=a["eps"], weight_decay=a["weight_decay"], adam_w_mode=a["adam_w_mode"],
        bias_correction=a["bias_correction"], max_exp_avg_sqs=_opt(a["max_exp_avg_sqs"]), grad_scale=a["grad_scale"],
        found_inf=a["found_inf"], model_copies=_opt(a["model_copies"])),
    "multi_tensor_sgd": lambda a: ops.multi_tensor_sgd(
        a["params"], a["grads"], a["momentum_buffers"], lr=a["lr"], momentum=a["momentum"], dampening=a["dampening"],
        weight_decay=a["weight_decay"], nesterov=a["nesterov"], first_run=a["first_run"], grad_scale=a["grad_scale"],
        found_inf=a["found_inf"], model_copies=_opt(a["model_copies"])),
    "multi_tensor_adadelta": lambda a: ops.multi_tensor_adadelta(
        a["params"], a["grads"], a["square_avgs"], a["acc_deltas"], a["steps"], lr=a["lr"], rho=a["rho"],
        eps=a["eps"], weight_decay=a["weight_decay"], grad_scale=a["grad_scale"], found_inf=a["found_inf"],
        model_copies=_opt(a["model_copies"])),
    "multi_tensor_lamb": lambda a: ops.multi_tensor_lamb(
        a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["steps"], lr=a["lr"], beta1=a["beta1"],
        beta2=a["beta2"], eps=a["eps"], weight_decay=a["weight_decay"], global_grad_norm=a["global_grad_norm"],
        max_grad_norm=a["max_grad_norm"], bias_correction=a["bias_correction"], grad_averaging=a["grad_averaging"],
        adam_w_mode=a["adam_w_mode"], use_nvlamb=a["use_nvlamb"], grad_scale=a["grad_scale"],
        found_inf=a["found_inf"], model_copies=_opt(a["model_copies"])),
}
_MULTI = ("multi_tensor_scale", "multi_tensor_l2norm", "multi_tensor_check_finite")
# cases the fallback of the multi-tensor ops accepts by design (float64 and strided tensors) or words
# differently (any floating dtype is fine there), and empty lists, which every public op takes as a no-op
FALLBACK_SKIPS = {"empty_lists": "all", "wrong_dtype": _MULTI, "non_contiguous": _MULTI}
FALLBACK_PATTERNS = {("complex", name): r"must be floating point, got ComplexFloat" for name in _MULTI}


def _fallback_params():
    for name in PUBLIC:
        for case, (applies, *_) in CASES.items():
            skip = FALLBACK_SKIPS.get(case, ())
            if not applies(OPS[name]) or skip == "all" or name in skip:
                continue
            stray = "meta" if case == "stray_device" else None
            yield pytest.param(name, case, stray, id=f"{name}-{case}" + (f"+{stray}" if stray else ""))


@pytest.mark.parametrize("impl", ["fallback", "ext-torch"])
@pytest.mark.parametrize("name,case,stray", list(_fallback_params()))
def test_fallback_bad_input_raises_as_the_entry_point(name, case, stray, impl, monkeypatch):
    """The public op on the fallback path (checked in Python) raises what the C++ entry point raises; so
    does the public op with the extension loaded and torch's kernels chosen wherever they can serve
    (lightning_amp/ops/_choice.py)."""
    if impl == "fallback":
        monkeypatch.setattr(ops._ext, "_EXT", None)
    elif EXT is None:
        pytest.skip(f"compiled extension not loaded: {ops.extension_error()}")
    else:
        monkeypatch.setattr(_choice, "forced", _choice.TORCH)
    _, breaker, exc, pattern = CASES[case]
    pattern = FALLBACK_PATTERNS.get((case, name), pattern)
    spec = OPS[name]
    torch.manual_seed(0)
    PUBLIC[name](spec[0]("cpu"))  # the unbroken call is valid
    args = spec[0]("cpu")
    breaker(args, spec, stray)
    with pytest.raises(exc, match=pattern.format(stray=stray)):
        PUBLIC[name](args)


@needs_ext
@pytest.mark.parametrize("name,case,home,stray", list(_params()))
def test_bad_input_raises(name, case, home, stray):
    if "cuda" in (home, stray) and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    if home == "cuda" and not EXT_CUDA:
        pytest.skip("this build has no CUDA kernels")
    _, breaker, exc, pattern = CASES[case]
    spec = OPS[name]
    torch.manual_seed(0)
    _call(name, spec[0](home))  # the unbroken call is valid
    args = spec[0](home)
    breaker(args, spec, stray)
    with pytest.raises(exc, match=pattern.format(stray=stray)):
        _call(name, args)


UNSUPPORTED = [
    pytest.param("meta", id="meta"),
    pytest.param("cuda", id="cuda-into-cpu-build", marks=pytest.mark.cuda),
]


@needs_ext
@pytest.mark.parametrize("device", UNSUPPORTED)
@pytest.mark.parametrize("name", list(OPS))
def test_device_without_kernels_raises(name, device):
    """All tensors on a device this build has no kernels for (meta; CUDA into a CPU-only build)."""
    if device == "cuda" and (not HAS_CUDA or EXT_CUDA):
        pytest.skip("needs a CUDA device and a CPU-only build")
    args = OPS[name][0]("cpu")
    _all_to(args, device)
    with pytest.raises(ValueError, match=rf"is on {device}(:\d+)?, but this build has kernels for"):
        _call(name, args)


SQ_NORMS_CASES = {
    "dtype": (lambda t: t.float(), TypeError, r"sq_norms must be Double, got Float"),
    "shape": (lambda t: t[:1], ValueError, r"sq_norms must have shape \[len\(params\), 2\] = \[2, 2\]"),
    "flat": (lambda t: t.reshape(-1), ValueError, r"sq_norms must have shape"),
    "device": (lambda t: t.to("meta"), ValueError, r"sq_norms is on meta but the params are on cpu"),
    "sparse": (lambda t: t.to_sparse(), TypeError, r"sq_norms must be a dense \(strided\) tensor"),
}


@needs_ext
@pytest.mark.parametrize("case", list(SQ_NORMS_CASES))
def test_lamb_apply_checks_sq_norms(case):
    """The squared norms handed to LAMB's second pass (after the all-reduce across shards) are checked too."""
    breaker, exc, pattern = SQ_NORMS_CASES[case]
    args = OPS["multi_tensor_lamb_apply"][0]("cpu")
    args["sq_norms"] = breaker(args["sq_norms"])
    with pytest.raises(exc, match=pattern):
        _call("multi_tensor_lamb_apply", args)
