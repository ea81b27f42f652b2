"""Lightning idioms under O1/O2/O3, each against the same run under Lightning's own precision.

Each row of issue 15's table (and manual optimization) runs twice on CPU with bf16 unless said: once with
our plugin, once with Lightning's counterpart (O1 and O2: ``bf16-mixed``, both keep fp32 weights and
compute in half; O3: ``bf16-true``). The checks are behavioural: how far each weight moved (ours within
``TOL`` of the reference's movement, far below the effect each test names), the grads a callback reads,
and the checkpoint's contents. Models are tiny, a few steps each.
"""
import functools

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging
from lightning.pytorch.utilities import grad_norm
from torch import nn

from lightning_amp import AmpPrecision
from support.trainer import quiet_lightning

LEVELS = {"O1": "bf16-mixed", "O2": "bf16-mixed", "O3": "bf16-true"}
TOL = 0.1  # |ours - reference| <= TOL * |reference - start| per tensor; measured below 0.03 (bf16, 8 steps)


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def _data(n=32, batch_size=8):
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


class Net(L.LightningModule):
    """backbone + head; ``opt`` picks the optimizer (``frozen``: the head starts frozen, in the optimizer)."""

    def __init__(self, opt="adamw", frozen=False):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.opt, self.norms = opt, []
        if frozen:
            self.head.requires_grad_(False)

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        if self.opt == "finetune":  # BackboneFinetuning adds the backbone's group itself
            return torch.optim.AdamW(self.head.parameters(), lr=1e-2)
        if self.opt == "head-only":
            return torch.optim.SGD(self.head.parameters(), lr=0.5)
        if self.opt == "head-only-adamw":
            return torch.optim.AdamW(self.head.parameters(), lr=1e-2)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(model, precision, epochs=2, callbacks=(), **kwargs):
    plugin = AmpPrecision(precision, dtype="bfloat16", **kwargs) if precision in LEVELS else None
    trainer = L.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=list(callbacks),
                        **({"plugins": [plugin]} if plugin else {"precision": precision}))
    start = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    trainer.fit(model, _data())
    return trainer, start


def _weights(model):
    return {k: v.detach().float().clone() for k, v in model.state_dict().items() if "running" not in k}


def _assert_moved_like(ours, reference, start, tol=TOL, half_weights=False):
    """``half_weights`` (O3 vs bf16-true): one rounding of the stored bf16 weight more is allowed too."""
    for key, ref in reference.items():
        moved = (ref - start[key]).abs().max()
        slack = tol * moved + 1e-6 + (2.0**-8 * ref.abs() if half_weights else 0)
        assert ((ours[key] - ref).abs() <= slack).all(), (key, float((ours[key] - ref).abs().max()), float(moved))


@functools.lru_cache(maxsize=None)
def _reference(row, precision):
    """The final weights (and what the row records) of Lightning's own run of ``row``."""
    model, callbacks, extra = ROWS[row]()
    trainer, start = _fit(model, precision, callbacks=callbacks)
    return _weights(model), start, extra(model, trainer)


# ------------------------------------------------------------------------------- the rows


class _Unfreeze(L.Callback):
    """Unfreeze the head at the start of epoch 1 (it was frozen, but in the optimizer, from the start)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.head.requires_grad_(True)


class _AddGroup(L.Callback):
    """At epoch 1 the backbone joins the optimizer (``add_param_group``), as finetuning callbacks do."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            optimizer = trainer.optimizers[0]
            optimizer.add_param_group({"params": list(pl_module.backbone.parameters()), "lr": optimizer.defaults["lr"]})


