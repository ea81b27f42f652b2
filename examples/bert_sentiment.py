"""BERT-style encoder classifying the sentiment of synthetic "tweets", as a LightningModule.

The encoder is built from torch.nn primitives with Megatron-friendly names: each attention block
has ``q_proj``/``k_proj``/``v_proj`` (column-parallel) and ``o_proj`` (row-parallel) Linears, each
MLP ``up_proj`` (column) and ``down_proj`` (row), so ``strategy="tp_fused"`` can shard it. The head
count is read from the local projection width, so a sharded layer simply runs fewer heads.

Data: token sequences drawn from a Zipf-like vocabulary with a handful of sentiment words mixed
in: 2-6 words of the majority polarity and at least two fewer of the other. The label is the
majority polarity (1 = positive), with 2% label noise. Weighing evidence spread over the whole
sequence is learnable, so the loss really falls.

    python examples/bert_sentiment.py --opt-level O2 --dtype bfloat16 --max-steps 100 --size tiny
    python examples/bert_sentiment.py --opt-level O2 --strategy tp_fused --devices 2 --size tiny
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Example, batch_loader, main_for  # noqa: E402

CLS, SEP = 1, 2
FIRST_WORD = 10  # ids below are special tokens
SENTIMENT_WORDS = 64  # ids [10, 42) are positive words, [42, 74) negative ones
LABEL_NOISE = 0.02


@dataclass(frozen=True)
class BertConfig:
    """Encoder shape plus the training shape (sequence length, samples per step)."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab_size: int
    seq_len: int
    batch_size: int
    max_positions: int = 512
    dropout: float = 0.1


#: tiny for tests; small = Google's BERT-Small (L4/H512/A8); base = BERT-base (L12/H768/A12).
SIZES = {
    "tiny": BertConfig(layers=2, hidden=64, heads=4, ffn=256, vocab_size=1024, seq_len=32, batch_size=16),
    "small": BertConfig(layers=4, hidden=512, heads=8, ffn=2048, vocab_size=30522, seq_len=128, batch_size=32),
    "base": BertConfig(layers=12, hidden=768, heads=12, ffn=3072, vocab_size=30522, seq_len=128, batch_size=32),
}


def draw_tweets(batch_size: int, seq_len: int, vocab_size: int, g: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids int64 [B, seq_len] starting with [CLS] and ending with [SEP], and labels int64 [B]."""
    first_filler = FIRST_WORD + SENTIMENT_WORDS
    ranks = torch.arange(1, vocab_size - first_filler + 1, dtype=torch.float)
    zipf = 1.0 / ranks  # frequent filler words are frequent
    body = seq_len - 2
    tokens = first_filler + torch.multinomial(zipf, batch_size * body, replacement=True, generator=g).view(batch_size, body)
    n_major = torch.randint(2, 7, (batch_size,), generator=g)
    n_minor = (torch.rand(batch_size, generator=g) * (n_major - 1)).long()  # 0 .. n_major - 2
    positive_majority = torch.rand(batch_size, generator=g) < 0.5
    n_positive = torch.where(positive_majority, n_major, n_minor)
    n_sentiment = n_major + n_minor
    half = SENTIMENT_WORDS // 2
    positions = torch.rand(batch_size, body, generator=g).argsort(dim=1)
    slot = torch.arange(body).expand(batch_size, body)
    positive = FIRST_WORD + torch.randint(0, half, (batch_size, body), generator=g)
    negative = FIRST_WORD + half + torch.randint(0, half, (batch_size, body), generator=g)
    words = torch.where(slot < n_positive[:, None], positive, negative)
    chosen = slot < n_sentiment[:, None]
    tokens.scatter_(1, positions, torch.where(chosen, words, tokens.gather(1, positions)))
    labels = positive_majority.long()
    flip = torch.rand(batch_size, generator=g) < LABEL_NOISE
    labels = torch.where(flip, 1 - labels, labels)
    cls = torch.full((batch_size, 1), CLS, dtype=torch.long)
    sep = torch.full((batch_size, 1), SEP, dtype=torch.long)
    return torch.cat([cls, tokens, sep], dim=1), labels


class SelfAttention(nn.Module):
    """Multi-head self-attention; heads = local q width // head_dim (tensor parallel shards whole heads)."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, t.shape[-1] // self.head_dim, self.head_dim).transpose(1, 2)

        q, k, v = split_heads(self.q_proj(x)), split_heads(self.k_proj(x)), split_heads(self.v_proj(x))
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(context.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """up_proj -> GELU -> down_proj."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, ffn)
        self.down_proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class EncoderLayer(nn.Module):
    """Post-LayerNorm BERT layer: x = LN(x + Drop(Attn(x))); x = LN(x + Drop(MLP(x)))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config.hidden, config.heads, config.dropout)
        self.attention_norm = nn.LayerNorm(config.hidden, eps=1e-12)
        self.mlp = FeedForward(config.hidden, config.ffn)
        self.mlp_norm = nn.LayerNorm(config.hidden, eps=1e-12)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.dropout(self.attention(x)))
        return self.mlp_norm(x + self.dropout(self.mlp(x)))


