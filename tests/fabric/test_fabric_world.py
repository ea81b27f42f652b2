"""lightning_amp.fabric in the rest of a Fabric user's loop: the loss computed from the model's raw outputs (O1, O3
against Fabric's own bf16-mixed, bf16-true), a GAN's two optimizers under fp16 dynamic scaling, and under
strategy="tp_fused" the fp32 main_grad following optimizer.zero_grad() and each optimizer's own step (real
processes)."""
from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from torch import nn

from lightning_amp.fabric import FabricAmpPrecision
from lightning_amp.parallel.main_grad import MainGradBuffer
from support.processes import run_two_ranks


def _fabric(precision, **amp):
    if precision in ("O1", "O2", "O3"):
        return L.Fabric(accelerator="cpu", devices=1, plugins=[FabricAmpPrecision(opt_level=precision, **amp)])
    return L.Fabric(accelerator="cpu", devices=1, precision=precision)


def _train_demo_transformer(precision, in_autocast=False, **amp):
    """Two SGD steps of Lightning's demo Transformer; ``in_autocast``: the whole loop inside one
    ``with fabric.autocast():``."""
    fabric = _fabric(precision, **amp)
    fabric.seed_everything(0)
    model = Transformer(vocab_size=50, nlayers=1, nhid=32, ninp=32, nhead=2, dropout=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    dtypes = set()
    with fabric.autocast() if in_autocast else contextlib.nullcontext():
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randint(50, (4, 10), generator=g), torch.randint(50, (4, 10), generator=g)
            out = model(x, y)
            dtypes.add(out.dtype)
            fabric.backward(F.nll_loss(out, y.view(-1)))
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().float() for p in model.parameters()], dtypes


def _train_gpt2(precision, **amp):
    """Two SGD steps of a tiny transformers GPT-2, the loss taken from its raw logits as a Fabric loop does."""
    from transformers import GPT2Config, GPT2LMHeadModel

    fabric = _fabric(precision, **amp)
    fabric.seed_everything(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    dtypes = set()
    for step in range(2):
        ids = torch.randint(64, (4, 9), generator=torch.Generator().manual_seed(step))
        logits = model(ids[:, :-1]).logits
        dtypes.add(logits.dtype)
        fabric.backward(F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().float() for p in model.parameters()], dtypes


@pytest.mark.parametrize("level, fabrics", [("O1", "bf16-mixed"), ("O3", "bf16-true")])
def test_outputs_are_fp32_and_train_as_fabrics_own_precision(level, fabrics):
    """Fabric casts outputs to fp32 under its half precisions, so the loop's loss is fp32. O1 and O3 do too: with
    torch's own SGD step, O1 trains bitwise as bf16-mixed, O3 as bf16-true; before, their bf16 logits gave a bf16
    loss (after 2 steps O1 was 1.5e-4 from bf16-mixed, O3 2.4e-4 from bf16-true). Bitwise because both run the same
    kernels; the fused update (the default) rounds ``p - lr * g`` once, where torch's scalar loop rounds twice
    (ATEN_CPU_CAPABILITY=default), and what that does to the losses is test_fabric_o1_equality's."""
    ours, our_dtypes = _train_gpt2(level, dtype="bfloat16", fused_update=False)
    theirs, their_dtypes = _train_gpt2(fabrics)
    assert our_dtypes == their_dtypes == {torch.float32}
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_explicit_cast_model_outputs_is_kept():
    """cast_model_outputs given by the user wins over Fabric's fp32 outputs."""
    _, dtypes = _train_gpt2("O1", dtype="bfloat16", cast_model_outputs=torch.bfloat16)
    assert dtypes == {torch.bfloat16}


def test_o2_loop_inside_fabric_autocast_sees_each_step():
    """A loop run inside one `with fabric.autocast():` block: each forward sees the params the previous step wrote
    (O2 recasts its half copies after the step), so it trains bitwise as the same loop outside the block. Before, the
    copies of the block's first forward stayed (7.8e-3 apart after 2 steps; Fabric's bf16-mixed is 8.8e-3 apart
    through autocast's weight-cast cache)."""
    inside, _ = _train_demo_transformer("O2", in_autocast=True, dtype="bfloat16")
    outside, _ = _train_demo_transformer("O2", dtype="bfloat16")
    for a, b in zip(inside, outside):
        assert torch.equal(a, b)


class _GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, z):
        return self.disc(self.gen(z))


