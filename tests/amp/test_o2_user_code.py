"""O2 runs the training code Lightning's own precisions run (issue: "O2 runs every training script").

Each LightningModule here is written the way its kind is written in the wild (WGAN, SwAV, MAML,
DP-SGD, BYOL, CLIP, RoPE, class-weighted losses, ...), trained on the same seed under Lightning's
``bf16-mixed`` (and ``bf16-true`` / ``32-true`` where they compare) and under O2, and the property its
authors rely on is checked under each. Before O2 ran under autocast (O2 swapped module attributes for
half copies), every test here failed on O2 while passing under Lightning's precisions.
"""
import copy
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from lightning_amp import AmpO2Precision
from lightning_amp.amp.o2 import policy as o2_policy
from support.trainer import LossRecorder, quiet_lightning

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield
    assert o2_policy.installs() == 0  # nothing left registered after a run


def _precision(name):
    return {"plugins": [AmpO2Precision(dtype="bfloat16")]} if name == "O2" else {"precision": name}


def _fit(model, precision, batches, steps=4, callbacks=(), validate=False, **trainer_kwargs):
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=list(callbacks),
                        limit_val_batches=1 if validate else 0, num_sanity_val_steps=0, **_precision(precision),
                        **trainer_kwargs)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer.fit(model, loader, loader if validate else None)
    return trainer


def _batches(n, *shape, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g)) for _ in range(n)]


class _Classifier(L.LightningModule):
    def __init__(self, width=16, classes=4):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


# ---------------------------------------------------------------- A. module.weight is the Parameter


class _ManualGradRead(_Classifier):
    """Manual optimization that reads a layer's grad after ``manual_backward`` (grad logging, clipping
    by hand, gradient surgery)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.norms = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))
        grad = self.net[0].weight.grad
        self.norms.append(None if grad is None else float(grad.norm()))
        opt.step()


def test_a_layers_grad_is_readable_after_manual_backward():
    norms = {}
    for precision in ("bf16-mixed", "O2"):
        model = _ManualGradRead()
        _fit(model, precision, _batches(4, 16, 8))
        norms[precision] = model.norms
    assert None not in norms["O2"]
    assert norms["O2"] == pytest.approx(norms["bf16-mixed"], rel=0.05)


class _WGAN(L.LightningModule):
    """The original WGAN: the critic's weights are clipped inside ``training_step`` after its step."""

    clip = 0.01

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.critic = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_c = self.optimizers()
        fake = self.generator(torch.randn(real.shape[0], 4, device=self.device))
        critic_loss = self.critic(fake.detach()).mean() - self.critic(real).mean()
        opt_c.zero_grad()
        self.manual_backward(critic_loss)
        opt_c.step()
        for module in self.critic.modules():
            if isinstance(module, nn.Linear):
                module.weight.data.clamp_(-self.clip, self.clip)
        gen_loss = -self.critic(self.generator(torch.randn(real.shape[0], 4, device=self.device))).mean()
        opt_g.zero_grad()
        self.manual_backward(gen_loss)
        opt_g.step()

    def configure_optimizers(self):
        return (torch.optim.RMSprop(self.generator.parameters(), lr=5e-3),
                torch.optim.RMSprop(self.critic.parameters(), lr=5e-3))


@pytest.mark.parametrize("precision", ["bf16-mixed", "O2"])
def test_weight_clipping_inside_training_step_holds(precision):
    model = _WGAN()
    _fit(model, precision, _batches(4, 16, 8))
    largest = max(float(m.weight.abs().max()) for m in model.critic.modules() if isinstance(m, nn.Linear))
    assert largest <= _WGAN.clip


