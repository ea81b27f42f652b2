"""``amp/function_backward.py``: a user's ``autograd.Function`` applied inside O2's forward gets its backward run
under the forward's autocast, on every torch in range, through the two things it leans on (docs/architecture.md,
"torch and Lightning internals"): ``vars(torch.autograd.Function)["apply"]`` replaced and put back as the same
object whatever its type, and the autograd engine restoring a node's thread-local autocast state after a
backward that raised (the post-hook that leaves autocast does not run then)."""
import threading

import pytest
import torch

from lightning_amp.amp import function_backward
from lightning_amp.amp.o2 import policy as o2_policy

pytestmark = pytest.mark.skipif(not o2_policy.available(), reason="O2's policy needs the compiled extension")

BF16 = torch.bfloat16


class _Linear(torch.autograd.Function):
    """``x @ w.t()`` saving the fp32 weight; backward records the autocast state it runs under."""

    seen = []

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        _Linear.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), grad.dtype))
        return grad @ weight, grad.t() @ x


class _Split(torch.autograd.Function):
    """Two outputs of one node, a non-tensor argument with a default and ``setup_context``."""

    @staticmethod
    def forward(x, chunks=2):
        return tuple(t.clone() for t in x.chunk(chunks, dim=-1))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        _Split.entries.append(torch.is_autocast_enabled("cpu"))
        return torch.cat(grads, dim=-1), None

    entries = []