def _train_gan(precision, **amp):
    """Discriminator step, then generator step, each with its own SGD over one model (the generator's optimizer
    first steps after a backward made at the discriminator optimizer's loss scale)."""
    fabric = _fabric(precision, **amp)
    fabric.seed_everything(0)
    model = _GAN()
    opt_g, opt_d = torch.optim.SGD(model.gen.parameters(), lr=1e-2), torch.optim.SGD(model.disc.parameters(), lr=1e-2)
    model, opt_g, opt_d = fabric.setup(model, opt_g, opt_d)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        z, real = torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g)
        d_real, d_fake = model.disc(real), model(z)
        loss_d = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                  + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
        fabric.backward(loss_d)
        opt_d.step()
        opt_d.zero_grad()
        opt_g.zero_grad()
        d_fake = model(z)
        fabric.backward(F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake)))
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
    return [p.detach().float() for p in model.parameters()], fabric.strategy.precision


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gan_second_optimizer_unscales_its_first_step(level):
    """fp16 with dynamic scaling: the generator's optimizer is connected at its first step, after a backward at the
    discriminator's scale (65536); its grads must be unscaled by that. Measured 9.5e-7 from 32-true (bf16-mixed is
    8.6e-5 away); before, its first step was 65536x too large (61 away)."""
    ref, _ = _train_gan("32-true")
    got, precision = _train_gan(level, dtype="float16")
    assert max((a - b).abs().max().item() for a, b in zip(ref, got)) < 1e-5
    assert precision.skipped_steps == 0 and precision.loss_scales == [65536.0, 65536.0]


@pytest.mark.slow
def test_tp_fused_main_grad_follows_zero_grad_and_each_optimizers_step(tmp_path):
    """Fabric(strategy="tp_fused", devices=2) (TP=2, fused wgrad into main_grad), the tiny GPT with two SGD optimizers
    over disjoint params sharing one main_grad buffer, against a plain fp32 loop (support/scripts/fabric_tp_grads.py):
    zero_grad() without a step drops those grads, two backwards before a step sum, one optimizer's step leaves the
    other's grads. Measured 1.2e-7 from the plain loop; before, 4.7e-2 / 5.5e-2 / 5.5e-2."""
    run_two_ranks("fabric_tp_grads", tmp_path)
    for name in ("zero_without_step", "two_backwards", "one_optimizer_steps"):
        for rank in (0, 1):
            result = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            assert result["converted"], "the attention was not split over the 2 ranks"
            err = max((result["tp"][k] - result["plain"][k]).abs().max().item() for k in result["plain"])
            assert err < 1e-5, (name, rank, err)


def test_main_grad_of_a_bf16_param_follows_what_was_done_to_its_grad():
    """16-bit params get a cast copy of main_grad as p.grad: zeroing that copy in place (zero_grad(set_to_none=False))
    zeroes main_grad at the next backward; a copy left alone keeps main_grad's fp32 sum, not its bf16 rounding."""
    torch.manual_seed(0)
    kept, zeroed = nn.Parameter(torch.randn(64).bfloat16()), nn.Parameter(torch.randn(64).bfloat16())
    buffer = MainGradBuffer([kept, zeroed])
    grads = [torch.randn(64) for _ in range(3)]
    for i, g in enumerate(grads):
        buffer.reclaim()
        ((kept.float() * g).sum() + (zeroed.float() * g).sum()).backward()
        buffer.expose_grads()
        if i == 1:
            zeroed.grad.zero_()
    held = [g.bfloat16().float() for g in grads]  # each backward's grad of a bf16 param is bf16
    fp32_sum = held[0] + held[1] + held[2]
    assert torch.equal(kept.main_grad, fp32_sum)
    assert not torch.equal(fp32_sum, (held[0] + held[1]).bfloat16().float() + held[2])  # rounding would show
    assert torch.equal(zeroed.main_grad, held[2])
