"""O2's forward reads the fp32 Parameters through half copies (issue 46, item 4; docs/o2-design.md, "Half copies
of the Parameters").

Under plain autocast every op that reads an fp32 Parameter casts it: a new tensor and an autograd node per
Parameter per forward. O2's policy keeps one half copy per Parameter, rewritten in place at its first read in each
forward region and after each optimizer step (later reads in the same epoch are torch's cast), so a step's forward
makes no ``_to_copy`` of a Parameter read once. Each test compares with the same computation through torch's cast (``set_half_copies(False)``, which is
exactly ``bf16-mixed``'s autocast), bit for bit: the copy holds the same rounded values and its grad reaches the
fp32 Parameter through the same cast backward.
"""
import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_amp.amp.forward import forward_context
from lightning_amp.amp.levels import resolve_properties
from lightning_amp.amp.o2 import policy as o2_policy
from support.o2_cases import matmul_cases as _matmul_cases

BF16 = torch.bfloat16
O2 = resolve_properties("O2", dtype=BF16)


@pytest.fixture
def held():
    policy = o2_policy.hold()
    previous = o2_policy.set_half_copies(True)
    yield
    o2_policy.set_half_copies(previous)
    policy.release()
    assert o2_policy.half_copies() == 0  # the last release drops every copy


class _Net(nn.Module):
    """A matmul, a convolution, a norm and a Parameter used twice (tied), the ops whose weights autocast casts."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.norm(self.conv(x).transpose(1, 2))
        h = F.gelu(self.proj(h))
        h = F.linear(h, self.proj.weight)  # the same Parameter read twice in one forward
        return self.head(h).float().square().mean()


def _batch(seed):
    return torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(seed))


class _Casts(TorchDispatchMode):
    """Counts the autograd casts (``_to_copy``) and the in-place rewrites (cross-dtype ``copy_``) of ``params``."""

    def __init__(self, params):
        super().__init__()
        self.ids = {id(p) for p in params}
        self.params = list(params)
        self.to_copy = self.rewrites = 0

    def _is_param(self, t):
        return any(t is p or (t.data_ptr() == p.data_ptr() and t.dtype == p.dtype) for p in self.params)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and self._is_param(args[0]):
            self.to_copy += 1
        if func is torch.ops.aten.copy_.default and self._is_param(args[1]) and args[0].dtype != args[1].dtype:
            self.rewrites += 1
        return out


def _train(model, steps, copies, between=lambda model, step: None, lr=0.1):
    """``steps`` SGD steps of ``model`` in O2's forward; the losses and the grads of the last step."""
    o2_policy.set_half_copies(copies)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        with forward_context(O2, "cpu"):
            loss = model(_batch(step))
        loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        o2_policy.new_epoch()  # what the runtime does after each step
        opt.zero_grad()
        between(model, step)
    return losses, grads, model


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_a_step_reads_each_parameter_through_its_copy_and_trains_as_torchs_cast(held):
    model = _Net()
    params = list(model.parameters())
    losses, grads, trained = _train(copy.deepcopy(model), 4, copies=True)
    ref_losses, ref_grads, ref_trained = _train(copy.deepcopy(model), 4, copies=False)
    _assert_same(losses, ref_losses)
    _assert_same(grads, ref_grads)
    _assert_same(trained.parameters(), ref_trained.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in trained.parameters())

    o2_policy.set_half_copies(True)
    weights = [p for p in model.parameters() if p.dim() > 1 or p is model.norm.weight]
    for step in range(3):
        counter = _Casts(params)
        with counter, forward_context(O2, "cpu"):
            loss = model(_batch(step))
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.sub_(0.1 * p.grad)
        model.zero_grad()
        # the first forward makes the copies by autograd casts; then each is rewritten in place at its first read;
        # the tied weight's second read is torch's cast (its two grads summed in fp32, as under autocast)
        if step == 0:
            assert (counter.to_copy, counter.rewrites) == (len(params) + 1, 0)
        else:
            assert (counter.to_copy, counter.rewrites) == (1, len(params))
    assert o2_policy.half_copies() >= len(weights)


def _write_through_the_parameter(model, step):
    with torch.no_grad():
        model.proj.weight.mul_(0.5)


def _write_through_data(model, step):
    model.proj.weight.data.clamp_(-0.05, 0.05)  # no version bump: a new forward region rewrites the copy


def _replace_data(model, step):
    model.head.weight.data = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("write", [_write_through_the_parameter, _write_through_data, _replace_data])
def test_writes_between_steps_are_read_by_the_next_forward(held, write):
    model = _Net()
    losses, _, trained = _train(copy.deepcopy(model), 3, copies=True, between=write)
    ref_losses, _, ref_trained = _train(copy.deepcopy(model), 3, copies=False, between=write)
    _assert_same(losses, ref_losses)
    _assert_same(trained.parameters(), ref_trained.parameters())