class _SwAV(L.LightningModule):
    """SwAV keeps its prototypes on the unit sphere: normalized in place at the start of each step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.prototypes = nn.Linear(8, 6, bias=False)
        self.row_norms = []

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            w = self.prototypes.weight.data.clone()
            self.prototypes.weight.copy_(F.normalize(w, dim=1, p=2))
        z = F.normalize(self.encoder(batch[0]), dim=1)
        scores = self.prototypes(z)
        return -(F.softmax(scores.detach() / 0.05, dim=1) * F.log_softmax(scores / 0.1, dim=1)).sum(1).mean()

    def on_before_optimizer_step(self, optimizer):
        self.row_norms.append(self.prototypes.weight.detach().norm(dim=1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("precision", ["bf16-mixed", "O2"])
def test_prototypes_normalized_in_place_inside_training_step_stay_normalized(precision):
    model = _SwAV()
    _fit(model, precision, _batches(4, 16, 8))
    assert len(model.row_norms) == 4
    for norms in model.row_norms:  # the Parameter the optimizer steps, after the step's normalization
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-6), norms


class _MAML(_Classifier):
    """MAML's inner loop: fast weights from one differentiable SGD step, the outer loss through
    ``torch.func.functional_call`` with them; plus the same call with all-zero params (a sanity check
    users write)."""

    def __init__(self):
        super().__init__()
        self.zero_outputs = []
        self.meta_grads = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        params = dict(self.net.named_parameters())
        zeros = {name: torch.zeros_like(p) for name, p in params.items()}
        self.zero_outputs.append(float(torch.func.functional_call(self.net, zeros, (x,)).abs().max()))
        inner = F.cross_entropy(torch.func.functional_call(self.net, params, (x[:8],)), y[:8])
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
        return F.cross_entropy(torch.func.functional_call(self.net, fast, (x[8:],)), y[8:])

    def on_before_optimizer_step(self, optimizer):
        self.meta_grads.append(self.net[0].weight.grad.detach().clone())


def test_functional_call_uses_the_params_it_is_given():
    runs = {}
    for precision in ("bf16-mixed", "O2"):
        model = _MAML()
        _fit(model, precision, _batches(3, 16, 8), steps=3)
        runs[precision] = model
    assert runs["O2"].zero_outputs == [0.0] * 3 == runs["bf16-mixed"].zero_outputs
    first_o2, first_mixed = runs["O2"].meta_grads[0], runs["bf16-mixed"].meta_grads[0]
    assert (first_o2 - first_mixed).norm() < 0.05 * first_mixed.norm()  # the same meta-gradient


class _DPSGD(_Classifier):
    """DP-SGD's per-sample gradients: ``vmap(grad(loss))`` over the batch with ``functional_call``."""

    def __init__(self):
        super().__init__()
        self.per_sample = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        params = {name: p.detach() for name, p in self.net.named_parameters()}

        def sample_loss(p, xi, yi):
            return F.cross_entropy(torch.func.functional_call(self.net, p, (xi[None],)), yi[None])

        grads = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
        self.per_sample.append(grads["0.weight"].detach().clone())
        return F.cross_entropy(self(x), y)


def test_per_sample_gradients_through_vmap_and_functional_call():
    """(Lightning's ``bf16-mixed`` raises here on the CPU: the backward of its fp32-weight LayerNorm under
    ``vmap(grad)`` meets a bf16 grad. O2's LayerNorm computes on a half copy of its weight.)"""
    runs = {}
    for precision in ("32-true", "O2"):
        model = _DPSGD()
        _fit(model, precision, _batches(2, 6, 8), steps=1)
        runs[precision] = model.per_sample[0]
    torch.manual_seed(0)
    reference = _Classifier().net  # the same initial weights, per-sample grads one sample at a time in fp32
    x, y = _batches(2, 6, 8)[0]
    expected = torch.stack([torch.autograd.grad(F.cross_entropy(reference(x[i:i + 1]), y[i:i + 1]),
                                                reference[0].weight)[0] for i in range(6)])
    for precision, grads in runs.items():
        assert grads.shape == expected.shape and grads.abs().sum() > 0, precision
        assert (grads - expected).norm() < 0.05 * expected.norm(), precision


class _BYOL(_Classifier):
    """BYOL/MoCo: a target network deep-copied from the online one inside ``training_step`` and moved by
    an EMA of the online weights; validation deep-copies the online network again to probe it."""

    def __init__(self):
        super().__init__()
        self.target = None
        self.probe_weights = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.target is None:
            self.target = copy.deepcopy(self.net).requires_grad_(False)
        online = self(x)
        with torch.no_grad():
            target = self.target(x)
        return F.cross_entropy(online, y) + F.mse_loss(online.float(), target.float())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for t, o in zip(self.target.parameters(), self.net.parameters()):
                t.mul_(0.9).add_(o, alpha=0.1)

    def validation_step(self, batch, batch_idx):
        probe = copy.deepcopy(self.net)
        self.probe_weights.append((type(probe[0].weight), probe[0].weight.dtype,
                                   torch.equal(probe[0].weight, self.net[0].weight)))
        return F.cross_entropy(probe(batch[0]), batch[1])


