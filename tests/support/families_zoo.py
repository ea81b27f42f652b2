"""The zoo of model families the tensor-parallel tests train (tiny, randomly initialised, no downloads):
``transformers`` BERT, RoBERTa, GPT-2, Llama, Mistral, the same renamed (tests/support/renamed.py), the fused
families of :mod:`support.fused_families`, and Lightning's demo ``nn.Transformer``, side by side in one
LightningModule (:class:`Zoo`; the loss is their sum, their params are disjoint, so each family trains exactly as it
would alone), with :func:`fit` (a Trainer run that records each family's per-step loss and checkpoints) and the
differences the tests compare."""
import importlib.util
import json
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_amp  # noqa: F401  (registers "tp_fused")
from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from support import fused_families
from support.processes import free_port

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="the `transformers` families need `transformers`")

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, FFN, BATCH, STEPS, MIDWAY = 64, 16, 32, 2, 4, 64, 4, 6, 3
HF = ("bert", "roberta", "gpt2", "llama", "mistral")
RENAMED = ("bert_renamed", "gpt2_renamed", "llama_renamed")
FAMILIES = HF + RENAMED + ("demo",)


def renames() -> dict:
    """Per renamed family: {class: {attribute: new name}} (every layer and head attribute its forwards read)."""
    from transformers.models.bert import modeling_bert as bert
    from transformers.models.gpt2 import modeling_gpt2 as gpt2
    from transformers.models.llama import modeling_llama as llama

    return {
        "bert_renamed": {bert.BertSelfAttention: {"query": "q_lin", "key": "k_lin", "value": "v_lin",
                                                  "attention_head_size": "hs"},
                         bert.BertSelfOutput: {"dense": "proj"}, bert.BertIntermediate: {"dense": "expand"},
                         bert.BertOutput: {"dense": "shrink"}, bert.BertAttention: {"self": "inner", "output": "post"}},
        "gpt2_renamed": {gpt2.GPT2Attention: {"c_attn": "fused", "c_proj": "out", "split_size": "width", "head_dim": "hd"},
                         gpt2.GPT2MLP: {"c_fc": "up", "c_proj": "down"}},
        "llama_renamed": {llama.LlamaAttention: {"q_proj": "p1", "k_proj": "p2", "v_proj": "p3", "o_proj": "p4",
                                                 "head_dim": "width"},
                          llama.LlamaMLP: {"gate_proj": "g", "up_proj": "u", "down_proj": "d"}},
    }


def hf_models(names=FAMILIES):
    """name -> a tiny ``transformers`` model with random weights and no dropout (its forward takes labels),
    for the ``transformers`` families among ``names`` (none: no import)."""
    if not set(names) - {"demo"}:
        return {}
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                              MistralConfig, MistralForCausalLM, RobertaConfig, RobertaForMaskedLM)

    from support.renamed import rename_instances

    bert = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=FFN, max_position_embeddings=SEQ + 4, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
    llama = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=SEQ)
    builders = {
        "bert": lambda: BertForMaskedLM(BertConfig(**bert)),
        "roberta": lambda: RobertaForMaskedLM(RobertaConfig(**bert, pad_token_id=1)),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                                   n_inner=FFN, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**llama)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**llama, sliding_window=None)),
    }
    models = {}
    for name in names:
        if name in fused_families.FAMILIES:
            models[name] = fused_families.build(name)
        elif name in builders:
            models[name] = builders[name]()
        elif name in RENAMED:
            models[name] = builders[name.removesuffix("_renamed")]()
            for cls, new in renames()[name].items():
                rename_instances(models[name], cls, new)
    return models


