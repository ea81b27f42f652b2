"""Sequence parallelism through the automatic plan (tp_fused sequence_parallel=True) on 2 real gloo ranks:
converted models vs the unconverted fp32 model (outputs, input grads, every param's grad; attentions found by
structure, MQA's key/value head kept whole on both ranks, in a sub-module or inline in the block), a Trainer run
vs 1 device step by step, and the errors for models it cannot handle. Also: exact O2 resume at TP=2."""
import json
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_amp  # noqa: F401  (registers "tp_fused")
from lightning_amp.parallel import apply_plan
from lightning_amp.parallel.main_grad import MainGradBuffer
from lightning_amp.parallel.convert import gathered_state_dict
from lightning_amp.trainer.strategy import TensorParallelStrategy
from support.processes import free_port

VOCAB, SEQ, D, HEADS, FF = 20, 6, 16, 4, 24



class Attention(nn.Module):
    """q/k/v/o attention in the style of HF Llama code: reads batch and length from its input."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        self.num_heads = HEADS

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, s, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        ctx = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(ctx.transpose(1, 2).reshape(b, s, -1))


class MQAttention(Attention):
    """One key/value head shared by all query heads (MQA): at TP=2 kept whole on both ranks (found by structure; its
    repeat count, num_heads, is the per-rank query head count on each rank)."""

    def __init__(self):
        super().__init__()
        self.k_proj, self.v_proj = nn.Linear(D, D // HEADS), nn.Linear(D, D // HEADS)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, -1).transpose(1, 2)
        k, v = (p(hidden_states).view(b, s, -1, D // HEADS).transpose(1, 2).repeat_interleave(self.num_heads, dim=1)
                for p in (self.k_proj, self.v_proj))
        ctx = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(ctx.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        return self.down_proj(nn.functional.gelu(self.up_proj(x)))


class LlamaishBlock(nn.Module):
    """Pre-norm block (attention + MLP sub-modules) on [batch, seq, hidden]."""

    def __init__(self, attention=Attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.mlp = attention(), MLP()

    def forward(self, x):
        x = x + self.attn(hidden_states=self.norm1(x))
        return x + self.mlp(self.norm2(x))


class InlineMQABlock(nn.Module):
    """MQA written inline in the block (its projections are the block's own children, so each column layer gathers
    the sequence itself, the key/value projection kept whole on both ranks included); lengths read as -1."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2, self.mlp = nn.LayerNorm(D), nn.LayerNorm(D), MLP()
        self.wq, self.wk, self.wv, self.wo = nn.Linear(D, D), nn.Linear(D, D // HEADS), nn.Linear(D, D // HEADS), nn.Linear(D, D)
        self.heads = HEADS

    def forward(self, x):
        h, b = self.norm1(x), x.shape[0]
        q = self.wq(h).view(b, -1, self.heads, D // HEADS).transpose(1, 2)
        k, v = (p(h).view(b, -1, 1, D // HEADS).transpose(1, 2).expand(-1, self.heads, -1, -1) for p in (self.wk, self.wv))
        ctx = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(ctx.transpose(1, 2).reshape(b, -1, D // HEADS * self.heads))
        return x + self.mlp(self.norm2(x))


class Llamaish(nn.Module):
    def __init__(self, attention=Attention):
        super().__init__()
        blocks = [attention() if attention is InlineMQABlock else LlamaishBlock(attention) for _ in range(2)]
        self.layers = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def _models():
    """name -> (factory, sequence_dim, forward(model, x, generator) with x built inside)."""
    def enc_seq_first():
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=False)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def full_transformer():
        return nn.Transformer(D, HEADS, 2, 2, FF, dropout=0.0, batch_first=True)

    mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
    return {
        "encoder[s,b,h]": (enc_seq_first, None, lambda m, x, t: m(x, mask=mask), (SEQ, 3, D)),
        "transformer[b,s,h]": (full_transformer, None, lambda m, x, t: m(x, t, tgt_mask=mask), (3, SEQ, D)),
        "qkvo-up-down[b,s,h]": (Llamaish, 1, lambda m, x, t: m(x), (3, SEQ, D)),
        "mqa-up-down[b,s,h]": (lambda: Llamaish(MQAttention), 1, lambda m, x, t: m(x), (3, SEQ, D)),
        "mqa-inline[b,s,h]": (lambda: Llamaish(InlineMQABlock), 1, lambda m, x, t: m(x), (3, SEQ, D)),
    }


def _worker(rank, port, result_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dp_group = [dist.new_group([r]) for r in range(2)][rank]  # TP = the world, DP = 1
    results = {}
    for name, (factory, seq_dim, run, shape) in _models().items():
        torch.manual_seed(0)
        ref = factory()
        model = factory()
        model.load_state_dict(ref.state_dict())
        apply_plan(model, None, "auto", sequence_parallel=True, sequence_dim=seq_dim)
        buffer = MainGradBuffer(model.parameters(), dp_group, None)
        g = torch.Generator().manual_seed(7)
        x = torch.randn(shape, generator=g)
        t = torch.randn(shape, generator=g)
        x_ref, x_sp = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y_sp = run(ref, x_ref, t), run(model, x_sp, t)
        w = torch.randn(y_ref.shape, generator=g)
        (y_ref * w).sum().backward()
        (y_sp * w).sum().backward()
        buffer.finish_sync()
        # every param's grad, gathered to the original layout like a checkpoint
        grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            saved = {n: p.detach().clone() for n, p in model.named_parameters()}
            for n, p in model.named_parameters():
                p.copy_(grads[n])
            full_grads = {k: v.clone() for k, v in gathered_state_dict(model).items()}
            for n, p in model.named_parameters():
                p.copy_(saved[n])
        ref_grads = dict(ref.named_parameters())
        # floor 0.1: a key bias has an exactly-zero gradient in exact arithmetic (softmax shift invariance)
        errs = {n: (full_grads[n] - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 0.1) for n, p in ref_grads.items()}
        worst = max(errs, key=errs.get)
        grad_err = errs[worst]
        norm_params = [n for n, p in model.named_parameters() if "norm" in n and ".layers." in f".{n}"]
        results[name] = dict(
            out=(y_sp - y_ref).abs().max().item() / y_ref.abs().max().item(),
            grad_in=(x_sp.grad - x_ref.grad).abs().max().item() / x_ref.grad.abs().max().item(),
            grad_params=grad_err, worst=worst, bad={n: e for n, e in errs.items() if e > 1e-5},
            norms_marked=all(getattr(p, "sequence_parallel", False)
                             for n, p in model.named_parameters() if n in norm_params) and bool(norm_params),
        )
    if rank == 0:
        with open(os.path.join(result_dir, "result.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_sequence_parallel_plan_matches_unconverted_model(tmp_path):
    """Outputs, input grads and every param's gradient (LayerNorms' all-reduced over TP: without it
    they hold only this rank's tokens' share and ``grad_params`` fails) match the fp32 model."""
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    with open(tmp_path / "result.json") as f:
        results = json.load(f)
    assert set(results) == set(_models())
    for name, r in results.items():
        assert r["out"] < 1e-5 and r["grad_in"] < 1e-5, (name, r)
        assert r["grad_params"] < 1e-5, (name, r["bad"])
        assert r["norms_marked"], (name, r)


# ------------------------------------------------------------------ Trainer


class TinyLM(pl.LightningModule):
    def __init__(self, out_dir: str = "", save_to: str = ""):
        super().__init__()
        self.out_dir, self.save_to = out_dir, save_to
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)
        self.losses = []

    def setup(self, stage):
        if self.trainer.world_size > 1:
            torch.set_num_threads(1)

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        logits = self.head(self.encoder(self.embed(tokens), mask=nn.Transformer.generate_square_subsequent_mask(SEQ),
                                        is_causal=True))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02)

    def on_train_end(self):
        if self.save_to:
            self.trainer.save_checkpoint(self.save_to)  # collective
        if self.trainer.is_global_zero:
            with open(os.path.join(self.out_dir, "losses.json"), "w") as f:
                json.dump(self.losses, f)


def _fit(out_dir, strategy, devices, steps=12):
    os.environ["MASTER_PORT"] = str(free_port())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g).repeat(steps // 2, 1)  # 2 batches, seen 6 times each
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, gradient_clip_val=0.5,
    )
    trainer.fit(TinyLM(str(out_dir)), DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=2))
    if dist.is_initialized():
        dist.destroy_process_group()
    with open(os.path.join(out_dir, "losses.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_trainer_sequence_parallel_tp2_matches_single_device(tmp_path):
    single, tp2 = tmp_path / "single", tmp_path / "tp2"
    single.mkdir(), tp2.mkdir()
    ref = _fit(single, TensorParallelStrategy(sequence_parallel=True), 1)
    got = _fit(tp2, TensorParallelStrategy(sequence_parallel=True, start_method="spawn"), 2)
    assert len(ref) == len(got) == 12
    assert ref[-1] < ref[0] - 0.1
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert rel < 1e-5, f"sequence-parallel TP=2 vs 1 device: {got} vs {ref}"


# ------------------------------------------------------------------ errors


def test_sequence_parallel_errors_name_the_problem():
    with pytest.raises(ValueError, match="sequence_dim"):
        TensorParallelStrategy(sequence_parallel=True, sequence_dim=2)
    with pytest.raises(ValueError, match="sequence_dim"):
        TensorParallelStrategy(sequence_parallel=True, sequence_dim=True)
    # custom blocks: the sequence dim cannot be inferred
    with pytest.raises(ValueError, match="sequence_dim=0 .* or 1"):
        apply_plan(Llamaish(), None, "auto", sequence_parallel=True)
    # layers not inside a ModuleList/Sequential block: no place for the boundaries
    mlp = nn.Module()
    mlp.fc1, mlp.act, mlp.fc2 = nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D)
    with pytest.raises(ValueError, match="'fc1' is not inside a block"):
        apply_plan(mlp, None, "auto", sequence_parallel=True, sequence_dim=0)
    # contradicting a torch layer's batch_first
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, FF, batch_first=True), 1, enable_nested_tensor=False)
    with pytest.raises(ValueError, match="sequence_dim=0 contradicts"):
        apply_plan(enc, None, "auto", sequence_parallel=True, sequence_dim=0)
    # a model with nothing to split
    with pytest.raises(ValueError, match="found no layer"):
        apply_plan(nn.Sequential(nn.LayerNorm(D)), None, "auto", sequence_parallel=True)


def test_sequence_parallel_refuses_at_run_time_what_would_lose_the_split():
    """The boundaries' own checks, on one process (the hooks are the same at any TP size): blocks of a run must be
    chained, take the hidden states first, and a projection that relies on its parent's gathered input must be called
    from there; a chained forward (and a second one) passes."""
    torch.manual_seed(0)
    model = Llamaish()
    apply_plan(model, None, "auto", sequence_parallel=True, sequence_dim=1)
    x = torch.randn(2, SEQ, D)
    assert model(x).shape == model(x).shape == (2, SEQ, D)
    model.layers[0](x)
    with pytest.raises(RuntimeError, match="'layers.1' was not called with the output of 'layers.0'"):
        model.layers[1](x)
    with pytest.raises(RuntimeError, match="'layers.0' must take the hidden states as its first positional"):
        model.layers[0](x=x)
    with pytest.raises(RuntimeError, match="'layers.0.attn.q_proj' was called outside 'layers.0.attn'.forward"):
        model.layers[0].attn.q_proj(x)
    model.layers[0].attn(hidden_states=x)  # from its parent's forward: gathered (whole already at TP=1)
    with pytest.raises(RuntimeError, match="'layers.0.attn' must take the hidden states as its first positional "
                                           "argument or as hidden_states="):
        model.layers[0].attn(states=x)


# ------------------------------------------------------------------ O2 resume at TP=2


def _fit_epochs(out_dir, epochs, save_to, ckpt_path=None):
    from lightning_amp.trainer.precision import AmpO2Precision

    os.environ["MASTER_PORT"] = str(free_port())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (6, SEQ), generator=g)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=TensorParallelStrategy(start_method="spawn"), max_epochs=epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, plugins=[AmpO2Precision(dtype="bfloat16")],
    )
    loader = DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=2)
    trainer.fit(TinyLM(str(out_dir), save_to=str(save_to)), loader, ckpt_path=ckpt_path)
    return torch.load(save_to, weights_only=False)["state_dict"]