@pytest.mark.parametrize("precision", ["bf16-mixed", "O2"])
def test_deepcopy_of_a_submodule_inside_training_and_validation_steps(precision):
    model = _BYOL()
    _fit(model, precision, _batches(4, 16, 8), validate=True, val_check_interval=2)
    assert model.probe_weights and all(w == (nn.Parameter, torch.float32, True) for w in model.probe_weights)
    assert all(t.dtype == torch.float32 for t in model.target.parameters())
    assert not torch.equal(model.target[0].weight, model.net[0].weight)  # the EMA moved it, and lags


class _Lazy(_Classifier):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(4))


@pytest.mark.parametrize("precision", ["bf16-mixed", "O2"])
def test_lazy_layers_materialized_by_the_first_training_forward(precision):
    model = _Lazy()
    _fit(model, precision, _batches(3, 16, 8), steps=3)
    first = model.net[0].weight
    assert type(first) is nn.Parameter and first.shape == (16, 8) and first.dtype == torch.float32
    assert first.grad is not None and torch.isfinite(first).all()


# ----------------------------------------------------------------- B. dtypes reconciled everywhere


class _ClassWeighted(_Classifier):
    """Imbalanced classes: an fp32 class-weight buffer given to the functional loss and a loss module."""

    def __init__(self):
        super().__init__()
        self.register_buffer("class_weights", torch.tensor([0.2, 1.0, 3.0, 5.0]))
        self.criterion = nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0, 5.0]), label_smoothing=0.1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)  # a submodule's output: half under mixed precision
        return F.cross_entropy(logits, y, weight=self.class_weights) + self.criterion(logits, y)


def test_class_weighted_losses():
    losses = {}
    for precision in ("32-true", "bf16-mixed", "O2"):
        recorder = LossRecorder()
        _fit(_ClassWeighted(), precision, _batches(1, 16, 8) * 4, callbacks=[recorder])
        losses[precision] = recorder.losses
    assert losses["O2"] == pytest.approx(losses["32-true"], abs=0.03)
    assert losses["O2"] == pytest.approx(losses["bf16-mixed"], abs=0.03)
    assert losses["32-true"][0] - losses["32-true"][-1] > 0.1  # the tolerance is below what training moves


