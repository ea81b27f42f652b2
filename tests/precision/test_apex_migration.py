"""Three public apex scripts ported as docs/migrating-from-apex.md says, at the opt level each uses,
trained against Lightning's ``32-true`` and through a forced overflow (issue 25, item 3).

* apex's ImageNet example (``examples/imagenet/main_amp.py``): argparse strings handed to the plugin
  as they were to ``amp.initialize`` (``--opt-level O2 --keep-batchnorm-fp32 True --loss-scale
  dynamic``), a ResNet with BatchNorm (a tiny ``transformers`` ResNet from its config), SGD with
  momentum and weight decay, the example's per-iteration warm-up.
* apex's DCGAN example (``examples/dcgan/main_amp.py``, O1): two optimizers, three losses
  (``num_losses=3``) as manual optimization, one ``manual_backward`` per ``amp.scale_loss``.
* NVIDIA's BERT pretraining (``run_pretraining.py``, O2 with ``cast_model_outputs=torch.float16``):
  a tiny ``BertForPreTraining`` from its config on synthetic masked-LM data, ``FusedLAMB`` with
  no-decay groups, a poly warm-up schedule, gradient accumulation, the gradient norm read the apex way
  (``clip_grad_norm_(main_params(optimizer), ...)``) in ``on_before_optimizer_step``.

All in float16 on the CPU, as apex ran (in float16 only). The comparison with ``32-true`` is the
relative error of the whole weight update, ``|Δours - Δref| / |Δref|`` (:func:`update_error`),
against a tolerance below the effect of one step more or less (:func:`one_step`, the reference's last
step relative to its whole update, computed in each test); the measured figures are in the constants.
Forced overflows multiply one step's loss by 1e6: its float16 gradients overflow at the scale, as a
too-large scale makes them, and the step must be skipped.
"""
from __future__ import annotations

import argparse
import functools
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp import AmpO1Precision, AmpO2Precision, AmpPrecision, FusedLAMB, main_params
from support.trainer import LossRecorder, quiet_lightning

transformers = pytest.importorskip("transformers")

OVERFLOW = 1e6  # the loss of a forced-overflow step is multiplied by this


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def _trainer(precision, callbacks=(), **kwargs):
    plugin = precision if not isinstance(precision, str) else None
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                     enable_model_summary=False, callbacks=list(callbacks),
                     **({"plugins": [plugin]} if plugin else {"precision": precision}), **kwargs)


def _params(module: nn.Module) -> dict:
    return {k: v.detach().float().clone() for k, v in module.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _flat(params: dict) -> torch.Tensor:
    return torch.cat([v.flatten() for v in params.values()])


def update_error(ours: dict, reference: dict, start: dict) -> float:
    """``|(ours - start) - (reference - start)| / |reference - start|`` over all params together."""
    return float((_flat(ours) - _flat(reference)).norm() / (_flat(reference) - _flat(start)).norm())


def one_step(after: list, start: dict) -> float:
    """The last step of a run relative to its whole update (``after``: params after each batch): about
    what ``update_error`` shows when a run takes one step more or less."""
    return float((_flat(after[-1]) - _flat(after[-2])).norm() / (_flat(after[-1]) - _flat(start)).norm())


class ParamsPerStep(L.Callback):
    """The parameters after every training batch (``prefix``: of that submodule only)."""

    def __init__(self, prefix: str = "") -> None:
        self.after, self.prefix = [], prefix

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        module = pl_module.get_submodule(self.prefix) if self.prefix else pl_module
        self.after.append(_params(module))


# ---- apex's ImageNet example ----------------------------------------------------------------------

IMAGENET_ARGV = ["--opt-level", "O2", "--keep-batchnorm-fp32", "True", "--loss-scale", "dynamic",
                 "--lr", "2.0", "-b", "16"]
IMAGENET_STEPS = 8
IMAGENET_TOL = 0.1  # update_error vs 32-true; measured 0.042 (one step: 0.25)


def imagenet_args(argv):
    """The amp part of the example's argparse: strings, handed to the plugin as they were to apex."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--weight-decay", default=1e-4, type=float)
    parser.add_argument("-b", "--batch-size", default=256, type=int)
    parser.add_argument("--opt-level", type=str)
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
    parser.add_argument("--loss-scale", type=str, default=None)
    return parser.parse_args(argv)


class ImageNetClassifier(L.LightningModule):
    """main_amp.py's train(): the model, CrossEntropyLoss, SGD, ``adjust_learning_rate``'s warm-up."""

    def __init__(self, args, steps_per_epoch, overflow_at=None):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                           layer_type="basic", num_labels=4)
        self.model = transformers.ResNetForImageClassification(config)
        self.args, self.steps_per_epoch, self.overflow_at = args, steps_per_epoch, overflow_at

    def forward(self, images):
        return self.model(pixel_values=images).logits

    def training_step(self, batch, batch_idx):
        images, target = batch
        loss = F.cross_entropy(self(images), target)
        return loss * OVERFLOW if batch_idx == self.overflow_at else loss

    def configure_optimizers(self):
        args = self.args
        lr = args.lr * args.batch_size / 256.0  # the example's linear scaling
        optimizer = torch.optim.SGD(self.parameters(), lr, momentum=args.momentum, weight_decay=args.weight_decay)
        warmup = 5 * self.steps_per_epoch  # adjust_learning_rate: linear warm-up over 5 epochs, per iteration
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (1 + step) / warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _images(n, batch_size):
    """Random images whose class is set by the signs of two channel means (learnable)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 32, 32, generator=gen)
    y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _fit_imagenet(precision, overflow_at=None, callbacks=()):
    args = imagenet_args(IMAGENET_ARGV)
    model = ImageNetClassifier(args, IMAGENET_STEPS, overflow_at)
    losses = LossRecorder()
    trainer = _trainer(precision, callbacks=[losses, *callbacks], max_epochs=1)
    trainer.fit(model, _images(IMAGENET_STEPS * args.batch_size, args.batch_size))
    return model, losses.losses, trainer


