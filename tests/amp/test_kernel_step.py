"""KernelStep: torch Adam/AdamW/SGD stepped by the fused kernels equal torch's own step on fp32 params;
which optimizers it takes (not a patched or hooked ``step``: that one runs, as under Lightning's precisions);
the grads each step driver leaves behind."""
import copy
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_amp import AmpO1Precision, AmpRuntime, FusedAdam
from lightning_amp.amp.kernel_step import KernelStep, supports

CASES = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "adam-l2-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01, amsgrad=True, betas=(0.8, 0.99)),
    "adam-decoupled": lambda ps: torch.optim.Adam(ps, lr=2e-3, weight_decay=0.05, decoupled_weight_decay=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.5, dampening=0.3),
}
ON = lambda device: torch.zeros((), device=device)  # noqa: E731  no overflow


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in ((33, 17), (17,), (5, 3, 4), (1,))]


def _moment_bound(key, group, peak):
    """How far two fp32 implementations of a moment may lie apart (another order of the same operations):
    ``m = beta * m + (1 - beta) * term`` rounds by at most 2 eps of ``peak`` (the largest term, squared for the
    second moment) per step, and a rounding error decays by ``beta`` per step, so the sum stays below
    ``2 eps peak / (1 - beta)``. Measured: at most 0.31 eps peak (60 seeds x 3 Adam cases; SGD's buffer exact).
    A wrong coefficient or a decay term dropped moves a moment by ~1e-2, 3-4 orders of magnitude above it."""
    eps = torch.finfo(torch.float32).eps
    if key == "step":
        return 0.0
    if key == "momentum_buffer":
        return 2 * eps * peak / (1 - group["momentum"])
    beta = group["betas"][0] if key == "exp_avg" else group["betas"][1]
    return 2 * eps * (peak if key == "exp_avg" else peak ** 2) / (1 - beta)


@pytest.mark.parametrize("name", sorted(CASES))
def test_100_steps_equal_torch_on_fp32_params(name):
    seed = torch.seed() % 2**31  # fresh inputs every run
    ref = [p.clone().requires_grad_() for p in _params(seed)]
    masters = [p.clone().requires_grad_() for p in _params(seed)]
    ref_opt, opt = CASES[name](ref), CASES[name](masters)
    step = KernelStep(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=10, gamma=0.7)
    gen = torch.Generator().manual_seed(seed + 1)
    travel = 0.0  # the sum of the learning rates: what an Adam param can move at most (|update| <~ lr)
    peak = 0.0  # the largest term a moment averages: |grad| + weight_decay * |param| (L2 decay adds it to the grad)
    for i in range(100):
        travel += ref_opt.param_groups[0]["lr"]
        for r, m in zip(ref, masters):
            r.grad = torch.randn(r.shape, generator=gen)
            m.grad = r.grad.clone()
            peak = max(peak, float((r.grad.abs() + 0.2 * r.detach().abs()).max()))
        if i == 50:  # a param_group edit takes effect
            for o in (opt, ref_opt):
                o.param_groups[0]["weight_decay"] = 0.2
        ref_opt.step()
        assert step.usable()
        step.step(ON)
        sched.step()
        ref_sched.step()
    for r, m in zip(ref, masters):
        # the docs' figure: 3e-7 of the largest param, or of the distance the steps can move it when that is
        # larger (a one-element param decayed to 1e-3 carries the rounding of 100 updates of ~lr each:
        # 1.9e-6 of its own value at seed 720094317); measured <= 1.6e-7 over 201 seeds x 5 cases (SGD exact
        # where ATen's loops use FMA, 0.4 of the bound with ATEN_CPU_CAPABILITY=default)
        scale = torch.clamp(r.abs().max(), min=travel)
        assert (m - r).abs().max() <= 3e-7 * scale, ((m - r).abs().max() / scale, f"seed {seed}")
    state, ref_state = opt.state_dict(), ref_opt.state_dict()
    assert state["state"].keys() == ref_state["state"].keys()
    for index in state["state"]:
        for key, value in state["state"][index].items():
            bound = _moment_bound(key, ref_opt.param_groups[0], peak)
            diff = (torch.as_tensor(value).float() - torch.as_tensor(ref_state["state"][index][key]).float()).abs()
            assert diff.max() <= bound, (key, float(diff.max()), bound, f"seed {seed}")
    # torch's format: the state loads into a plain torch optimizer, which continues like the reference
    plain_params = [m.detach().clone().requires_grad_() for m in masters]
    plain = CASES[name](plain_params)
    plain.load_state_dict(copy.deepcopy(state))
    for p, r in zip(plain_params, ref):
        p.grad = torch.ones_like(p)
        r.grad = torch.ones_like(r)
    plain.step()
    ref_opt.step()
    for p, r in zip(plain_params, ref):
        assert (p - r).abs().max() <= 2e-6 * r.abs().max()


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_overflow_changes_nothing_and_first_step_needs_host_flag(name):
    masters = [p.requires_grad_() for p in _params()]
    opt = CASES[name](masters)
    step = KernelStep(opt)
    for m in masters:
        m.grad = torch.randn_like(m)
    assert step.usable() and step.needs_host_flag
    step.step(ON, skipped_on_host=True)  # a skipped first step creates no state
    assert len(opt.state) == 0 or all(len(s) == 0 for s in opt.state.values())
    step.step(ON)
    assert step.usable() and not step.needs_host_flag
    before = ([m.clone() for m in masters], copy.deepcopy(opt.state_dict()))
    step.step(lambda device: torch.ones((), device=device))
    assert all(torch.equal(a, b) for a, b in zip(before[0], masters))
    after = opt.state_dict()
    for key, value in before[1]["state"][0].items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(after["state"][0][key])), key