class _LinearFunction(torch.autograd.Function):
    """A hand-written linear layer: saves the module's fp32 weight, backward ``g @ w`` (no custom_bwd)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x, grad.sum(0)


class _DecoratedLinearFunction(torch.autograd.Function):
    """The same Function with torch's remedy: ``torch.amp.custom_fwd``/``custom_bwd``."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, weight, bias):
        return _LinearFunction.forward(ctx, x, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        return _LinearFunction.backward(ctx, grad)


class _CustomFunctionNet(_Classifier):
    """The first layer through a custom autograd Function on the module's own Parameters."""

    def __init__(self, function=_LinearFunction):
        super().__init__()
        self.function, self.out_dtypes = function, []
        self.weight, self.bias = nn.Parameter(torch.randn(8, 8) / 3), nn.Parameter(torch.randn(8) / 3)

    def forward(self, x):
        hidden = self.function.apply(x, self.weight, self.bias)
        self.out_dtypes.append(hidden.dtype)
        return self.net(hidden)


def test_a_custom_autograd_function_on_the_modules_parameters():
    """Under O2 the Function's ``+ bias`` is half (O2's elementwise-Parameter rule) where bf16-mixed promotes
    it to fp32, so its backward gets a half ``g`` against the saved fp32 weight; its backward runs under the
    forward's autocast, as ``torch.amp.custom_bwd`` makes it (the decorated Function trains the same losses,
    bit for bit), and O2 trains as bf16-mixed and bf16-true do."""
    torchs_apply, losses, out_dtypes = vars(torch.autograd.Function)["apply"], {}, {}
    for precision in ("32-true", "bf16-mixed", "bf16-true", "O2"):
        recorder, model = LossRecorder(), _CustomFunctionNet()
        _fit(model, precision, _batches(4, 16, 8), callbacks=[recorder])
        losses[precision], out_dtypes[precision] = recorder.losses, set(model.out_dtypes)
        assert all(p.grad is None or p.grad.dtype == p.dtype for p in model.parameters())
    assert out_dtypes == {"32-true": {torch.float32}, "bf16-mixed": {torch.float32}, "bf16-true": {BF16}, "O2": {BF16}}
    recorder = LossRecorder()
    _fit(_CustomFunctionNet(_DecoratedLinearFunction), "O2", _batches(4, 16, 8), callbacks=[recorder])
    assert recorder.losses == losses["O2"]
    assert vars(torch.autograd.Function)["apply"] is torchs_apply  # put back after each O2 forward
    assert losses["O2"] == pytest.approx(losses["bf16-mixed"], abs=0.03)
    assert losses["O2"] == pytest.approx(losses["32-true"], abs=0.03)
    assert losses["32-true"][0] - losses["32-true"][-1] > 0.1  # the tolerance is below what training moves


class _CausalMixer(nn.Module):
    """Builds its mask from its own params' dtype, as many attention blocks do."""

    def __init__(self, width):
        super().__init__()
        self.value = nn.Linear(width, width)

    def forward(self, x):
        t = x.shape[1]
        dtype = next(self.parameters()).dtype
        weights = torch.ones(t, t, dtype=dtype, device=x.device).tril()
        weights = weights / weights.sum(-1, keepdim=True)
        return weights @ self.value(x)


class _Sequence(_Classifier):
    def __init__(self):
        super().__init__()
        self.mixer = _CausalMixer(8)

    def forward(self, x):
        return self.net(self.mixer(x).mean(1))


def test_masks_built_from_the_params_dtype_meet_half_activations():
    losses = {}
    for precision in ("bf16-mixed", "O2"):
        recorder = LossRecorder()
        _fit(_Sequence(), precision, _batches(3, 8, 5, 8), steps=3, callbacks=[recorder])
        losses[precision] = recorder.losses
    assert losses["O2"] == pytest.approx(losses["bf16-mixed"], abs=0.02)


class _CLIP(L.LightningModule):
    """CLIP's contrastive loss: image features from ``self(x)``, text features from a direct submodule
    call, their similarity matrix, a learned temperature."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.text = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, x):
        return F.normalize(self.image(x), dim=-1)

    def training_step(self, batch, batch_idx):
        x, tokens = batch
        text = F.normalize(self.text(tokens).mean(1), dim=-1)
        logits = self.logit_scale.exp() * self(x) @ text.T
        labels = torch.arange(x.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_model_output_times_a_direct_submodule_output():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 20, (8, 5), generator=g)) for _ in range(3)]
    losses = {}
    for precision in ("bf16-mixed", "O2"):
        recorder = LossRecorder()
        _fit(_CLIP(), precision, batches, steps=3, callbacks=[recorder])
        losses[precision] = recorder.losses
    assert losses["O2"] == pytest.approx(losses["bf16-mixed"], abs=0.02)


class _TrainAccuracy(L.Callback):
    """A logging callback that runs the model on the training batch after each step."""

    def __init__(self):
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=4)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            self.accuracy.update(pl_module(x).argmax(-1), y)


@pytest.mark.parametrize("precision", ["bf16-mixed", "O2"])
def test_a_forward_on_the_batch_in_a_callback_after_the_step(precision):
    callback = _TrainAccuracy()
    _fit(_Classifier(), precision, _batches(4, 16, 8), callbacks=[callback])
    assert 0.0 <= float(callback.accuracy.compute()) <= 1.0 and callback.accuracy.update_count == 4


def _rope_inv_freq(dim=8, base=10000.0):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class _Rotary(_Classifier):
    """RoPE's frequency table (a non-persistent fp32 buffer, as in Hugging Face models) and a
    checkpointed fp32 constant."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", _rope_inv_freq(), persistent=False)
        self.register_buffer("third", torch.tensor(1 / 3))
        self.angles = []

    def forward(self, x):
        positions = torch.arange(512, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)
        self.angles.append(angles[-1].detach())
        rotated = x * torch.cos(angles[: x.shape[0], :1]).to(x.dtype) * self.third * 3
        return self.net(rotated)