@pytest.mark.slow
def test_tp2_o2_resume_is_exact(tmp_path):
    """TP=2, O2 bf16: 2 epochs straight == 1 epoch, checkpoint, 1 more epoch (bitwise): the checkpoint holds
    the gathered fp32 values of sharded params (O2 params are fp32) and resume slices them back."""
    straight = _fit_epochs(tmp_path, 2, tmp_path / "straight.ckpt")
    _fit_epochs(tmp_path, 1, tmp_path / "half.ckpt")
    resumed = _fit_epochs(tmp_path, 2, tmp_path / "resumed.ckpt", ckpt_path=str(tmp_path / "half.ckpt"))
    assert straight.keys() == resumed.keys()
    sharded = "encoder.layers.0.linear1.weight"
    assert straight[sharded].dtype == torch.float32
    assert straight[sharded].bfloat16().float().ne(straight[sharded]).any()  # true fp32 values, not bf16 ones
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


def test_sequence_parallelism_is_placed_when_the_plan_is_checked_and_the_conversion_reads_it_from_the_plan():
    """The runs of blocks and each layer's sequence mode are part of the checked plan (printed with it, refused there
    before anything changes); the conversion takes them from the plan and refuses a plan checked without them."""
    from lightning_amp.parallel import TensorParallelConfig
    from lightning_amp.parallel.convert import convert
    from lightning_amp.parallel.plan import build_plan

    model = Llamaish()
    plan = build_plan(model, "auto", 1, sequence_parallel=True, sequence_dim=1)
    assert [(run.container, run.names, run.seq_dim) for run in plan.sequence.runs] == [
        ("layers", [f"layers.{i}" for i in range(len(model.layers))], 1)]
    kwargs = plan.sequence.layer_kwargs  # the MLP is a sub-module of the block: gathered at its input
    assert kwargs["layers.0.mlp.up_proj"] == dict(sequence_parallel=False, sequence_dim=1)
    assert kwargs["layers.0.mlp.down_proj"] == dict(sequence_parallel=True, sequence_dim=1)
    assert "sequence parallel:\n    layers: 2 block(s), sequence dim 1 split between them" in plan.format()
    assert build_plan(model, "auto", 1).sequence is None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="checked without sequence parallelism"):
        convert(model, build_plan(model, "auto", 1), None, TensorParallelConfig(sequence_parallel=True, sequence_dim=1))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing changed
    report = convert(model, plan, None, TensorParallelConfig(sequence_parallel=True, sequence_dim=1))
    assert [row.detail for row in report.sequence] == ["2 block(s), sequence dim 1 split between them"]
