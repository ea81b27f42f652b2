"""AmpPrecision / AmpO0..O3Plugin inside a real Lightning Trainer (CPU, tiny models, few steps)."""
import copy
import logging
import pickle
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import lightning_amp
from lightning_amp import AmpO0Precision, AmpO1Precision, AmpO2Precision, AmpO3Precision, AmpPrecision, main_params
from lightning_amp.trainer import precision as precision_module
from lightning_amp.amp import engine as engine_module
from lightning_amp.amp.gate import StepGate

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*GPU available.*")
        yield


def _data(n=64, batch_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=gen)
    y = torch.randint(0, 4, (n,), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


class Classifier(L.LightningModule):
    """Linear -> BatchNorm -> ReLU -> Linear; writes a non-finite grad at the steps in ``inject_at``."""

    def __init__(self, fused=False, inject_at=(), inject_value=float("inf"), scheduler=True, lr=1e-2, sgd=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        self.fused, self.inject_at, self.inject_value, self.scheduler, self.lr = fused, inject_at, inject_value, scheduler, lr
        self.seen = {}
        self.sgd = sgd

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen["input"] = x.dtype
        hidden = self.net[0](x)
        self.seen["linear"] = hidden.dtype
        self.seen["batchnorm"] = self.net[1](hidden).dtype
        out = self(x)
        self.seen["output"] = out.dtype
        return nn.functional.cross_entropy(out.float(), y)

    def on_after_backward(self):
        if self.global_step in self.inject_at:
            self.net[0].weight.grad[1, 2] = self.inject_value

    def configure_optimizers(self):
        if self.sgd:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused or None)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(model, plugin, steps=4, data=None, **kwargs):
    options = dict(
        accelerator="cpu", max_steps=steps, plugins=[plugin], logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )
    options.update(kwargs)
    trainer = L.Trainer(**options)
    trainer.fit(model, data if data is not None else _data())
    return trainer


# ---------------------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(opt_level="O4"), "opt_level"),
        (dict(dtype="float8"), "dtype"),
        (dict(loss_scale=0.0), "loss_scale"),
        (dict(loss_scale=-2.0), "loss_scale"),
        (dict(min_loss_scale=8.0, max_loss_scale=2.0), "min_loss_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(opt_level="O1", master_weights=True), "master_weights"),
        (dict(combine_grad="yes"), "combine_grad"),
        (dict(fused_update=1), "fused_update"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AmpPrecision(**kwargs)


def test_shorthands_fix_the_level_and_forward_kwargs():
    assert [p().properties.opt_level for p in (AmpO0Precision, AmpO1Precision, AmpO2Precision, AmpO3Precision)] == [
        "O0", "O1", "O2", "O3"
    ]
    plugin = AmpO2Precision(dtype="float16", loss_scale=128.0, keep_batchnorm_fp32=False)
    assert plugin.properties.loss_scale == 128.0 and plugin.loss_scale == 128.0
    assert plugin.properties.keep_batchnorm_fp32 is False and plugin.precision == "16-mixed"
    assert AmpO2Precision(dtype="float16").loss_scale == 2.0**16
    assert AmpO2Precision(dtype="bfloat16").loss_scale == 1.0
    assert AmpO3Precision(dtype="bfloat16").precision == "bf16-true"
    with pytest.raises(TypeError, match="opt_level"):
        AmpO2Precision(opt_level="O1")
    assert lightning_amp.AmpPrecision is AmpPrecision


# ---------------------------------------------------------------------------------------
# dtypes of params, masters and activations per level
# ---------------------------------------------------------------------------------------

LEVEL_CASES = [
    ("O0", "auto"), ("O1", "bfloat16"), ("O1", "float16"), ("O2", "bfloat16"), ("O2", "float16"),
    ("O3", "bfloat16"), ("O3", "float16"),
]


@pytest.mark.parametrize("level, dtype_name", LEVEL_CASES)
def test_dtypes_of_params_masters_and_activations(level, dtype_name):
    half = {"bfloat16": BF16, "float16": F16, "auto": torch.float32}[dtype_name]
    model = Classifier(sgd=(level, dtype_name) == ("O3", "float16"))  # fp16 Adam without masters: eps is 0
    plugin = AmpPrecision(level, dtype=dtype_name)
    trainer = _fit(model, plugin, steps=2)
    stepped = list(main_params(trainer.optimizers[0]))
    linear_w, bn_w = model.net[0].weight, model.net[1].weight
    fp32 = torch.float32
    if level in ("O0", "O1"):
        assert linear_w.dtype == bn_w.dtype == fp32
        assert stepped[0] is linear_w  # no masters: the optimizer steps on the model's params
        assert model.seen["input"] == fp32
        assert model.seen["linear"] == (fp32 if level == "O0" else half)
    elif level == "O2":
        # one set of params: the module's own fp32 Parameters are what the optimizer steps
        assert linear_w.dtype == bn_w.dtype == fp32 and model.net[1].running_mean.dtype == fp32
        assert stepped == list(model.parameters()) and all(p.dtype == fp32 for p in stepped)
        assert model.seen == {"input": fp32, "linear": half, "batchnorm": half, "output": fp32}  # as bf16-mixed
        assert all(s.dtype == fp32 for st in trainer.optimizers[0].state.values() for s in st.values()
                   if torch.is_tensor(s) and s.is_floating_point())
    else:  # O3
        assert linear_w.dtype == bn_w.dtype == half
        assert all(p.dtype == half for p in stepped)
        assert model.seen == {"input": half, "linear": half, "batchnorm": half, "output": half}
    assert model.dtype == (half if level == "O3" else fp32)
    assert plugin.skipped_steps == 0


def test_o3_fp16_adam_with_vanishing_eps_warns():
    with pytest.warns(UserWarning, match="eps=1e-08, which is 0 in torch.float16"):
        _fit(Classifier(), AmpO3Precision(dtype="float16"), steps=1)


def test_o3_keep_batchnorm_fp32():
    model = Classifier()
    _fit(model, AmpO3Precision(dtype="bfloat16", keep_batchnorm_fp32=True), steps=1)
    assert model.net[0].weight.dtype == BF16 and model.net[1].weight.dtype == torch.float32
    assert model.seen["batchnorm"] == BF16


# ---------------------------------------------------------------------------------------
# overflow: skip, no change, scale backoff, scheduler held, observability
# ---------------------------------------------------------------------------------------


class _Snapshots(L.Callback):
    def __init__(self):
        self.before, self.after = {}, {}

    @staticmethod
    def _take(trainer, pl_module):
        opt = trainer.optimizers[0]
        sched = trainer.lr_scheduler_configs[0].scheduler
        return {
            "model": [p.detach().clone() for p in pl_module.parameters()],
            "main": [p.detach().clone() for p in main_params(opt)],
            "state": copy.deepcopy([opt.state[p] for p in main_params(opt) if p in opt.state]),
            "sched": (sched.last_epoch, [g["lr"] for g in opt.param_groups]),
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step] = self._take(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = self._take(trainer, pl_module)


class _Collect(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    name, version = "collect", 0

    @property
    def experiment(self):
        return None

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _same(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize(
    "plugin_fn, value, scale_after",
    [
        (lambda: AmpO2Precision(dtype="float16", init_scale=2.0**10), float("inf"), 2.0**8),
        (lambda: AmpO1Precision(dtype="bfloat16"), float("nan"), 1.0),  # static scale 1.0 still skips
        (lambda: AmpO0Precision(), float("inf"), 1.0),
        (lambda: AmpO3Precision(dtype="bfloat16"), float("-inf"), 1.0),
    ],
    ids=["O2-fp16-dynamic", "O1-bf16-static", "O0", "O3-bf16"],
)
def test_nonfinite_grad_skips_step_and_holds_scheduler(monkeypatch, caplog, plugin_fn, value, scale_after, flag_timing):
    monkeypatch.setattr(engine_module, "OVERFLOW_WARN_AFTER", 2)
    model = Classifier(inject_at=(2, 3), inject_value=value)
    plugin = plugin_fn()
    snaps, collect = _Snapshots(), _Collect()
    with caplog.at_level(logging.DEBUG, logger="lightning_amp.amp.engine"):
        with pytest.warns(UserWarning, match=r"2 optimizer steps in a row skipped.*net\.0\.weight"):
            trainer = _fit(model, plugin, steps=6, callbacks=[snaps], logger=collect, log_every_n_steps=1)

    # a late flag defers the scheduler call after step s into step s + 1 (before that step's kernels)
    shown = 0 if flag_timing == "immediate" else 1

    def sched_moves(step):
        return snaps.after[step + shown]["sched"][0] - snaps.before[step + shown]["sched"][0]

    for step in (2, 3):  # skipped: nothing moved
        for key in ("model", "main", "state"):
            assert _same(snaps.before[step][key], snaps.after[step][key]), f"step {step} changed {key}"
        assert sched_moves(step) == 0
    for step in (1, 4):  # clean steps do move params, optimizer state and the LR
        assert not _same(snaps.before[step]["main"], snaps.after[step]["main"])
        assert not _same(snaps.before[step]["state"], snaps.after[step]["state"])
        assert sched_moves(step) == 1
    assert plugin.skipped_steps == 2
    assert plugin.last_nonfinite_params == ["net.0.weight"]
    assert plugin.loss_scale == scale_after
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 6 - 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any("net.0.weight" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)

    logged = {step: row for step, row in collect.rows if "amp/skipped_steps" in row}
    assert sorted(logged) == list(range(6))
    # the logged count is of the flags settled by then: a late device reports each skip one step later
    settled = [0, 0, 1, 2, 2, 2] if flag_timing == "immediate" else [0, 0, 0, 1, 2, 2]
    assert [logged[s]["amp/skipped_steps"] for s in range(6)] == settled
    assert logged[5]["amp/loss_scale"] == scale_after


def test_clean_step_after_a_late_skip_is_not_dropped(flag_timing):
    """O2 bf16, SGD, a per-step LR scheduler, inf at step 2 of 6: only step 2 is skipped, also when its
    flag lands after step 3's backward (the skip once cleared step 3's grads: step 3 silently dropped)."""
    model = Classifier(inject_at=(2,), sgd=True)
    plugin, snaps = AmpO2Precision(dtype="bfloat16"), _Snapshots()
    trainer = _fit(model, plugin, steps=6, callbacks=[snaps])
    moved = [not _same(snaps.before[s]["main"], snaps.after[s]["main"]) for s in range(6)]
    assert moved == [True, True, False, True, True, True]
    assert plugin.skipped_steps == 1 and plugin.last_nonfinite_params == ["net.0.weight"]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 5


def test_late_flag_reports_the_params_of_its_own_step():
    """Names, scale and overflow count of a skip come from its own step even when the flag lands after
    later steps (skips at steps 1 and 2 in different params, flags held back 3 steps)."""
    from lightning_amp.amp.gate import simulate_device_lag

    class TwoFaults(Classifier):
        def on_after_backward(self):
            if self.global_step == 1:
                self.net[0].weight.grad[0, 0] = float("inf")
            if self.global_step == 2:
                self.net[3].bias.grad[0] = float("nan")

    seen = []
    with simulate_device_lag(3):
        plugin = AmpO2Precision(dtype="float16", init_scale=2.0**10)
        engine, original = plugin.amp.engine, plugin.amp.engine._on_skip
        engine._on_skip = lambda state, report: (seen.append((state.scaler.steps, report)), original(state, report))
        _fit(TwoFaults(scheduler=False), plugin, steps=6)
    assert [steps for steps, _ in seen] == [5, 6]  # landed 3 steps late
    seen = [report for _, report in seen]
    assert plugin.skipped_steps == 2
    assert [[engine.param_names[p][0] for p in r.params] for r in seen] == [["net.0.weight"], ["net.3.bias"]]
    assert plugin.last_nonfinite_params == ["net.3.bias"]
    assert [(r.loss_scale, r.overflows_in_a_row) for r in seen] == [(2.0**9, 1), (2.0**8, 2)]


def test_skip_aware_scheduler_keeps_type_state_and_pickles():
    param = nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    plain_state = sched.state_dict()
    precision_module.make_scheduler_skip_aware(sched)
    precision_module.make_scheduler_skip_aware(sched)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and sched.state_dict().keys() == plain_state.keys()
    gate = StepGate(on_skip=lambda *_: None)
    gate.attach(opt)
    gate.record(torch.tensor(1.0))  # a skipped step
    sched.step()
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 1.0
    opt.step()
    gate.record(torch.tensor(0.0))
    sched.step()
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.5
    restored = pickle.loads(pickle.dumps(sched))
    assert type(restored) is type(sched) and restored.last_epoch == 1
    StepGate(on_skip=lambda *_: None).attach(restored.optimizer)
    restored.step()  # a gate that recorded nothing: the step goes ahead
    assert restored.last_epoch == 2
    again = StepGate(on_skip=lambda *_: None)
    again.attach(restored.optimizer)
    again.record(torch.tensor(float("nan")))
    restored.step()
    assert restored.last_epoch == 2  # still skip-aware after a round trip
    assert copy.deepcopy(sched).state_dict() == sched.state_dict()


class _LateGate(StepGate):
    """A gate whose copies land only when waited for (a device that runs behind the host)."""

    def poll(self, wait=False):
        if wait:
            super().poll(wait=True)


def _skip_aware_sgd_with_late_gate():
    """SGD at lr 1.0, a skip-aware StepLR halving it per step, and a :class:`_LateGate` attached."""
    opt = torch.optim.SGD([nn.Parameter(torch.randn(3))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    precision_module.make_scheduler_skip_aware(sched)
    gate = _LateGate(on_skip=lambda *_: None)
    gate.attach(opt)
    return opt, sched, gate


def test_scheduler_step_is_deferred_until_the_flag_lands():
    opt, sched, gate = _skip_aware_sgd_with_late_gate()
    for flag in (0.0, 1.0, 0.0):
        opt.step()
        gate.record(torch.tensor(flag))
        sched.step()
        assert sched.last_epoch == 0  # deferred: nothing known yet
    assert sched.state_dict()["last_epoch"] == 2  # settles first: two clean steps advanced it
    assert opt.param_groups[0]["lr"] == 0.25


def test_settle_deferred_waits_only_for_deferred_scheduler_calls():
    """Before a step the gate waits only when a deferred scheduler call needs the flag (its lr is read
    by the step's kernels); otherwise the host keeps running ahead of the device."""
    opt, sched, gate = _skip_aware_sgd_with_late_gate()
    gate.record(torch.tensor(0.0))
    gate.settle_deferred()
    assert gate.last_step_skipped() is None  # no scheduler call waiting: nothing was waited for
    sched.step()
    gate.settle_deferred()
    assert gate.last_step_skipped() is False and opt.param_groups[0]["lr"] == 0.5


# ---------------------------------------------------------------------------------------
# clipping after unscaling, also with optimizers that unscale in their kernel
# ---------------------------------------------------------------------------------------


def _main_values(trainer):
    return [p.detach().clone() for p in main_params(trainer.optimizers[0])]


class _LiveBias(Classifier):
    """No bias before the BatchNorm: its grad is ~1e-10 (BatchNorm removes it), so Adam divides ~0 by ~eps
    there and two correct implementations (torch's foreach and fused AdamW) differ by 1e-3 on it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.net[0] = nn.Linear(10, 32, bias=False)


@pytest.mark.parametrize("level, dtype", [("O0", "auto"), ("O2", "bfloat16")])
@pytest.mark.parametrize("algorithm, clip", [("norm", 0.05), ("value", 0.002)])
def test_clipping_with_fused_adamw_matches_unscaled_reference(level, dtype, algorithm, clip):
    ref = _fit(_LiveBias(scheduler=False), AmpPrecision(level, dtype=dtype, loss_scale=1.0),
               steps=3, gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    fused = _fit(_LiveBias(fused=True, scheduler=False), AmpPrecision(level, dtype=dtype, loss_scale=1024.0),
                 steps=3, gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    unclipped = _fit(_LiveBias(scheduler=False), AmpPrecision(level, dtype=dtype, loss_scale=1.0), steps=3)
    for a, b, c in zip(_main_values(ref), _main_values(fused), _main_values(unclipped)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    assert any(not torch.allclose(a, c, rtol=1e-3, atol=1e-5) for a, c in zip(_main_values(ref), _main_values(unclipped)))


def test_fused_adamw_unscales_in_kernel_when_not_clipping():
    seen = []

    class Spy(Classifier):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            step = opt.step

            def spy_step(*args, **kwargs):
                seen.append(float(opt.grad_scale) if getattr(opt, "grad_scale", None) is not None else None)
                return step(*args, **kwargs)

            opt.step = spy_step
            return opt

    ref = _fit(Spy(fused=True, scheduler=False), AmpO0Precision(), steps=3)  # scale 1: nothing to unscale
    assert seen == [None, None, None]
    seen.clear()
    fused = _fit(Spy(fused=True, scheduler=False), AmpO0Precision(loss_scale=256.0), steps=3)
    assert seen == [256.0, 256.0, 256.0]
    for a, b in zip(_main_values(ref), _main_values(fused)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


# ---------------------------------------------------------------------------------------
# LBFGS, several optimizers, accumulation
# ---------------------------------------------------------------------------------------


class _Lbfgs(Classifier):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)


def test_global_optimizer_step_hooks_run_for_optimizers_the_plugin_steps():
    """torch's global step hooks run around every step of a plain AdamW the plugin would step with its
    kernels (fused_update=True): the optimizer steps itself while any are registered."""
    calls = []
    pre = register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    post = register_optimizer_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    try:
        _fit(Classifier(scheduler=False), AmpO2Precision(dtype="bfloat16", fused_update=True), steps=3)
    finally:
        pre.remove()
        post.remove()
    assert calls == ["pre", "post"] * 3


def test_lbfgs_with_loss_scale_is_refused_at_setup():
    with pytest.raises(ValueError, match=r"optimizers\[0\] \(LBFGS\)"):
        _fit(_Lbfgs(), AmpO2Precision(dtype="float16"), steps=1)
    with pytest.raises(ValueError, match=r"LBFGS.*loss_scale=1024"):
        _fit(_Lbfgs(), AmpO0Precision(loss_scale=1024.0), steps=1)
    model = _Lbfgs()
    before = model.net[0].weight.detach().clone()
    _fit(model, AmpO0Precision(), steps=2)  # no scaling, no masters: LBFGS works
    assert not torch.equal(before, model.net[0].weight)


class _TwoOptimizers(L.LightningModule):
    """Manual optimization, one optimizer per sub-net; net b gets an inf grad at step ``inject_at``."""

    def __init__(self, inject_at):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.a = nn.Linear(10, 4)
        self.b = nn.Linear(10, 4)
        self.inject_at = inject_at
        self.history = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        before = [p.detach().clone() for p in (self.a.weight, self.b.weight)]
        for opt, net in ((opt_a, self.a), (opt_b, self.b)):
            self.toggle_optimizer(opt)
            loss = nn.functional.cross_entropy(net(x).float(), y)
            hook = None
            if net is self.b and batch_idx == self.inject_at:  # the backward itself produces the inf
                hook = net.weight.register_hook(lambda g: g.index_put((torch.tensor(0), torch.tensor(0)),
                                                                     torch.tensor(float("inf"), dtype=g.dtype)))
            self.manual_backward(loss)
            if hook is not None:
                hook.remove()
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)
        self.history.append([not torch.equal(b, p) for b, p in zip(before, (self.a.weight, self.b.weight))])

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.Adam(self.b.parameters(), lr=1e-2)


def test_manual_optimization_two_optimizers_have_separate_scalers(flag_timing):
    model = _TwoOptimizers(inject_at=1)
    plugin = AmpO2Precision(dtype="float16", init_scale=2.0**10)
    trainer = _fit(model, plugin, steps=6)  # 3 batches x 2 optimizers
    assert model.history == [[True, True], [True, False], [True, True]]
    assert plugin.loss_scales == [2.0**10, 2.0**9]
    assert plugin.skipped_steps == 1
    assert [len(s) for s in (plugin.state_dict()["loss_scalers"],)] == [2]
    assert all(p.dtype == torch.float32 for opt in trainer.optimizers for p in main_params(opt))
    assert list(main_params(trainer.optimizers[0])) == [model.a.weight, model.a.bias]


class _NoZeroGrad(L.LightningModule):
    """Manual optimization that never zeroes grads; the backward of step 1 writes an inf."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.net = nn.Linear(10, 4)
        self.moved = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        before = self.net.weight.detach().clone()
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        if batch_idx == 1:
            loss = loss * float("inf")
        self.manual_backward(loss)
        self.optimizers().step()
        self.moved.append(not torch.equal(before, self.net.weight))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("plugin_fn", [lambda: AmpO2Precision(dtype="bfloat16"), lambda: AmpO0Precision()], ids=["O2", "O0"])
def test_grads_of_a_skipped_step_do_not_leak_into_the_next(plugin_fn, flag_timing):
    """Without zero_grad the next backward adds to the skipped step's grads: those are dropped whether
    the skip reaches the host before that backward (immediate) or after it (late: zeroed on the device)."""
    model, plugin = _NoZeroGrad(), plugin_fn()
    _fit(model, plugin, steps=4)
    assert model.moved == [True, False, True, True]
    assert plugin.skipped_steps == 1


class _Regression(L.LightningModule):
    def __init__(self, accumulate_check=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _regression_data(n=512, batch_size=32):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 10, generator=gen)
    teacher = torch.randn(10, 1, generator=gen)
    y = torch.tanh(x @ teacher) + 0.3 * torch.randn(n, 1, generator=gen)
    return x, y, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def test_o2_gradient_accumulation_happens_in_fp32(flag_timing):
    """accumulate_grad_batches=2: the params' grads at the step are fp32 and the sum of each micro-batch's
    half grad of loss / 2 (Lightning's mean, forward on half copies of the weights, the fp32 targets as
    they come), checked against that sum in fp64.
    A dropped micro-batch (off by ~50%) or a sum instead of a mean (2x) is far outside the tolerance."""
    x, y, _ = _regression_data(n=64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["start"] = copy.deepcopy(pl_module).bfloat16()  # the half copies the micro-batches run on

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if "master_grad" not in seen:
                seen["master_grad"] = [p.grad.clone() for p in main_params(optimizer)]
                seen["module_grad_is_stepped"] = all(
                    a.grad is b.grad for a, b in zip(pl_module.parameters(), main_params(optimizer)))

    acc = _Regression()
    _fit(acc, AmpO2Precision(dtype="bfloat16"), steps=1, data=loader, accumulate_grad_batches=2, callbacks=[Probe()])
    start = seen["start"]
    reference = [torch.zeros(p.shape, dtype=torch.float64) for p in start.parameters()]
    for i in range(2):
        start.zero_grad()
        (start.training_step((x[16 * i:16 * (i + 1)].bfloat16(), y[16 * i:16 * (i + 1)]), i) / 2).backward()
        for r, p in zip(reference, start.parameters()):
            r += p.grad.double()
    assert [g.dtype for g in seen["master_grad"]] == [torch.float32] * 4 and seen["module_grad_is_stepped"]
    for got, want in zip(seen["master_grad"], reference):
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-9 * want.abs().max()), (got.double() - want).abs().max()


# ---------------------------------------------------------------------------------------
# convergence against fp32
# ---------------------------------------------------------------------------------------


def test_o1_and_o2_bf16_converge_within_2_percent_of_fp32():
    """The reference is Lightning's own fp32 training (``32-true``, no plugin): none of our step runs in it."""
    x, y, loader = _regression_data(batch_size=64)

    def final_loss(plugin):
        model = _Regression()
        ours = {} if plugin is not None else dict(plugins=[], precision="32-true")
        trainer = _fit(model, plugin, steps=40, data=loader, max_epochs=-1, **ours)
        fp32 = _Regression()
        with torch.no_grad():
            for p, m in zip(fp32.parameters(), main_params(trainer.optimizers[0])):
                p.copy_(m)
            return nn.functional.mse_loss(fp32(x), y).item()

    reference = final_loss(None)
    untrained = nn.functional.mse_loss(_Regression()(x), y).item()
    assert reference < 0.6 * untrained  # it did learn something
    for plugin in (AmpO1Precision(dtype="bfloat16"), AmpO2Precision(dtype="bfloat16")):
        loss = final_loss(plugin)
        assert abs(loss - reference) / reference < 0.02, (plugin.properties.opt_level, loss, reference)


@pytest.mark.parametrize("level, dtype", [("O1", "float16"), ("O2", "bfloat16")])
def test_combine_grad_keeps_grads_in_one_flat_buffer_with_identical_results(level, dtype, flag_timing):
    seen = []

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            flat = trainer.precision_plugin.amp.engine.states[0].flat
            seen.append(flat.views_intact() and all(p.grad.dtype == torch.float32 for p in main_params(optimizer)))

    plain = _fit(Classifier(inject_at=(2,)), AmpPrecision(level, dtype=dtype), steps=4, accumulate_grad_batches=2,
                 data=_data(n=128))
    plugin = AmpPrecision(level, dtype=dtype, combine_grad=True)
    combined = _fit(Classifier(inject_at=(2,)), plugin, steps=4, accumulate_grad_batches=2, data=_data(n=128),
                    callbacks=[Probe()])
    assert seen == [True] * 4
    assert plugin.skipped_steps == plain.precision_plugin.skipped_steps == 1
    for a, b in zip(_main_values(plain), _main_values(combined)):
        assert torch.equal(a, b)


def test_o1_forward_context_activates_cast_registrations_only_inside():
    import types

    from lightning_amp.amp.casts import unregister_function

    namespace = types.SimpleNamespace(matmul_like=lambda a, b: a @ b)
    lightning_amp.register_float_function(namespace, "matmul_like")
    seen = {}

    class Probe(Classifier):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            seen["registered"] = namespace.matmul_like(x, self.net[0].weight.t()).dtype
            seen["plain"] = (x @ self.net[0].weight.t()).dtype
            return super().training_step(batch, batch_idx)

    try:
        _fit(Probe(), AmpO1Precision(dtype="bfloat16"), steps=1)
        outside = namespace.matmul_like(torch.randn(2, 3).bfloat16(), torch.randn(3, 2).bfloat16()).dtype
    finally:
        unregister_function(namespace, "matmul_like")
    assert seen == {"registered": torch.float32, "plain": BF16}
    assert outside == BF16


def test_o1_fp16_refuses_binary_cross_entropy_in_training_step():
    from lightning_amp.amp.casts import UnsafeHalfOpError

    class Bce(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            probs = torch.sigmoid(self(x))
            return nn.functional.binary_cross_entropy(probs, nn.functional.one_hot(y, 4).to(probs.dtype))

    with pytest.raises(UnsafeHalfOpError, match="BCEWithLogits"):
        _fit(Bce(), AmpO1Precision(dtype="float16"), steps=1)
    _fit(Bce(), AmpO1Precision(dtype="bfloat16"), steps=1)  # bf16 is not refused
    assert nn.functional.binary_cross_entropy(torch.tensor([0.5]).half(), torch.tensor([1.0]).half()).isfinite()


def test_manual_optimization_clip_gradients_sees_unscaled_grads():
    class Manual(Classifier):
        def __init__(self):
            super().__init__(scheduler=False, sgd=True, lr=0.5)
            self.automatic_optimization = False
            self.deltas = []

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt = self.optimizers()
            before = torch.cat([p.detach().reshape(-1).clone() for p in self.parameters()])
            self.manual_backward(nn.functional.cross_entropy(self(x).float(), y))
            self.clip_gradients(opt, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            after = torch.cat([p.detach().reshape(-1) for p in self.parameters()])
            self.deltas.append(torch.linalg.vector_norm(after - before).item())

    model = Manual()
    plugin = AmpO0Precision(loss_scale=1024.0)
    _fit(model, plugin, steps=2)
    assert len(plugin.scalers) == 1  # the LightningOptimizer wrapper maps to the optimizer's own scaler
    # SGD moves by lr * clipped grad: norm lr * 1e-3 (clipping the scaled grads would give 1024x less)
    assert model.deltas == pytest.approx([0.5e-3, 0.5e-3], rel=1e-3)


def test_scaler_keywords_with_a_fixed_scale_raise_or_warn():
    """A static scale ignores the dynamic scaler's keywords: explicit contradiction raises, a default warns."""
    with pytest.raises(ValueError, match=r"`growth_interval`, `init_scale` configure the dynamic loss scale"):
        AmpO2Precision(dtype="float16", loss_scale=128.0, init_scale=2.0**10, growth_interval=10)
    for make, why in ((lambda: AmpO2Precision(dtype="bfloat16", hysteresis=2), "bfloat16 needs no scaling"),
                      (lambda: AmpO3Precision(dtype="float16", min_loss_scale=4.0), "the O3 default")):
        with pytest.warns(UserWarning, match=rf": no effect, the loss scale is a fixed 1.0 \({why}\)"):
            make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AmpO2Precision(dtype="float16", init_scale=2.0**10)  # dynamic: used
        AmpO2Precision(dtype="bfloat16", loss_scale="dynamic", growth_interval=10)
        AmpO2Precision(dtype="bfloat16", loss_scale=1.0)  # nothing given