class _Norms(L.Callback):
    """What a user reads in on_before_optimizer_step: ``grad_norm`` and each ``p.grad``."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        norms = grad_norm(pl_module, 2)
        grads = {n: p.grad.detach().float().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        pl_module.norms.append((norms, grads, [p for g in optimizer.param_groups for p in g["params"]]))


class _GAN(L.LightningModule):
    """Every Lightning GAN example: two optimizers, ``toggle_optimizer`` around each backward."""

    automatic_optimization = False

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.leaks = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(x.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx)).to(x.dtype)
        self.toggle_optimizer(opt_g)
        g_loss = -self.discriminator(self.generator(z)).float().mean()
        self.manual_backward(g_loss)
        # G's backward must leave D without grads (D is toggled off): they would leak into D's step
        self.leaks.append(any(p.grad is not None and p.grad.abs().sum() > 0 for p in self.discriminator.parameters()))
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        real = self.discriminator(x).float()
        fake = self.discriminator(self.generator(z).detach()).float()
        d_loss = nn.functional.softplus(-real).mean() + nn.functional.softplus(fake).mean()
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return (torch.optim.SGD(self.generator.parameters(), lr=0.2),
                torch.optim.SGD(self.discriminator.parameters(), lr=0.2))


class _ManualClip(Net):
    """Manual optimization with ``clip_gradients`` and two backwards per step (accumulation)."""

    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        for xs, ys in ((x[:4], y[:4]), (x[4:], y[4:])):
            self.manual_backward(nn.functional.cross_entropy(self(xs).float(), ys) / 2)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


ROWS = {
    "unfreeze": lambda: (Net(frozen=True), [_Unfreeze()], lambda m, t: None),
    "backbone_finetuning": lambda: (Net(opt="finetune"), [BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
                                    lambda m, t: None),
    "add_param_group": lambda: (Net(opt="head-only"), [_AddGroup()], lambda m, t: None),
    "add_param_group_adamw": lambda: (Net(opt="head-only-adamw"), [_AddGroup()], lambda m, t: None),
    "grad_norm": lambda: (Net(), [_Norms()], lambda m, t: m.norms),
    "toggle_optimizer": lambda: (_GAN(), [], lambda m, t: m.leaks),
    "manual_clip": lambda: (_ManualClip(), [], lambda m, t: None),
}


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("row", ["unfreeze", "backbone_finetuning", "add_param_group", "manual_clip"])
def test_weights_move_like_lightnings_own_precision(row, level):
    """Frozen-then-unfrozen params, BackboneFinetuning's new group, a group added mid-training and a
    manual loop with clipping train as under Lightning's precision. Former O2: the unfrozen head moved
    once and then never (its master kept requires_grad=False), BackboneFinetuning raised KeyError, the
    added group stepped half params directly (and clip_gradients missed the manual grads)."""
    model, callbacks, _ = ROWS[row]()
    _fit(model, level, callbacks=callbacks)
    reference, start, _ = _reference(row, LEVELS[level])
    _assert_moved_like(_weights(model), reference, start, half_weights=level == "O3")
    assert all(v.dtype == torch.float32 for v in model.state_dict().values() if v.is_floating_point()) or level == "O3"


@pytest.mark.parametrize("level", list(LEVELS))
def test_toggle_optimizer_keeps_the_generators_grads_out_of_the_discriminator(level):
    model, _, _ = ROWS["toggle_optimizer"]()
    _fit(model, level)
    reference, start, ref_leaks = _reference("toggle_optimizer", LEVELS[level])
    assert not any(model.leaks) and not any(ref_leaks) and len(model.leaks) == 8
    _assert_moved_like(_weights(model), reference, start, half_weights=level == "O3")


@pytest.mark.parametrize("level", list(LEVELS))
def test_grad_norm_and_p_grad_in_on_before_optimizer_step(level):
    """The grads a callback reads before the step are the module's own, the optimizer's params are the
    module's, and their norms match Lightning's run (former O2: every p.grad was None, grad_norm empty)."""
    model, callbacks, _ = ROWS["grad_norm"]()
    _fit(model, level, callbacks=callbacks)
    _, _, ref_norms = _reference("grad_norm", LEVELS[level])
    assert len(model.norms) == len(ref_norms) == 8
    for (norms, grads, stepped), (ref, ref_grads, _) in zip(model.norms, ref_norms):
        assert stepped == list(model.parameters())
        assert grads.keys() == ref_grads.keys() == {n for n, _ in model.named_parameters()}
        assert norms.keys() == ref.keys() and "grad_2.0_norm_total" in norms
        for key, value in ref.items():
            assert abs(float(norms[key]) - float(value)) <= 0.05 * float(value) + 1e-6, (key, norms[key], value)


def test_add_param_group_fp16_dynamic_scale_trains_like_32_true():
    """fp16 O2 (dynamic loss scale), torch AdamW: a group added mid-training gets fp32 params like the rest.
    Former O2: the new group's fp16 params were stepped directly, AdamW's eps=1e-8 is 0 in fp16 and the
    update blew up (moved 123.8 vs 0.23)."""
    model, callbacks, _ = ROWS["add_param_group_adamw"]()
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=callbacks,
                        plugins=[AmpPrecision("O2", dtype="float16", init_scale=2.0**12)])
    start = _weights(model)
    trainer.fit(model, _data())
    reference, ref_start, _ = _reference("add_param_group_adamw", "32-true")
    assert all(torch.equal(start[k], ref_start[k]) for k in start)
    _assert_moved_like(_weights(model), reference, start, tol=0.05)


@pytest.mark.parametrize("level", list(LEVELS))
def test_swa_checkpoint_holds_the_averaged_weights(level, tmp_path):
    """StochasticWeightAveraging writes the average into the module at the end of fit: a checkpoint then
    holds it (former O2: the masters of the last pre-SWA step were written over it, max diff 0.16)."""
    results = {}
    for name, precision in (("ours", level), ("reference", LEVELS[level])):
        model = Net()
        trainer, start = _fit(model, precision, epochs=3, callbacks=[StochasticWeightAveraging(swa_lrs=0.05,
                                                                                              swa_epoch_start=1)])
        path = tmp_path / f"{name}.ckpt"
        trainer.save_checkpoint(path)
        state = torch.load(path, weights_only=False)["state_dict"]
        assert all(torch.equal(state[k].float(), v) for k, v in _weights(model).items())  # what the module holds
        results[name] = ({k: v.float() for k, v in state.items() if "running" not in k and "n_averaged" not in k},
                         start)
    ours, start = results["ours"]
    _assert_moved_like(ours, results["reference"][0], start, half_weights=level == "O3")


@pytest.mark.slow
def test_ddp_spawn_hands_back_the_fp32_params():
    """``ddp_spawn`` (2 processes, gloo, the same batches on both ranks): the launching process gets rank
    0's weights back, fp32 and equal to a 1-process O2 run (identical grads average to themselves).
    Former O2: it got the bf16-rounded module params, not the fp32 masters."""
    def run(**kwargs):
        model = Net()
        trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False,
                            plugins=[AmpPrecision("O2", dtype="bfloat16")], **kwargs)
        trainer.fit(model, _data())
        return _weights(model)

    single = run()
    spawned = run(strategy="ddp_spawn", devices=2, use_distributed_sampler=False)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in spawned.values())  # not bf16 values
    for key, value in single.items():
        assert torch.allclose(spawned[key], value, rtol=1e-6, atol=1e-7), key