def test_rule_of_what_runs_through_the_kernels():
    ps = [torch.randn(3, requires_grad=True)]
    assert supports(torch.optim.AdamW(ps)) and supports(torch.optim.SGD(ps, lr=0.1))
    assert not supports(torch.optim.AdamW(ps, maximize=True))
    assert not supports(torch.optim.Adam(ps, lr=torch.tensor(1e-3)))
    assert not supports(torch.optim.RMSprop(ps))
    hooked = torch.optim.AdamW(ps)
    hooked.register_step_post_hook(lambda *a: None)
    assert not supports(hooked)

    class Sub(torch.optim.AdamW):
        pass

    assert not supports(Sub(ps))
    edited = torch.optim.AdamW(ps)
    step = KernelStep(edited)
    assert step.usable()
    edited.add_param_group({"params": [torch.randn(2, requires_grad=True)], "maximize": True})
    assert not step.usable()  # the rule is checked again when the groups change


def _lr_scheduled(ps):
    opt = torch.optim.AdamW(ps)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step on the instance: only counts calls
    return opt


def test_only_torchs_own_step_runs_through_the_kernels(monkeypatch):
    """A step patched on the class or wrapped on the instance must run: the optimizer steps itself. torch's
    LR schedulers' call counter around the original is not a patch (the kernel step sets what it records)."""
    ps = [torch.randn(3, requires_grad=True)]
    assert supports(_lr_scheduled(ps))
    wrapped = torch.optim.AdamW(ps)
    step = KernelStep(wrapped)
    assert step.usable()
    original = wrapped.step
    wrapped.step = lambda *args, **kwargs: original(*args, **kwargs)
    assert not supports(wrapped) and not step.usable()  # wrapped after the plan was built: read every step
    lr_then_wrapped = _lr_scheduled(ps)
    lr_then_wrapped.step = (lambda f: lambda *a, **k: f(*a, **k))(lr_then_wrapped.step)
    assert not supports(lr_then_wrapped)
    plain = torch.optim.SGD(ps, lr=0.1)
    step = KernelStep(plain)
    assert step.usable()
    sgd_step = torch.optim.SGD.step
    monkeypatch.setattr(torch.optim.SGD, "step", lambda self, closure=None: sgd_step(self, closure))
    assert not supports(plain) and not step.usable()
    assert supports(torch.optim.AdamW(ps))  # the other classes keep their own


