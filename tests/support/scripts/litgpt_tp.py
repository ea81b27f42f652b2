"""litgpt's ``GPT`` trained with Fabric: tiny pythia-, llama- (GQA) and gemma-like (MQA) configs, the loop shared by
tests/parallel/test_litgpt_tp.py (one process) and its 2 ranks (``python -m support.scripts.litgpt_tp OUT RUNS_JSON``, started as
torchrun would: LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment, so Fabric launches nothing itself;
one Fabric per run, the process group reused). Each result is saved as ``OUT/<name>.rank<r>.pt``."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import litgpt
import torch
import torch.nn.functional as F

from lightning_amp.fabric import FabricAmpPrecision, TensorParallelStrategy

VOCAB, SEQ, BATCH = 64, 8, 4
CONFIGS = {
    # GptNeoxMLP, parallel residual, biases, partial rotary embedding (rope_n_elem 2 of head_size 8), 4 kv heads
    "pythia": dict(n_embd=32, n_head=4, parallel_residual=True, mlp_class_name="GptNeoxMLP", bias=True,
                   rotary_percentage=0.25, norm_class_name="LayerNorm"),
    # LLaMAMLP, RMSNorm, 2 key/value heads for 4 query heads (split one per rank)
    "llama_gqa": dict(n_embd=32, n_head=4, n_query_groups=2, parallel_residual=False, mlp_class_name="LLaMAMLP",
                      intermediate_size=64, bias=False, norm_class_name="RMSNorm"),
    # GemmaMLP, one key/value head (replicated on both ranks), head_size 16 != n_embd / n_head, qkv bias
    "gemma_mqa": dict(n_embd=32, n_head=4, n_query_groups=1, head_size=16, parallel_residual=False,
                      mlp_class_name="GemmaMLP", intermediate_size=64, bias=False, attn_bias=True,
                      norm_class_name="RMSNorm", scale_embeddings=True, gelu_approximate="tanh"),
}


def config(name: str) -> litgpt.Config:
    return litgpt.Config(name=name, n_layer=2, vocab_size=VOCAB, padding_multiple=VOCAB, block_size=16, **CONFIGS[name])


def make_fabric(precision: str, devices: int, sequence_parallel: bool = False, plan="auto") -> L.Fabric:
    strategy = (TensorParallelStrategy(sequence_parallel=sequence_parallel, sequence_dim=1 if sequence_parallel else None,
                                       plan=plan) if devices > 1 else "auto")
    plugins = [FabricAmpPrecision(opt_level=precision)] if precision.startswith("O") else None
    return L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, plugins=plugins,
                    precision=None if plugins else precision)


def train(name: str, precision: str = "32-true", devices: int = 1, sequence_parallel: bool = False,
          steps: int = 3, plan="auto", one_call_setup: bool = False) -> dict:
    """``plan``: tp_fused's (a hand-written one names the layers). ``one_call_setup``: Fabric's other order,
    ``fabric.setup(model, optimizer)`` with the optimizer over the unconverted params, in two groups (weight decay
    0.1 on matrices, none on vectors) that the conversion must keep apart.
    ``steps`` SGD steps (clipped to norm 0.5, which the grads exceed) of ``GPT(config(name))`` from seed 0;
    per step the loss and the full fp32 weights (gathered under tp_fused), then logits of a KV-cache prefill and
    one decoded token (not under sequence parallelism: one token cannot be split)."""
    fabric = make_fabric(precision, devices, sequence_parallel, plan)
    fabric.launch()
    torch.manual_seed(0)
    model = litgpt.GPT(config(name))
    user_config = model.config
    if one_call_setup:
        groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
        model, optimizer = fabric.setup(model, torch.optim.SGD(groups, lr=0.2, momentum=0.9))
    else:
        model = fabric.setup(model)  # litgpt's own order: the model first, then its optimizer over the converted params
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    data = torch.randint(VOCAB, (steps, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    losses, weights, norms = [], [], []
    for tokens in data:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        fabric.backward(loss)
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.5)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        weights.append({k: v.detach().float().clone() for k, v in fabric.strategy.get_module_state_dict(model.module).items()})
    inner = model.module
    attn = inner.transformer.h[0].attn
    result = dict(losses=losses, weights=weights, norms=norms,
                  local_shapes={k: tuple(v.shape) for k, v in inner.state_dict().items()},
                  attn_heads=(attn.config.n_head, attn.config.n_query_groups),
                  model_heads=(inner.config.n_head, inner.config.n_query_groups),
                  user_config_kept=inner.config is user_config and attn.config is not user_config,
                  probe_tokens=data[0, :, :-1], probe=inner(data[0, :, :-1]).detach().float())
    if not sequence_parallel:
        with torch.no_grad():
            inner.set_kv_cache(batch_size=BATCH)
            prompt = data[0, :, :SEQ - 1]
            prefill = inner(prompt, input_pos=torch.arange(SEQ - 1))
            step = inner(data[0, :, SEQ - 1:SEQ], input_pos=torch.tensor([SEQ - 1]))
            inner.clear_kv_cache()
        result["kv_cache"] = torch.cat([prefill, step], dim=1).float()
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)  # 2 ranks on 2 shared cores
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for run_name, kwargs in runs:
        torch.save(train(**kwargs), out / f"{run_name}.rank{os.environ['LOCAL_RANK']}.pt")