def _two_forwards_with_a_write_between(model, copies, write):
    o2_policy.set_half_copies(copies)
    with forward_context(O2, "cpu"):
        first = model(_batch(0))
        write(model)
        second = model(_batch(0))
    (first + second).backward()  # the first forward's graph is still alive when the second one runs
    return [first.detach(), second.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("write", ["in place", ".data", "optimizer step"])
def test_a_write_inside_a_forward_region_is_read_by_a_later_forward(held, write):
    def in_place(model):
        with torch.no_grad():
            model.proj.weight.add_(0.25)

    def through_data(model):  # WGAN's clip inside training_step, or an optimizer that writes through .data
        model.proj.weight.data.clamp_(-0.05, 0.05)

    def optimizer_step(model):  # manual optimization: a step between two forwards of one training_step
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(0.01)
        o2_policy.new_epoch()  # the runtime's step begins a new epoch

    fn = {"in place": in_place, ".data": through_data, "optimizer step": optimizer_step}[write]
    got = _two_forwards_with_a_write_between(_Net(), True, fn)
    ref = _two_forwards_with_a_write_between(_Net(), False, fn)
    assert not torch.equal(got[0], got[1])
    _assert_same(got, ref)


def test_a_graph_kept_across_forward_regions_keeps_its_copy(held):
    """A copy that a live graph saved is never rewritten: the later forward gets a fresh one (no inplace error)."""
    def run(copies):
        o2_policy.set_half_copies(copies)
        model = _Net()
        with forward_context(O2, "cpu"):
            kept = model(_batch(0))
        with torch.no_grad():
            model.proj.weight.mul_(2.0)
        with forward_context(O2, "cpu"):
            later = model(_batch(1))
        (kept + later).backward()
        return [kept.detach(), later.detach()] + [p.grad.clone() for p in model.parameters()]

    _assert_same(run(True), run(False))


def test_no_grad_and_inference_forwards(held):
    model = _Net()
    o2_policy.set_half_copies(True)
    with torch.inference_mode(), forward_context(O2, "cpu"):
        inferred = model(_batch(0))
    assert o2_policy.half_copies() == 0  # nothing is kept from inference mode
    with torch.no_grad(), forward_context(O2, "cpu"):
        no_grad = model(_batch(0))
    with forward_context(O2, "cpu"):
        trained = model(_batch(0))
    assert o2_policy.half_copies() > 0 and trained.requires_grad and not no_grad.requires_grad
    with torch.no_grad(), forward_context(O2, "cpu"):  # the copies serve a no_grad forward too
        again = model(_batch(0))
    o2_policy.set_half_copies(False)
    with forward_context(O2, "cpu"):
        ref = model(_batch(0))
    for out in (inferred, no_grad, trained, again):
        assert torch.equal(out, ref)


def test_the_copies_keep_no_parameter_alive_after_the_run():
    policy = o2_policy.hold()
    model = _Net()
    with forward_context(O2, "cpu"):
        model(_batch(0)).backward()
    assert o2_policy.half_copies() > 0
    alive = weakref.ref(model.proj.weight)
    del model
    policy.release()
    gc.collect()
    assert o2_policy.half_copies() == 0 and alive() is None


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_every_matmul_and_convolution_reads_the_copies_as_torchs_cast(held, dtype):
    """Each op of the policy's lower-precision rows, with fp32 Parameters, twice (the second read serves the copy):
    the values and the fp32 Parameters' grads equal those through torch's cast."""
    props = resolve_properties("O2", dtype=dtype)

    def run(copies):
        o2_policy.set_half_copies(copies)
        g = torch.Generator().manual_seed(3)
        x = torch.randn(4, 6, 8, generator=g).to(dtype)
        cases = _matmul_cases(x, g)
        outs = []
        for _ in range(2):
            with forward_context(props, "cpu"):
                ys = [fn() for _, fn in cases]
            sum(y.float().square().sum() for y in ys).backward()
            outs += [y.detach() for y in ys]
            assert all(y.dtype == dtype for y in ys)
        params = [t for _, fn in cases for t in _closure_params(fn)]
        return outs + [p.grad for p in dict.fromkeys(params)]

    _assert_same(run(True), run(False))


def _closure_params(fn):
    return [c.cell_contents for c in fn.__closure__ or () if isinstance(c.cell_contents, nn.Parameter)]


def test_set_half_copies_takes_a_bool():
    with pytest.raises(TypeError, match="`enabled` must be a bool"):
        o2_policy.set_half_copies(1)
