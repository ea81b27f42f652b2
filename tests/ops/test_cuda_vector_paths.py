"""The CUDA kernels' two walks over a chunk give the same bits.

The kernels move 16 bytes per load and store where every list's pointer of a tensor is 16-byte
aligned, then handle the chunk's last (size mod 4 or 8) elements one at a time; a tensor with an
unaligned pointer is walked one element at a time (csrc/cuda/multi_tensor_apply.cuh). Each op runs
here on fresh (aligned) tensors and on views of the same values one element into a larger buffer
(unaligned): results bit for bit equal, and the buffer's elements around the views untouched (no
write out of bounds). Sizes cover a chunk boundary (65536), tails of 1-7 elements and tensors
shorter than one vector.
"""
import pytest
import torch

from lightning_amp import ops
from lightning_amp.ops import _choice

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SIZES = (2 * 65536 + 13, 37, 3, 4096, 65536 + 8)
GUARD = 7.0  # what the buffers around the unaligned views hold


def _values(dtype, seed, scale=1.0, positive=False):
    g = torch.Generator().manual_seed(seed)
    out = [scale * torch.randn(n, generator=g) for n in SIZES]
    return [(t.abs() if positive else t).to(dtype) for t in out]


def _aligned(values):
    return [v.cuda() for v in values]


def _unaligned(values):
    """Each tensor as a view one element into a buffer of GUARD values (its pointer 2 or 4 bytes off
    16-byte alignment), and the buffers."""
    views, buffers = [], []
    for v in values:
        buf = torch.full((v.numel() + 9,), GUARD, dtype=v.dtype, device="cuda")
        view = buf[1:1 + v.numel()]
        view.copy_(v)
        assert view.is_contiguous() and view.data_ptr() % 16 != 0
        views.append(view)
        buffers.append(buf)
    return views, buffers


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _run_both(make_inputs, op):
    """op(*lists) on aligned tensor lists and on unaligned views of the same values; both outputs."""
    inputs = make_inputs()
    aligned, unaligned, buffers = [_aligned(lst) for lst in inputs], [], []
    for lst in inputs:
        views, bufs = _unaligned(lst)
        unaligned.append(views)
        buffers += bufs
    out_a, out_u = op(*aligned), op(*unaligned)
    for buf in buffers:
        assert (buf[0] == GUARD).item() and (buf[buf.numel() - 8:] == GUARD).all().item(), "write out of bounds"
    return out_a, out_u


def _assert_same_bits(out_a, out_u, what):
    for i, (a, u) in enumerate(zip(out_a, out_u)):
        assert torch.equal(_bits(a), _bits(u)), f"{what}: output {i} differs between the 16-byte and scalar walks"


def _flag():
    return torch.zeros((), device="cuda")


def _steps():
    return [torch.full((), 3.0, device="cuda") for _ in SIZES]


def _scale():
    return torch.full((), 4.0, device="cuda")


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _our_kernels(monkeypatch):
    assert ops.backend("cuda") == "cuda-ext"
    monkeypatch.setattr(_choice, "forced", _choice.OURS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_and_finite_check(dtype):
    def scale(src, dst):
        found, each = ops.multi_tensor_scale(src, dst, 0.5, per_tensor=True)
        return dst + src + [found, each]
    out_a, out_u = _run_both(lambda: [_values(dtype, 1), _values(torch.float32, 2)], scale)
    _assert_same_bits(out_a, out_u, "multi_tensor_scale")

    for pos in (0, 5, SIZES[0] - 1):  # in the vectorised bulk, a group's middle, the tail
        def check(tensors):
            tensors[0].view(-1)[pos] = float("nan")
            found = _flag()
            ops.multi_tensor_check_finite(tensors, found)
            return [found]
        out_a, out_u = _run_both(lambda: [_values(dtype, 3)], check)
        assert out_a[0].item() == 1.0 and out_u[0].item() == 1.0, pos


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adadelta(dtype):
    def step(p, g, sq, acc):
        ops.multi_tensor_adadelta(p, g, sq, acc, _steps(), lr=1.0, rho=0.9, eps=1e-6, weight_decay=1e-4,
                                  grad_scale=_scale(), found_inf=_flag())
        return p + g + sq + acc
    out_a, out_u = _run_both(lambda: [_values(dtype, 1), _values(dtype, 2, 4.0), _values(dtype, 3, positive=True),
                                      _values(dtype, 4, positive=True)], step)
    _assert_same_bits(out_a, out_u, "multi_tensor_adadelta")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lamb(dtype):
    def step(p, g, m, v):
        norm, _ = ops.multi_tensor_l2norm(g)
        ops.multi_tensor_lamb(p, g, m, v, _steps(), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                              global_grad_norm=norm, grad_scale=_scale(), found_inf=_flag())
        return p, g + m + v
    (p_a, rest_a), (p_u, rest_u) = _run_both(
        lambda: [_values(dtype, 1), _values(dtype, 2, 4.0), _values(dtype, 3, 0.1), _values(dtype, 4, 0.1, True)],
        step)
    _assert_same_bits(rest_a, rest_u, "multi_tensor_lamb moments")
    # the per-tensor norms are sums in another order on each walk: the trust ratio may differ in its last bit
    for a, u in zip(p_a, p_u):
        torch.testing.assert_close(u.float(), a.float(), rtol=torch.finfo(dtype).eps, atol=0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adam_and_sgd_kernels(dtype):
    def adam(p, g, m, v):
        ops.multi_tensor_adam(p, g, m, v, _steps(), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                              grad_scale=_scale(), found_inf=_flag())
        return p + g + m + v
    out_a, out_u = _run_both(lambda: [_values(dtype, 1), _values(dtype, 2, 4.0), _values(dtype, 3, 0.1),
                                      _values(dtype, 4, 0.1, True)], adam)
    _assert_same_bits(out_a, out_u, "multi_tensor_adam")

    def sgd(p, g, buf):
        ops.multi_tensor_sgd(p, g, buf, lr=1e-2, momentum=0.9, weight_decay=1e-4, found_inf=_flag())
        return p + g + buf
    out_a, out_u = _run_both(lambda: [_values(dtype, 1), _values(dtype, 2), _values(dtype, 3)], sgd)
    _assert_same_bits(out_a, out_u, "multi_tensor_sgd")


def test_master_weights_with_half_copies():
    """fp32 masters with bf16 model copies: 8 elements a group, two 16-byte vectors of each fp32 list."""
    def step(p, g, m, v, copies):
        ops.multi_tensor_adam(p, g, m, v, _steps(), model_copies=copies, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.01, grad_scale=_scale(), found_inf=_flag())
        return p + g + m + v + copies
    out_a, out_u = _run_both(lambda: [_values(torch.float32, 1), _values(torch.bfloat16, 2, 4.0),
                                      _values(torch.float32, 3, 0.1), _values(torch.float32, 4, 0.1, True),
                                      _values(torch.bfloat16, 1)], step)
    _assert_same_bits(out_a, out_u, "multi_tensor_adam with model copies")
