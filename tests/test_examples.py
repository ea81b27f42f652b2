"""The three example LightningModules: they train at every level, learn, and run as scripts."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import bert_sentiment  # noqa: E402
import feedforward_rossmann  # noqa: E402
import unet_segmentation  # noqa: E402
from _common import make_trainer, precision_plugins  # noqa: E402
from support.processes import free_port

MODULES = {"feedforward": feedforward_rossmann, "unet": unet_segmentation, "bert": bert_sentiment}
LEVELS = ("fp32", "O0", "O1", "O2", "O3")


@pytest.fixture(autouse=True)
def _quiet_single_thread():
    """Tiny models gain nothing from a second thread, and on a shared CPU spinning OpenMP threads cost 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(threads)


def _single_thread_env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def _fit(name: str, level: str, steps: int, seed: int = 0, **build_kwargs):
    example = MODULES[name].build_example(size="tiny", seed=seed, **build_kwargs)
    trainer = make_trainer(level, "bfloat16", max_steps=steps, accelerator="cpu")
    losses = []

    initial = {}

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):  # after the cast: the cast alone moves nothing
            initial.update({k: v.detach().float().clone() for k, v in pl_module.named_parameters()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Record())
    trainer.fit(example.module, train_dataloaders=example.train_dataloader)
    return example.module, trainer, losses, initial


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("level", LEVELS)
def test_example_trains_a_few_steps_at_every_level(name, level):
    module, trainer, losses, initial = _fit(name, level, steps=3)
    assert trainer.global_step == 3
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    moved = [k for k, v in module.named_parameters() if not torch.equal(v.detach().float(), initial[k])]
    assert len(moved) > len(initial) // 2, f"only {len(moved)} of {len(initial)} parameters were updated"
    linear_dtypes = {m.weight.dtype for m in module.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    expected = torch.bfloat16 if level == "O3" else torch.float32  # O2: fp32 params, forward on half copies
    assert linear_dtypes == {expected}
    if level == "O2":  # apex O2 keeps BatchNorm in fp32
        assert {m.weight.dtype for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)} <= {torch.float32}
    metric_names = {"feedforward": "train_mape", "unet": "train_iou", "bert": "train_acc"}
    assert torch.isfinite(trainer.callback_metrics[metric_names[name]])


@pytest.mark.parametrize(
    "name, level, steps, window, at_most",
    [
        ("feedforward", "O2", 60, 10, 0.6),
        ("unet", "O2", 40, 10, 0.9),
        # ln 2 = 0.693 is chance; the label rule is learnable
        pytest.param("bert", "O2", 120, 20, 0.6, marks=pytest.mark.slow),
    ],
)
def test_loss_really_falls(name, level, steps, window, at_most):
    _, _, losses, _ = _fit(name, level, steps=steps)
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    assert last < at_most * first, f"{name}: loss {first:.4f} -> {last:.4f}"


def test_unet_has_about_7_7_million_parameters_at_width_32():
    count = sum(p.numel() for p in unet_segmentation.UNet(width=32).parameters())
    assert 7.6e6 < count < 7.9e6, count
    smaller = sum(p.numel() for p in unet_segmentation.UNet(width=8).parameters())
    assert smaller < count / 10


def test_bert_base_has_bert_base_shape():
    config = bert_sentiment.SIZES["base"]
    assert (config.layers, config.hidden, config.heads, config.ffn) == (12, 768, 12, 3072)
    layer = bert_sentiment.EncoderLayer(config)
    names = {n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert names == {"attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj", "mlp.up_proj", "mlp.down_proj"}


def test_attention_runs_on_a_head_shard():
    """A tensor-parallel shard of q/k/v holds whole heads: the layer infers the local head count."""
    torch.manual_seed(0)
    config = bert_sentiment.SIZES["tiny"]
    attention = bert_sentiment.SelfAttention(config.hidden, config.heads, dropout=0.0).eval()
    x = torch.randn(3, 7, config.hidden)
    full = attention(x)
    head_dim = attention.head_dim
    half = config.hidden // 2
    partial_sum = torch.zeros_like(full)
    for shard in range(2):
        rows = slice(shard * half, (shard + 1) * half)
        local = bert_sentiment.SelfAttention(config.hidden, config.heads, dropout=0.0).eval()
        for proj in ("q_proj", "k_proj", "v_proj"):
            src, dst = getattr(attention, proj), torch.nn.Linear(config.hidden, half)
            dst.weight.data, dst.bias.data = src.weight.data[rows].clone(), src.bias.data[rows].clone()
            setattr(local, proj, dst)
        o = torch.nn.Linear(half, config.hidden, bias=False)
        o.weight.data = attention.o_proj.weight.data[:, rows].clone()
        local.o_proj = o
        assert local.head_dim == head_dim
        partial_sum += local(x)
    torch.testing.assert_close(partial_sum + attention.o_proj.bias, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MODULES)
def test_same_seed_gives_same_data_and_weights(name):
    a = MODULES[name].build_example(size="tiny", seed=3)
    b = MODULES[name].build_example(size="tiny", seed=3)
    c = MODULES[name].build_example(size="tiny", seed=4)
    batches_a, batches_b, batches_c = (iter(x.train_dataloader) for x in (a, b, c))
    first_a, second_a = next(batches_a), next(batches_a)
    first_b, first_c = next(batches_b), next(batches_c)
    for x, y in zip(first_a, first_b):
        assert torch.equal(x, y)
    assert not all(torch.equal(x, y) for x, y in zip(first_a, second_a))
    assert not all(torch.equal(x, y) for x, y in zip(first_a, first_c))
    for (_, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q)


def test_synthetic_data_shapes_and_label_rule():
    g = torch.Generator().manual_seed(11)
    tokens, labels = bert_sentiment.draw_tweets(400, 40, 500, g)
    assert tokens.shape == (400, 40) and labels.shape == (400,)
    assert (tokens[:, 0] == bert_sentiment.CLS).all() and (tokens[:, -1] == bert_sentiment.SEP).all()
    half = bert_sentiment.SENTIMENT_WORDS // 2
    first = bert_sentiment.FIRST_WORD
    positive = ((tokens >= first) & (tokens < first + half)).sum(1)
    negative = ((tokens >= first + half) & (tokens < first + 2 * half)).sum(1)
    assert ((positive - negative).abs() >= 2).all()
    agreement = ((positive > negative).long() == labels).float().mean()
    assert 0.9 < agreement < 1.0  # 2% label noise
    images, masks = unet_segmentation.draw_shapes(4, 48, g)
    assert images.shape == (4, 3, 48, 48) and masks.shape == (4, 48, 48)
    assert set(masks.unique().tolist()) == {0, 1, 2}
    categorical, dense, target = feedforward_rossmann.SalesWorld().sample(256, g)
    cards = torch.tensor([card for _, card in feedforward_rossmann.CATEGORICAL])
    assert categorical.shape == (256, len(cards)) and (categorical >= 0).all() and (categorical < cards).all()
    assert dense.shape == (256, len(feedforward_rossmann.DENSE)) and target.shape == (256,)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="opt_level"):
        precision_plugins("O4")
    with pytest.raises(ValueError, match="size"):
        bert_sentiment.build_example(size="huge")
    with pytest.raises(SystemExit) as exit_info:
        bert_sentiment.main(["--opt-level", "O9"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        unet_segmentation.main(["--max-steps", "0"])


@pytest.mark.slow
@pytest.mark.post_suite
def test_script_runs_alone_with_the_documented_command():
    command = [sys.executable, str(EXAMPLES / "bert_sentiment.py"), "--opt-level", "O2", "--dtype", "bfloat16",
               "--max-steps", "4", "--size", "tiny", "--log-every", "2", "--accelerator", "cpu"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd="/", env=_single_thread_env())
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step     4" in result.stdout and "train_loss=" in result.stdout



@pytest.mark.slow
@pytest.mark.post_suite
def test_bert_example_runs_tensor_parallel_on_two_processes():
    env = _single_thread_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    command = [sys.executable, str(EXAMPLES / "bert_sentiment.py"), "--opt-level", "O2", "--dtype", "bfloat16",
               "--max-steps", "3", "--size", "tiny", "--log-every", "1", "--accelerator", "cpu",
               "--strategy", "tp_fused", "--devices", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd="/", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step     3" in result.stdout
    # the strategy's conversion table (rank 0, stderr): every projection of both blocks was sharded in two
    table = set(re.findall(r"net\.encoder\.layers\.(\d)\.(?:attention|mlp)\.(\w+)\s+Linear\s+(\w+)\s+(\w+ \d+ -> \d+)/rank",
                           result.stderr))
    expected = {(str(i), name, kind, sizes) for i in range(2) for name, kind, sizes in (
        ("q_proj", "column", "out 64 -> 32"), ("k_proj", "column", "out 64 -> 32"), ("v_proj", "column", "out 64 -> 32"),
        ("o_proj", "row", "in 64 -> 32"), ("up_proj", "column", "out 256 -> 128"), ("down_proj", "row", "in 256 -> 128"))}
    assert table == expected, result.stderr[-3000:]