class _Raises(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("the user's backward failed")


def _o2_forward():
    """What the plugins' O2 forward context opens, without a model (the kernels held for the block)."""
    stack = [o2_policy.held(), torch.autocast("cpu", dtype=BF16, cache_enabled=False), o2_policy.forward(),
             function_backward.autocast_backward()]

    class _Ctx:
        def __enter__(self):
            for ctx in stack:
                ctx.__enter__()

        def __exit__(self, *exc):
            for ctx in reversed(stack):
                ctx.__exit__(*exc)

    return _Ctx()


def test_torchs_apply_is_replaced_only_inside_and_put_back_as_the_same_object():
    torchs = vars(torch.autograd.Function)["apply"]  # a KeyError here: torch moved apply (see the inventory)
    with _o2_forward():
        assert vars(torch.autograd.Function)["apply"] is not torchs
        assert function_backward.depth() == 1
        with function_backward.autocast_backward():
            assert function_backward.depth() == 2
    assert vars(torch.autograd.Function)["apply"] is torchs
    assert function_backward.depth() == 0


def test_the_backward_runs_under_the_forwards_autocast_and_only_there():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    _Linear.seen.clear()
    with _o2_forward():
        y = _Linear.apply(x.to(BF16), w.to(BF16))
    y.float().sum().backward()
    assert _Linear.seen == [(True, BF16, BF16)]
    assert not torch.is_autocast_enabled("cpu")  # left again after the node ran
    # outside O2's forward (autocast alone: bf16-mixed) nothing changes: torch runs backward without autocast
    _Linear.seen.clear()
    with torch.autocast("cpu", dtype=BF16):
        y = _Linear.apply(x.to(BF16), w.to(BF16))
    y.float().sum().backward()
    assert _Linear.seen[0][0] is False


def test_the_same_grads_as_torchs_custom_bwd():
    """torch's own remedy (``custom_fwd``/``custom_bwd``) is the reference, bit for bit."""

    class _Decorated(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu")
        def forward(ctx, x, weight, bias):
            ctx.save_for_backward(x, weight)
            return x @ weight.t() + bias

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors
            return grad @ weight, grad.t() @ x, grad.sum(0)

    class _Plain(torch.autograd.Function):
        forward = staticmethod(_Decorated.forward.__wrapped__)
        backward = staticmethod(_Decorated.backward.__wrapped__)

    x = torch.randn(5, 8)
    g = torch.Generator()
    grads = {}
    for fn in (_Decorated, _Plain):
        g.manual_seed(1)
        w, b = torch.randn(6, 8, generator=g).requires_grad_(), torch.randn(6, generator=g).requires_grad_()
        with _o2_forward():
            out = fn.apply(x.to(BF16), w, b)  # under O2's policy ``+ b`` stays half: the grad meets an fp32 w
        assert out.dtype == BF16
        (out.float() ** 2).sum().backward()
        grads[fn] = (w.grad, b.grad)
    for ours, torchs in zip(grads[_Plain], grads[_Decorated]):
        assert torch.equal(ours, torchs)


def test_several_outputs_of_one_node_enter_autocast_once_and_setup_context_functions_work():
    x = torch.randn(3, 8, requires_grad=True)
    _Split.entries.clear()
    with _o2_forward():
        a, b = _Split.apply(x.to(BF16))
        c, d, e, f = _Split.apply(x.to(BF16), 4)
    (a.float().sum() + b.float().sum() + c.float().sum() + f.float().sum()).backward()
    assert _Split.entries == [True, True]
    assert not torch.is_autocast_enabled("cpu")
    expected = torch.ones_like(x)
    expected[:, :2] += 1  # c
    expected[:, 6:] += 1  # f
    assert torch.equal(x.grad, expected)


def test_a_backward_that_raises_leaves_no_autocast_behind():
    """The post-hook does not run when the backward raises; the engine's per-node thread-local state guard
    restores autocast. If a torch release stops doing so, this test fails (inventory row)."""
    x = torch.randn(3, 4, requires_grad=True)
    with _o2_forward():
        y = _Raises.apply(x.to(BF16))
    with pytest.raises(ValueError, match="the user's backward failed"):
        y.float().sum().backward()
    assert not torch.is_autocast_enabled("cpu")
    _Linear.seen.clear()
    w = torch.randn(6, 4, requires_grad=True)
    _Linear.apply(x, w).sum().backward()  # a later plain backward on this thread runs without autocast
    assert _Linear.seen == [(False, torch.get_autocast_dtype("cpu"), torch.float32)]


def _twenty_o2_steps_beside(other_thread, stop: threading.Event) -> None:
    """Apply ``_Linear`` in 20 O2 forwards (and their backwards) here while ``other_thread`` runs, until ``stop``."""
    _Linear.seen.clear()
    worker = threading.Thread(target=other_thread)
    worker.start()
    try:
        for _ in range(20):
            with _o2_forward():
                y = _Linear.apply(torch.randn(2, 4).to(BF16), torch.randn(3, 4, requires_grad=True).to(BF16))
            y.float().sum().backward()
    finally:
        stop.set()
        worker.join()


def test_another_thread_applying_a_function_meanwhile_gets_torchs_behaviour():
    results, stop = [], threading.Event()

    def other_thread():
        x, w = torch.randn(2, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
        while not stop.is_set():
            _Linear.apply(x, w).sum().backward()
            results.append(x.grad.clone())
            x.grad = None

    _twenty_o2_steps_beside(other_thread, stop)
    assert results and all(torch.equal(r, results[0]) for r in results)
    assert all(enabled for enabled, _, grad_dtype in _Linear.seen if grad_dtype == BF16)
    assert not any(enabled for enabled, _, grad_dtype in _Linear.seen if grad_dtype == torch.float32)
    assert vars(torch.autograd.Function)["apply"] is not None and function_backward.depth() == 0


def test_another_thread_running_its_own_autocast_keeps_it_in_its_functions_backward():
    """The other thread runs a float16 autocast of its own (a ``16-mixed`` forward and backward) while O2's bfloat16
    forward applies the same Function here: each backward runs under its own thread's autocast, never the other's."""
    F16 = torch.float16
    stop, errors = threading.Event(), []

    def other_thread():
        x, w = torch.randn(2, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
        try:
            while not stop.is_set():
                with torch.autocast("cpu", dtype=F16):
                    y = _Linear.apply(x.to(F16), w.to(F16))
                    y.float().sum().backward()
        except Exception as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    _twenty_o2_steps_beside(other_thread, stop)
    assert errors == []
    ours = [(enabled, dtype) for enabled, dtype, grad_dtype in _Linear.seen if grad_dtype == BF16]
    theirs = [(enabled, dtype) for enabled, dtype, grad_dtype in _Linear.seen if grad_dtype == F16]
    assert len(ours) == 20 and theirs
    assert set(ours) == {(True, BF16)} and set(theirs) == {(True, F16)}
    assert function_backward.depth() == 0