# -- a patched or hooked step under the Trainer: it runs, with closure=, as under Lightning's bf16-mixed ------


class _Recorded(BoringModel):
    """AdamW whose ``step`` is patched in one of three ways, each call recorded with the closure it got."""

    def __init__(self, how, calls):
        super().__init__()
        self.how, self.calls = how, calls

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.01)
        if self.how == "instance":
            step = opt.step

            def wrapped(*args, **kwargs):
                self.calls.append(kwargs.get("closure"))
                return step(*args, **kwargs)

            opt.step = wrapped
        elif self.how == "pre_hook":
            opt.register_step_pre_hook(lambda optimizer, args, kwargs: self.calls.append(kwargs.get("closure")))
        return opt


def _fit_recorded(how, precision, monkeypatch):
    calls = []
    if how == "class":
        adamw_step = torch.optim.AdamW.step

        def patched(self, closure=None):
            calls.append(closure)
            return adamw_step(self, closure)

        monkeypatch.setattr(torch.optim.AdamW, "step", patched)
    L.seed_everything(3)
    model = _Recorded(how, calls)
    precision = {"precision": precision} if isinstance(precision, str) else {"plugins": [precision]}
    L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, **precision).fit(model)
    monkeypatch.undo()
    return calls, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["class", "instance", "pre_hook"])
def test_patched_or_hooked_step_runs_with_its_closure_as_under_bf16_mixed(how, monkeypatch):
    ref_calls, ref_params = _fit_recorded(how, "bf16-mixed", monkeypatch)
    calls, params = _fit_recorded(how, AmpO1Precision(dtype="bfloat16"), monkeypatch)  # fused_update: the default
    assert len(ref_calls) == len(calls) == 4
    assert all(callable(c) for c in ref_calls + calls)  # Lightning's closure, and ours (already run)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=0, atol=0)  # torch's own step on the same grads: bitwise


# -- the grads each driver leaves behind --------------------------------------------------------------------

DRIVERS = {  # the optimizer and the step driver that steps it
    "kernel": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "protocol": lambda ps: FusedAdam(ps, lr=1e-2),
    "protocol-torch-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "host": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
}


@pytest.mark.parametrize("driver", list(DRIVERS))
def test_every_driver_leaves_the_grads_unscaled(driver):
    """After a step at loss scale 2^16, p.grad is the unscaled grad, whichever driver stepped (the protocol
    one unscaling in its kernel: nothing reads the grads before the step), as torch's GradScaler leaves them;
    and the step path knows it: unscaling again (``amp.unscale``, idempotent until the next backward) keeps them."""
    torch.manual_seed(torch.seed() % 2**31)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ref = copy.deepcopy(model)
    amp = AmpRuntime("O0", device_type="cpu", loss_scale=65536.0)
    amp.prepare(model)
    optimizer = DRIVERS[driver](list(model.parameters()))
    amp.connect([optimizer], {p: [n] for n, p in model.named_parameters()})
    state = amp.state_of(optimizer)
    for _ in range(3):
        x = torch.randn(4, 8)
        with amp.backward_context():
            amp.scale_loss(model(x).pow(2).mean()).backward()
        ref.zero_grad()
        ref(x).pow(2).mean().backward()
        assert state.driver == driver.split("-")[0]
        amp.step(optimizer)
        for unscale_again in (False, True):
            if unscale_again:
                amp.unscale(optimizer)
            for p, r in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                r.copy_(p)
        optimizer.zero_grad()


def test_a_scheduler_stepped_after_a_kernel_step_does_not_warn():
    """The kernel step stands in for torch's step wrapper, which records the call for the LR schedulers
    (``optimizer._opt_called``, docs/architecture.md's inventory): torch's scheduler must not warn that it was
    stepped before the optimizer. The first scheduler step (at its construction) is not checked by torch."""
    params = [torch.randn(5, requires_grad=True)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = KernelStep(opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*before.*optimizer.step")
        for _ in range(2):
            params[0].grad = torch.randn(5)
            step.step(ON)
            sched.step()
    assert opt.param_groups[0]["lr"] == 1e-3 * 0.25