def test_fp32_buffers_keep_their_values_and_the_model_equals_its_checkpoint(tmp_path):
    model = _Rotary()
    trainer = _fit(model, "O2", _batches(3, 16, 8), steps=3)
    exact = torch.outer(torch.arange(512, dtype=torch.float32), _rope_inv_freq())[-1]
    assert torch.equal(model.inv_freq, _rope_inv_freq()) and all(torch.equal(a, exact) for a in model.angles)
    assert model.third.item() == torch.tensor(1 / 3).item()
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    plain = _Rotary()
    plain.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(model(x), plain(x))  # the model handed back after fit is its checkpoint, bit for bit


# --------------------------------------------------------------------- C. the code around the model


class _Consistency(_Classifier):
    """Two forwards per step (consistency regularization on a noised copy of the batch)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        clean, noisy = self(x), self(x + 0.1 * torch.randn_like(x))
        return F.cross_entropy(clean, y) + F.mse_loss(clean.float().softmax(-1), noisy.float().softmax(-1))


def test_two_forwards_per_step():
    losses = {}
    for precision in ("bf16-mixed", "O2"):
        recorder = LossRecorder()
        torch.manual_seed(1)
        _fit(_Consistency(), precision, _batches(4, 16, 8), callbacks=[recorder])
        losses[precision] = recorder.losses
    assert losses["O2"] == pytest.approx(losses["bf16-mixed"], abs=0.02)


class _Compiled(_Classifier):
    def __init__(self):
        super().__init__()
        self.net = torch.compile(self.net, backend="aot_eager")  # the autograd graph through dispatch, no codegen


def test_a_compiled_submodule_trains_as_the_eager_one():
    losses = {}
    for name, model in (("eager", _Classifier()), ("compiled", _Compiled())):
        recorder = LossRecorder()
        _fit(model, "O2", _batches(4, 16, 8), callbacks=[recorder])
        losses[name] = recorder.losses
    torch._dynamo.reset()
    assert losses["compiled"] == pytest.approx(losses["eager"], abs=1e-3)


def _gpt2(lora=False):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                          fan_in_fan_out=True))
    return model


class _CausalLM(L.LightningModule):
    def __init__(self, lora=False, checkpointing=False):
        super().__init__()
        self.model = _gpt2(lora)
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def training_step(self, batch, batch_idx):
        ids, _ = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _tokens(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 64, (4, 12), generator=g), torch.zeros(4)) for _ in range(n)]


def test_hugging_face_gradient_checkpointing_trains_as_without_it():
    losses, weights = {}, {}
    for checkpointing in (False, True):
        recorder = LossRecorder()
        module = _CausalLM(checkpointing=checkpointing)
        _fit(module, "O2", _tokens(), steps=3, callbacks=[recorder])
        losses[checkpointing], weights[checkpointing] = recorder.losses, module.model.transformer.h[0].mlp.c_fc.weight
    assert losses[True] == losses[False] and torch.equal(weights[True], weights[False])


def test_peft_lora_trains_only_the_adapters():
    losses = {}
    for precision in ("bf16-mixed", "O2"):
        recorder = LossRecorder()
        module = _CausalLM(lora=True)
        base = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
        _fit(module, precision, _tokens(), steps=3, callbacks=[recorder])
        frozen = {n: p for n, p in module.named_parameters() if not p.requires_grad}
        assert frozen.keys() == base.keys() and all(torch.equal(frozen[n], base[n]) for n in base)
        assert all(p.dtype == torch.float32 for p in module.parameters())
        assert all(float(p.abs().sum()) > 0 for n, p in module.named_parameters() if "lora_B" in n)  # zero at init
        losses[precision] = recorder.losses
    assert losses["O2"] == pytest.approx(losses["bf16-mixed"], abs=0.05)


class _Encoder(_Classifier):
    """``nn.TransformerEncoder``, whose inference fast path runs in eval (validation)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.fast_path_calls = 0

    def forward(self, x):
        return self.net(self.encoder(x).mean(1))

    def validation_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])