@pytest.mark.slow
def test_imagenet_example_at_o2_with_apex_strings_trains_like_32_true():
    args = imagenet_args(IMAGENET_ARGV)
    plugin = AmpPrecision(opt_level=args.opt_level, dtype="float16", keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                          loss_scale=args.loss_scale)
    props = plugin.properties
    assert (props.opt_level, props.keep_batchnorm_fp32, props.loss_scale) == ("O2", True, "dynamic")
    model, losses, _ = _fit_imagenet(plugin)
    steps = ParamsPerStep()
    reference, ref_losses, _ = _fit_imagenet("32-true", callbacks=[steps])
    start = _params(ImageNetClassifier(args, IMAGENET_STEPS))
    assert plugin.skipped_steps == 0 and len(losses) == len(ref_losses) == IMAGENET_STEPS
    error, effect = update_error(_params(model), _params(reference), start), one_step(steps.after, start)
    assert error <= IMAGENET_TOL < effect / 2, (error, effect)
    batchnorms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert batchnorms and all(b.weight.dtype == torch.float32 for b in batchnorms)


def test_imagenet_example_skips_a_forced_overflow_and_backs_off(flag_timing):
    """The overflowing step changes no weight and does not advance the warm-up; the scale halves once;
    the run goes on training."""
    plugin = AmpPrecision("O2", dtype="float16", loss_scale="dynamic")
    steps = ParamsPerStep()
    model, losses, trainer = _fit_imagenet(plugin, overflow_at=3, callbacks=[steps])
    assert plugin.skipped_steps == 1 and plugin.loss_scale == 2.0**15
    assert _max_diff(steps.after[3], steps.after[2]) == 0.0
    assert all(_max_diff(steps.after[i], steps.after[i - 1]) > 0 for i in (1, 2, 4, 5, 6, 7))
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == IMAGENET_STEPS - 1
    assert all(math.isfinite(loss) for i, loss in enumerate(losses) if i != 3)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_imagenet_example_with_sync_batchnorm_keeps_it_fp32(level):
    """``--sync_bn`` (apex.parallel.convert_syncbn_model): Lightning's sync_batchnorm converts to torch's
    SyncBatchNorm before the plugin prepares the model; on one CPU device it computes as BatchNorm."""
    args = imagenet_args(IMAGENET_ARGV)
    model = ImageNetClassifier(args, IMAGENET_STEPS)
    model.model = nn.SyncBatchNorm.convert_sync_batchnorm(model.model)
    plugin = AmpPrecision(level, dtype="float16", keep_batchnorm_fp32="True")
    seen = []

    class Dtypes(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.extend((m.weight.dtype, m.running_mean.dtype) for m in pl_module.modules()
                        if isinstance(m, nn.SyncBatchNorm))

    _trainer(plugin, callbacks=[Dtypes()], max_steps=2).fit(model, _images(32, 16))
    assert seen and set(seen) == {(torch.float32, torch.float32)} and plugin.skipped_steps == 0


# ---- apex's DCGAN example -------------------------------------------------------------------------

NZ = 8
GAN_STEPS = 4
GAN_TOL = 0.12  # update_error of D and of G vs 32-true; measured 0.033 and 0.073 (one step: 0.27, 0.27)
GAN_SKIP_TOL = 1e-3  # update_error vs the run that leaves out D's first step on purpose; measured 0 (bitwise)


class DCGAN(L.LightningModule):
    """The guide's port of the example's loop (``overflow_at``: D's real loss overflows at that step)."""

    def __init__(self, overflow_at=None, skip_d_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.netG = nn.Sequential(nn.ConvTranspose2d(NZ, 16, 4, 1, 0, bias=False), nn.BatchNorm2d(16), nn.ReLU(True),
                                  nn.ConvTranspose2d(16, 8, 4, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(True),
                                  nn.ConvTranspose2d(8, 3, 4, 2, 1, bias=False), nn.Tanh())
        self.netD = nn.Sequential(nn.Conv2d(3, 8, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),
                                  nn.Conv2d(8, 16, 4, 2, 1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.2, True),
                                  nn.Conv2d(16, 1, 4, 1, 0, bias=False), nn.Flatten(0))
        self.criterion = nn.BCEWithLogitsLoss()
        self.overflow_at, self.skip_d_at, self.losses = overflow_at, skip_d_at, []

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_d, opt_g = self.optimizers()
        ones, zeros = torch.ones(real.size(0), device=self.device), torch.zeros(real.size(0), device=self.device)
        noise = torch.randn(real.size(0), NZ, 1, 1, device=self.device,
                            generator=torch.Generator(self.device).manual_seed(batch_idx))
        fake = self.netG(noise)

        self.toggle_optimizer(opt_d)
        opt_d.zero_grad()
        err_d_real = self.criterion(self.netD(real), ones)
        self.manual_backward(err_d_real * OVERFLOW if batch_idx == self.overflow_at else err_d_real)
        err_d_fake = self.criterion(self.netD(fake.detach()), zeros)
        self.manual_backward(err_d_fake)
        if batch_idx != self.skip_d_at:
            opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        opt_g.zero_grad()
        err_g = self.criterion(self.netD(fake), ones)
        self.manual_backward(err_g)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.losses.append((float(err_d_real), float(err_d_fake), float(err_g)))

    def configure_optimizers(self):
        return (torch.optim.Adam(self.netD.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                torch.optim.Adam(self.netG.parameters(), lr=2e-4, betas=(0.5, 0.999)))


def _gan_images():
    gen = torch.Generator().manual_seed(2)
    images = F.avg_pool2d(torch.randn(8 * GAN_STEPS, 3, 18, 18, generator=gen), 3, 1).tanh()  # smooth, in (-1, 1)
    return DataLoader(TensorDataset(images, torch.zeros(len(images))), batch_size=8)


def _fit_gan(precision, **kwargs):
    model, steps = DCGAN(**kwargs), {"D": ParamsPerStep("netD"), "G": ParamsPerStep("netG")}
    start = {"D": _params(model.netD), "G": _params(model.netG)}
    _trainer(precision, callbacks=list(steps.values()), max_epochs=1).fit(model, _gan_images())
    return model, start, steps


def _gan_errors(model, reference, start):
    return {net: update_error(_params(getattr(model, f"net{net}")), _params(getattr(reference, f"net{net}")),
                              start[net]) for net in ("D", "G")}


@functools.lru_cache(maxsize=None)
def _gan_reference():
    return _fit_gan("32-true")


def test_dcgan_example_at_o1_trains_like_32_true(flag_timing):
    plugin = AmpO1Precision(dtype="float16")
    model, start, _ = _fit_gan(plugin)
    reference, _, steps = _gan_reference()
    assert plugin.skipped_steps == 0 and plugin.loss_scales == [2.0**16, 2.0**16]
    errors = _gan_errors(model, reference, start)
    for net in ("D", "G"):
        assert errors[net] <= GAN_TOL < one_step(steps[net].after, start[net]) / 2, (errors, net)


def test_dcgan_example_overflow_in_d_skips_only_ds_step(flag_timing):
    """One scaler per optimizer (apex: one per loss): an overflow in D's real loss at the first step skips
    D's step and halves D's scale; G steps at its own. The run ends where a run that leaves out D's first
    step on purpose ends."""
    plugin = AmpO1Precision(dtype="float16")
    model, start, steps = _fit_gan(plugin, overflow_at=0)
    assert plugin.skipped_steps == 1 and plugin.loss_scales == [2.0**15, 2.0**16]
    assert _max_diff(steps["D"].after[0], start["D"]) == 0.0 < _max_diff(steps["G"].after[0], start["G"])
    skipped_on_purpose, _, _ = _fit_gan(AmpO1Precision(dtype="float16"), skip_d_at=0)
    errors = _gan_errors(model, skipped_on_purpose, start)
    assert max(errors.values()) <= GAN_SKIP_TOL, errors


# ---- NVIDIA's BERT pretraining with FusedLAMB --------------------------------------------------------

BERT_STEPS = 6  # optimizer steps, 2 micro-batches each
BERT_TOL = 0.02  # update_error vs 32-true; measured 0.0017 (one step: 0.10)
BERT_NORM_RTOL = 0.01  # the norm read in on_before_optimizer_step, first step; measured 0.0003
VOCAB, SEQ, MASK_ID = 64, 16, 1


class BertPretraining(L.LightningModule):
    """run_pretraining.py's loop: BertForPreTraining, BertPretrainingCriterion, FusedLAMB with no-decay
    groups, PolyWarmUpScheduler; the norm apex code read with amp.master_params."""

    def __init__(self, lr=1e-2, warmup=0.2, total_steps=BERT_STEPS):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=SEQ, type_vocab_size=2)
        self.bert = transformers.BertForPreTraining(config)
        self.lr, self.warmup, self.total_steps, self.norms = lr, warmup, total_steps, []

    def forward(self, input_ids, token_type_ids, attention_mask):
        out = self.bert(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        return out.prediction_logits, out.seq_relationship_logits

    def training_step(self, batch, batch_idx):
        input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels = batch
        prediction_scores, seq_relationship_score = self(input_ids, segment_ids, input_mask)
        masked_lm_loss = F.cross_entropy(prediction_scores.view(-1, VOCAB), masked_lm_labels.view(-1), ignore_index=-1)
        next_sentence_loss = F.cross_entropy(seq_relationship_score.view(-1, 2), next_sentence_labels.view(-1))
        return masked_lm_loss + next_sentence_loss

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(main_params(optimizer), math.inf)))

    def configure_optimizers(self):
        no_decay = ["bias", "gamma", "beta", "LayerNorm"]
        named = list(self.bert.named_parameters())
        groups = [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
                  {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
        optimizer = FusedLAMB(groups, lr=self.lr)

        def poly_warmup(step):  # PolyWarmUpScheduler(warmup=0.2, degree=0.5)
            progress = step / self.total_steps
            return progress / self.warmup if progress < self.warmup else max((1.0 - progress), 0.0) ** 0.5

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, poly_warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _pretraining_data(n=16 * BERT_STEPS, batch_size=8):
    """Synthetic masked-LM batches with structure: token i+1 follows token i (mod the vocabulary)."""
    gen = torch.Generator().manual_seed(4)
    start = torch.randint(2, VOCAB, (n, 1), generator=gen)
    tokens = 2 + (start - 2 + torch.arange(SEQ)) % (VOCAB - 2)
    masked = torch.rand(n, SEQ, generator=gen) < 0.15
    masked[:, 3] = True  # every sequence masks something
    input_ids = torch.where(masked, torch.full_like(tokens, MASK_ID), tokens)
    labels = torch.where(masked, tokens, torch.full_like(tokens, -1))
    segment_ids = (torch.arange(SEQ) >= SEQ // 2).long().expand(n, SEQ)
    next_sentence = torch.randint(0, 2, (n,), generator=gen)
    return DataLoader(TensorDataset(input_ids, segment_ids, torch.ones(n, SEQ, dtype=torch.long), labels,
                                    next_sentence), batch_size=batch_size)


def _fit_bert(precision):
    model, steps = BertPretraining(), ParamsPerStep()
    _trainer(precision, callbacks=[steps], max_epochs=1, accumulate_grad_batches=2).fit(model, _pretraining_data())
    return model, steps.after[1::2]  # after each optimizer step


def test_bert_pretraining_with_fused_lamb_at_o2_trains_like_32_true():
    """``amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic",
    cast_model_outputs=torch.float16)``: float16 logits, so a float16 loss at the default scale, and
    FusedLAMB, whose gradients the hook reads unscaled."""
    plugin = AmpO2Precision(dtype="float16", loss_scale="dynamic", cast_model_outputs=torch.float16)
    start = _params(BertPretraining())
    model, _ = _fit_bert(plugin)
    reference, ref_after = _fit_bert("32-true")
    assert plugin.skipped_steps == 0 and len(model.norms) == len(reference.norms) == BERT_STEPS
    error, effect = update_error(_params(model), _params(reference), start), one_step(ref_after, start)
    assert error <= BERT_TOL < effect / 2, (error, effect)
    assert abs(model.norms[0] - reference.norms[0]) <= BERT_NORM_RTOL * reference.norms[0]
    assert all(ref / 2 < ours < 2 * ref for ours, ref in zip(model.norms, reference.norms))  # never the scale
