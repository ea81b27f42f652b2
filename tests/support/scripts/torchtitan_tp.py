"""The torchtitan-style Llama (:mod:`support.torchtitan_llama`) trained with Fabric, the loop shared by
tests/parallel/test_torchtitan_tp.py (one process) and its ranks (``python -m support.scripts.torchtitan_tp OUT RUNS_JSON``, started
as torchrun would; one Fabric per run, the process group reused). Each result is saved as ``OUT/<name>.rank<r>.pt``.
A run of the name ``litgpt:<config>`` runs :mod:`support.scripts.litgpt_tp`'s loop instead; ``hf:<family>`` trains the
``transformers`` model of :mod:`support.fused_families` (tokens -> logits) in this loop. ``plan``: None (``"auto"``),
``"lightning"`` (the plan dicts of Lightning's tensor-parallel example, :func:`lightning_example_plan`, given as they
are) or ``"auto_json"`` (the automatic plan read in this process, passed as its JSON text)."""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import lightning as L
import lightning_utilities.core.rank_zero as rank_zero_module
import torch
import torch.nn.functional as F

from lightning_amp.fabric import FabricAmpPrecision, TensorParallelStrategy
from support import fused_families, torchtitan_llama as tt
from support.renamed import rename_instances

VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 3
#: name -> (n_heads, n_kv_heads, Meta's attention, attributes renamed)
CONFIGS = {
    "mha": (4, None, False, False),
    "gqa": (4, 2, False, False),
    "mqa": (4, 1, False, False),
    "renamed_meta_gqa": (4, 2, True, True),
    "gqa8": (8, 4, False, False),
    "gqa8_2": (8, 2, False, False),
    "mqa8": (8, 1, False, False),
    "renamed_meta_gqa8_2": (8, 2, True, True),
}
RENAMES = {
    tt.Attention: {"wq": "alpha", "wk": "beta", "wv": "gamma", "wo": "delta", "n_rep": "per_group", "head_dim": "hd"},
    tt.MetaAttention: {"wq": "alpha", "wk": "beta", "wv": "gamma", "wo": "delta", "n_rep": "per_group",
                       "head_dim": "hd", "n_local_heads": "q_count", "n_local_kv_heads": "kv_count"},
    tt.FeedForward: {"w1": "up_a", "w3": "up_b", "w2": "down"},
    tt.TransformerBlock: {"attention": "mix", "feed_forward": "ffn"},
}


def lightning_example_plan() -> dict:
    """The plan dicts of Lightning's tensor-parallel example (``examples/fabric/tensor_parallel/parallelism.py`` and
    its ``pytorch`` twin: torchtitan's ``parallelize_llama``), written as it writes them: the model-level dict (its
    ``tok_embeddings`` entry left out: a vocabulary-parallel embedding is not a tp_fused style) and the per-block dict,
    unchanged, under the glob of the blocks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    model_plan = {
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "norm": SequenceParallel(),
        "layers.0": PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None),
                                       use_local_output=True),
    }
    block_plan = {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "attention_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
        "ffn_norm": SequenceParallel(),
    }
    return {**model_plan, "layers.*": block_plan}


def _plan(name: str, plan, devices: int):
    if plan == "lightning":
        return lightning_example_plan()
    if plan == "auto_json":
        from lightning_amp.parallel.plan import build_plan

        return build_plan(model(name), "auto", devices).to_json()
    return "auto" if plan is None else plan


class HFLogits(torch.nn.Module):
    """A causal LM of :mod:`support.fused_families` called as this loop calls a model: tokens -> logits."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.lm = fused_families.build(family)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens).logits


def model(name: str) -> torch.nn.Module:
    if name.startswith("hf:"):
        return HFLogits(name[3:])
    heads, kv, meta, renamed = CONFIGS[name]
    torch.manual_seed(0)
    built = tt.Transformer(tt.ModelArgs(dim=32, n_layers=2, n_heads=heads, n_kv_heads=kv, vocab_size=VOCAB,
                                        meta_attention=meta, max_seq_len=SEQ))
    if renamed:
        for cls, names in RENAMES.items():
            rename_instances(built, cls, names)
    return built


class _Reports(logging.Handler):
    """The plan reports Lightning logged in this process (rank_zero_info: rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.texts = []

    def emit(self, record: logging.LogRecord) -> None:
        if "tp_fused plan at" in record.getMessage():
            self.texts.append(record.getMessage())


def train(name: str, devices: int = 1, precision: str = "32-true", plan=None) -> dict:
    """3 SGD steps (momentum) of ``model(name)`` from seed 0: per step the loss and the full fp32 weights (gathered
    under tp_fused); the local shapes, the logits of a probe batch, the plan report (the object's summary and the
    text logged in this process), and the gathered weights loaded back into the TP model and gathered again.
    ``precision``: Fabric's, or "O2" (lightning-amp's, bf16)."""
    if name.startswith("litgpt:"):
        from support.scripts import litgpt_tp

        return litgpt_tp.train(name.split(":", 1)[1], devices=devices)
    reports = _Reports()
    logger = rank_zero_module.log  # the logger Lightning's rank_zero_info writes to (Lightning sets it at import)
    logger.addHandler(reports)
    plugins = [FabricAmpPrecision(opt_level=precision, dtype="bfloat16")] if precision.startswith("O") else None
    strategy = TensorParallelStrategy(plan=_plan(name, plan, devices)) if devices > 1 else "auto"
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy,
                      plugins=plugins, precision=None if plugins else precision)
    fabric.launch()
    module = fabric.setup(model(name))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9))
    inner = module.module
    state = (fabric.strategy.get_module_state_dict if devices > 1 else lambda m: m.state_dict())
    data = torch.randint(VOCAB, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    losses, weights = [], []
    for tokens in data:
        loss = F.cross_entropy(module(tokens[:, :-1]).float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        weights.append({k: v.detach().float().clone() for k, v in state(inner).items()})
    result = dict(losses=losses, weights=weights, probe_tokens=data[0, :, :-1],
                  probe=inner(data[0, :, :-1]).detach().float(), local_shapes={k: tuple(v.shape) for k, v in inner.state_dict().items()},
                  logged=reports.texts)
    logger.removeHandler(reports)
    if devices > 1:
        report = fabric.strategy.plan_report
        result["plan"] = fabric.strategy.plan.to_dict()
        result["report"] = dict(text=report.format(), whole=report.whole, attributes=[u.attributes for u in report.split],
                                units=[(u.family, u.found_by, u.heads, [r.name for r in u.layers]) for u in report.split])
        fabric.strategy.load_module_state_dict(inner, weights[-1])  # the checkpoint round trip
        result["reloaded"] = {k: v.detach().float().clone() for k, v in state(inner).items()}
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)  # several ranks on 2 shared cores
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for run_name, kwargs in runs:
        torch.save(train(**kwargs), out / f"{run_name}.rank{os.environ['LOCAL_RANK']}.pt")