def test_transformer_encoder_fast_path_in_eval(monkeypatch):
    calls = {}
    fast_path = torch._transformer_encoder_layer_fwd
    for precision in ("bf16-true", "bf16-mixed", "O2"):
        count = []
        monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a, **k: count.append(1) or fast_path(*a, **k))
        _fit(_Encoder(), precision, _batches(2, 4, 5, 8), steps=2, validate=True, val_check_interval=1)
        calls[precision] = len(count)
    assert calls["O2"] == calls["bf16-true"] == calls["bf16-mixed"] > 0


# ------------------------------------------------------------------------ D. the process around the run


def test_a_bf16_mixed_forward_on_another_thread_during_an_o2_fit_gets_torchs_autocast():
    """O2's op policy is registered over torch's autocast kernels during the fit and switched on per
    thread: a bf16-mixed forward running on another thread meanwhile computes exactly what it computes
    with nothing registered, and after the fit nothing is left (kernels, patches, default dtype)."""
    import threading

    from lightning_amp.amp.casts import patch_depth

    torch.manual_seed(3)
    other = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(32, 8)
    scale = nn.Parameter(torch.randn(16))

    def mixed_forward():
        with torch.autocast("cpu", dtype=BF16), torch.no_grad():
            hidden = other[0](x) * scale  # an fp32 Parameter promotes, as torch's autocast has it (O2 casts it)
            assert hidden.dtype == torch.float32
            return other[3](other[2](other[1](hidden)))

    reference = mixed_forward()
    results, stop = [], threading.Event()

    def loop():
        while not stop.is_set():
            results.append(mixed_forward())

    class _Overlap(L.Callback):  # the thread runs while the fit's forwards and backwards do
        def on_train_start(self, trainer, pl_module):
            self.thread = threading.Thread(target=loop)
            self.thread.start()

        def on_train_end(self, trainer, pl_module):
            stop.set()
            self.thread.join()

    _fit(_Classifier(), "O2", _batches(8, 16, 8), steps=8, callbacks=[_Overlap()])
    assert results
    mismatched = [i for i, r in enumerate(results) if r.dtype != reference.dtype or not torch.equal(r, reference)]
    assert mismatched == [], (len(results), mismatched[:10], [results[i].dtype for i in mismatched[:3]])
    assert o2_policy.installs() == 0 and not o2_policy.active() and patch_depth() == 0
    assert torch.get_default_dtype() == torch.float32
    assert torch.equal(mixed_forward(), reference)


def test_model_pruning_composes_with_fp32_parameters():
    """Lightning's ``ModelPruning`` (L1, after every epoch): ``weight_orig`` is the fp32 Parameter the
    optimizer steps, the pruned ``weight`` is fp32 and exactly ``weight_orig * weight_mask``, and the
    masks agree with ``bf16-mixed``'s but for entries whose magnitudes the two runs round apart."""
    from lightning.pytorch.callbacks import ModelPruning

    masks = {}
    for precision in ("bf16-mixed", "O2"):
        model = _Classifier(width=64)
        pruning = ModelPruning("l1_unstructured", amount=0.3, parameters_to_prune=[(model.net[0], "weight")],
                               use_global_unstructured=False, make_pruning_permanent=False, verbose=0)
        _fit(model, precision, _batches(2, 16, 8), steps=6, callbacks=[pruning], max_epochs=3)
        layer = model.net[0]
        assert type(layer.weight_orig) is nn.Parameter and layer.weight_orig.dtype == torch.float32
        with torch.no_grad():
            layer(torch.zeros(1, 8))  # the pruning pre-hook recomputes ``weight`` from the stepped weight_orig
        assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, layer.weight_orig * layer.weight_mask)
        masks[precision] = layer.weight_mask
    for mask in masks.values():
        assert abs(float(mask.mean()) - 0.7 ** 3) < 0.01  # 30% of what is left pruned after each of 3 epochs
    disagree = float((masks["O2"] != masks["bf16-mixed"]).float().mean())
    assert disagree < 0.02, disagree