class BertEncoder(nn.Module):
    """Token + position + segment embeddings, LayerNorm, ``layers`` encoder layers; returns [B, S, hidden]."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embedding = nn.Embedding(config.max_positions, config.hidden)
        self.segment_embedding = nn.Embedding(2, config.hidden)
        self.embedding_norm = nn.LayerNorm(config.hidden, eps=1e-12)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions) + self.segment_embedding.weight[0]
        x = self.dropout(self.embedding_norm(x))
        for layer in self.layers:
            x = layer(x)
        return x


class BertClassifier(nn.Module):
    """Encoder, tanh pooler on the [CLS] token, linear classifier; returns logits [B, num_classes]."""

    def __init__(self, config: BertConfig, num_classes: int = 2) -> None:
        super().__init__()
        self.encoder = BertEncoder(config)
        self.pooler = nn.Linear(config.hidden, config.hidden)
        self.classifier = nn.Linear(config.hidden, num_classes)
        self.dropout = nn.Dropout(config.dropout)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """BERT's initialisation: N(0, 0.02) weights, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pooled = torch.tanh(self.pooler(self.encoder(tokens)[:, 0]))
        return self.classifier(self.dropout(pooled))


class SentimentClassifier(L.LightningModule):
    """Binary sentiment with cross-entropy; logs accuracy (torchmetrics). AdamW with linear warm-up."""

    def __init__(self, size: str = "small", lr: float = 1e-4, warmup_steps: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = BertClassifier(SIZES[size])
        self.train_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self(tokens).float()
        loss = F.cross_entropy(logits, labels)
        self.train_accuracy(logits.detach(), labels)
        self.log("train_loss", loss)
        self.log("train_acc", self.train_accuracy)
        return loss

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                      lr=self.hparams.lr)
        warmup = max(1, self.hparams.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def build_example(size: str = "small", seed: int = 0, batch_size: Optional[int] = None,
                  lr: Optional[float] = None) -> Example:
    """The classifier (weights seeded by ``seed``) and its endless stream of synthetic tweets."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    config = SIZES[size]
    batch_size = batch_size or config.batch_size
    torch.manual_seed(seed)
    module = SentimentClassifier(size=size, lr=lr or (1e-3 if size == "tiny" else 1e-4))
    loader = batch_loader(lambda g: draw_tweets(batch_size, config.seq_len, config.vocab_size, g), seed=seed)
    return Example(module=module, train_dataloader=loader, batch_size=batch_size)


def main(argv=None) -> float:
    return main_for(build_example, __doc__.splitlines()[0], tuple(SIZES), "small", argv)


if __name__ == "__main__":
    main()