class Zoo(pl.LightningModule):
    """Every family side by side; ``losses[family]`` records each one's loss per step."""

    def __init__(self, out_dir: str = "", lr: float = 0.1, names: tuple = FAMILIES):
        super().__init__()
        from lightning.pytorch.demos import Transformer

        torch.manual_seed(0)
        self.out_dir, self.lr = out_dir, lr
        self.families = nn.ModuleDict(hf_models(names))
        if "demo" in names:
            self.families["demo"] = Transformer(vocab_size=VOCAB, ninp=HIDDEN, nhead=HEADS, nhid=FFN, nlayers=LAYERS,
                                                dropout=0.0)
        self.losses = {name: [] for name in self.families}
        self.converted, self.local_shapes = {}, {}

    def on_train_start(self):
        """Per family, how many Linear layers the strategy made column- and row-parallel (this rank), and the shape
        of each parallel layer's weight on this rank (a key/value block kept whole: its own entry)."""
        self.converted = {name: [sum(isinstance(m, kind) for m in family.modules())
                                 for kind in (ColumnParallelLinear, RowParallelLinear)]
                          for name, family in self.families.items()}
        self.local_shapes = {name: {path: list(m.weight.shape) for path, m in family.named_modules()
                                    if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
                             for name, family in self.families.items()}
        for name, family in self.families.items():
            self.local_shapes[name].update({f"{path}.kv_weight": list(m.kv_weight.shape)
                                            for path, m in family.named_modules() if hasattr(m, "kv_weight")})

    def setup(self, stage):
        if self.trainer.world_size > 1:  # 2 ranks on 2 shared cores: do not oversubscribe
            torch.set_num_threads(1)

    def family_losses(self, tokens):
        target = tokens.roll(1, dims=1)
        losses = {}
        for name, model in self.families.items():
            if name == "demo":
                out = model(tokens, target)
                losses[name] = nn.functional.nll_loss(out.reshape(-1, VOCAB).float(), target.reshape(-1))
            else:
                losses[name] = model(input_ids=tokens, labels=target).loss.float()
        return losses

    def training_step(self, batch, batch_idx):
        losses = self.family_losses(batch[0])
        for name, loss in losses.items():
            self.losses[name].append(loss.item())
        return sum(losses.values())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.out_dir and self.trainer.global_step == MIDWAY:
            self.trainer.save_checkpoint(os.path.join(self.out_dir, "midway.ckpt"))  # collective

    def on_train_end(self):
        if self.out_dir:
            self.trainer.save_checkpoint(os.path.join(self.out_dir, "final.ckpt"))
            if self.trainer.is_global_zero:
                with open(os.path.join(self.out_dir, "losses.json"), "w") as f:
                    json.dump(self.losses, f)
                with open(os.path.join(self.out_dir, "converted.json"), "w") as f:
                    json.dump(self.converted, f)
                with open(os.path.join(self.out_dir, "local_shapes.json"), "w") as f:
                    json.dump(self.local_shapes, f)
                with open(os.path.join(self.out_dir, "dtypes.json"), "w") as f:
                    json.dump(self.dtypes(), f)

    def dtypes(self) -> dict:
        """Per family, the dtypes its params (``params``) and their fp32 grad buffers (``main_grad``, under
        ``tp_fused``) hold on this rank."""
        def names(tensors):
            return sorted({str(t.dtype) for t in tensors if t is not None})

        return {name: {"params": names(family.parameters()),
                       "main_grad": names(getattr(p, "main_grad", None) for p in family.parameters())}
                for name, family in self.families.items()}


def data():
    """MIDWAY batches per epoch: the midway checkpoint ends an epoch, so a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randint(3, VOCAB, (MIDWAY * BATCH, SEQ), generator=g)), batch_size=BATCH)


def fit(out_dir, strategy, devices, ckpt_path=None, names=FAMILIES, **trainer_kwargs):
    os.environ["MASTER_PORT"] = str(free_port())
    out_dir.mkdir()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, **trainer_kwargs)
    model = Zoo(str(out_dir), names=names)
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    if dist.is_initialized():  # in-process single-device DDP-family runs leave a group behind
        dist.destroy_process_group()
    with open(out_dir / "losses.json") as f:
        return json.load(f), model


def rel_loss_diff(got, ref):
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def state_diff(got: dict, ref: dict, prefix: str) -> float:
    """Largest |got - ref| of the family's tensors, relative to the largest |ref| among them."""
    keys = [k for k in ref if k.startswith(prefix) and ref[k].is_floating_point()]
    scale = max(ref[k].abs().max().item() for k in keys)
    return max((got[k] - ref[k]).abs().max().item() for k in keys) / scale
