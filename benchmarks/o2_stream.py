"""O2's residual stream against Lightning's precisions on models nobody here wrote (issue 46).

    python benchmarks/o2_stream.py [--models headline,hf-bert,...] [--levels 32-true,bf16-mixed,bf16-true,O1,O2,O3]

One Trainer step per level of each model (tiny, random-init, from config classes: no downloads), observed by
:mod:`lightning_amp.bench.stream`: saved-for-backward bytes by dtype, dtype casts and their bytes, each block's
output dtype, and the first op that promotes a half stream to fp32. The counts do not depend on the machine
(CPU here); ``tests/bench/test_stream_tool.py`` holds O2 to ``bf16-true`` on every model of :data:`MODELS`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Sequence, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, _ROOT)

from lightning_amp.bench.stream import STREAM_LEVELS, format_report, stream_report  # noqa: E402

BATCH, SEQ, HIDDEN, HEADS, FFN, VOCAB = 3, 10, 48, 4, 96, 80  # no activation shares a Parameter's shape
Factory = Callable[[], Tuple[Callable[[], L.LightningModule], List[Any]]]


class CausalOrClassifier(L.LightningModule):
    """A model and how its loss is computed from a batch; AdamW (the plugins step it with their kernels)."""

    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model, self._loss = model, loss

    def training_step(self, batch, batch_idx):
        return self._loss(self.model, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _ids(seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf(model_class: str, config_class: str, loss, batch, **config) -> Factory:
    def factory():
        import transformers

        def make():
            torch.manual_seed(0)
            model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
            return CausalOrClassifier(model, loss)

        return make, [batch]

    return factory


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def headline() -> Tuple[Callable[[], L.LightningModule], List[Any]]:
    """examples/bert_sentiment.py at size tiny, its own data."""
    sys.path.insert(0, os.path.join(_ROOT, "examples"))
    import bert_sentiment

    example = bert_sentiment.build_example("tiny", batch_size=4)
    batch = next(iter(example.train_dataloader))
    return (lambda: bert_sentiment.build_example("tiny", batch_size=4).module), [batch]


def litgpt_gpt() -> Tuple[Callable[[], L.LightningModule], List[Any]]:
    """LitGPT's GPT (RoPE, RMSNorm, SwiGLU: a Llama layout) from a Config."""
    import litgpt

    def make():
        torch.manual_seed(0)
        config = litgpt.Config(block_size=32, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=HEADS,
                               n_embd=HIDDEN, rotary_percentage=1.0, parallel_residual=False, bias=False,
                               norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=FFN)
        model = litgpt.GPT(config)

        def loss(m, ids):
            logits = m(ids)
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

        return CausalOrClassifier(model, loss)

    return make, [_ids()]


class PlainGPT(nn.Module):
    """A GPT written by hand with a learned position table sliced per sequence (``self.pos[:, :T]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(1, 32, HIDDEN) * 0.02)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


def plain_gpt() -> Tuple[Callable[[], L.LightningModule], List[Any]]:
    def make():
        torch.manual_seed(0)
        return CausalOrClassifier(PlainGPT(), lambda m, ids: F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()))

    return make, [_ids()]


def _vit_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def _t5_loss(model, ids):
    return model(input_ids=ids, labels=ids.flip(1)).loss


def _classify(model, batch):
    pixels, labels = batch
    return model(pixel_values=pixels, labels=labels).loss


def _bert_loss(model, batch):
    ids, mask, labels = batch
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _bert_batch():
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, -3:] = 0  # one padded sequence
    return _ids(), mask, torch.tensor([0, 1, 1])


#: name -> factory of (a LightningModule factory, the batches)
MODELS: Dict[str, Factory] = {
    "headline": headline,
    "hf-bert": _hf("BertForSequenceClassification", "BertConfig", _bert_loss, _bert_batch(), vocab_size=VOCAB,
                   hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FFN,
                   max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "hf-gpt2": _hf("GPT2LMHeadModel", "GPT2Config", _lm_loss, _ids(), vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN,
                   n_layer=2, n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "hf-llama": _hf("LlamaForCausalLM", "LlamaConfig", _lm_loss, _ids(), vocab_size=VOCAB, hidden_size=HIDDEN,
                    intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
                    max_position_embeddings=32),
    "hf-t5": _hf("T5ForConditionalGeneration", "T5Config", _t5_loss, _ids(), vocab_size=VOCAB, d_model=HIDDEN,
                 d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=2, num_decoder_layers=2, num_heads=HEADS, dropout_rate=0.0,
                 decoder_start_token_id=0, pad_token_id=0),
    "hf-vit": _hf("ViTForImageClassification", "ViTConfig", _classify, _vit_batch(), image_size=16, patch_size=4,
                  num_channels=3, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                  intermediate_size=FFN, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "litgpt": litgpt_gpt,
    "plain-gpt": plain_gpt,
}


def run(names: Sequence[str], levels: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    out = {}
    for name in names:
        make, batches = MODELS[name]()
        records = stream_report(make, batches, levels)
        print(format_report(f"\n{name}", records), flush=True)
        out[name] = records
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--levels", default=",".join(STREAM_LEVELS))
    args = parser.parse_args(argv)
    names, levels = args.models.split(","), args.levels.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    run(names, levels)


if __name__ == "__main__":
    main()
