"""Megatron's collective count in backward: column-parallel layers that read one input (q, k, v; gate, up) sum their
input gradients and all-reduce once, so a block all-reduces twice in backward (its attention's input, its MLP's
input). Counted on 2 gloo ranks on models nobody here wrote: ``transformers`` Llama (separate q/k/v, gate/up:
**5 per block before**, the regression this guards), GPT-2 (fused ``c_attn``) and a litgpt GQA config (fused ``qkv``,
``fc_1``/``fc_2``: 3 before). The gradients are those each layer's own all-reduce gives (the shared input's
collective turned off on the same ranks): the embeddings' and every weight's, to fp32 rounding."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from lightning_amp.parallel import TensorParallelConfig
from lightning_amp.parallel.convert import convert_model
from support.optional_deps import require
from support.processes import run_on_two_ranks

LAYERS, VOCAB = 2, 64


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "litgpt_gqa":
        litgpt = require("litgpt")
        return litgpt.GPT(litgpt.Config(n_layer=LAYERS, n_embd=32, n_head=4, n_query_groups=2, vocab_size=VOCAB,
                                        padded_vocab_size=VOCAB, block_size=16, mlp_class_name="LLaMAMLP",
                                        intermediate_size=64, norm_class_name="RMSNorm", bias=False))
    from support.families_zoo import hf_models
    return hf_models((name,))[name]


def _loss(name: str, model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = model(tokens) if name == "litgpt_gqa" else model(input_ids=tokens).logits
    return logits.float().square().mean()


def _count_and_compare(rank: int, names: tuple) -> None:
    for name in names:
        model = _model(name)
        convert_model(model, None, TensorParallelConfig())
        calls = []
        real = dist.all_reduce
        with mock.patch.object(dist, "all_reduce", lambda *a, **k: calls.append(1) or real(*a, **k)):
            loss = _loss(name, model)
            calls.clear()  # forward's (one per row layer) are not counted
            loss.backward()
        shared = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        for layer in model.modules():  # each column layer's own all-reduce, as before
            if getattr(layer, "shared_input", None) is not None:
                layer.shared_input = None
        _loss(name, model).backward()
        worst = max(((p.grad - shared[n]).abs().max() / shared[n].abs().max().clamp_min(1e-30)).item()
                    for n, p in model.named_parameters())
        assert worst < 1e-6, f"{name}: gradients differ by {worst:.2e} relative with one input collective per unit"
        assert len(calls) == 2 * LAYERS, f"{name}: {len(calls) / LAYERS} all-reduces per block in backward, not 2"


@pytest.mark.slow
def test_two_all_reduces_per_block_in_backward():
    require("transformers")
    run_on_two_ranks(_count_and_compare, ("llama", "gpt2", "litgpt_gqa"))
