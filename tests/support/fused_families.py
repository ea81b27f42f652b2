"""Tiny random-init ``transformers`` models whose attention has one fused in-projection, built from their config
classes (no downloads; 2 layers, hidden 32, 4 query heads, vocabulary 64, no dropout): Phi-3 (blocked ``[q | k | v]``
``qkv_proj`` with GQA, fused ``gate_up_proj``), GPT-NeoX (``query_key_value`` interleaved per head), Falcon with one
key/value head (``multi_query``) and with its new decoder architecture (interleaved per key/value group), BLOOM
(interleaved per head, ALiBi) and MPT (blocked ``Wqkv``, ALiBi); ``phi3_gqa8``: Phi-3 with hidden 64, 8 query heads
and 4 key/value heads (split at tensor_parallel_size=4, where ``phi3``'s 2 are replicated)."""
from __future__ import annotations

import torch

VOCAB, HIDDEN, LAYERS, HEADS, FFN, SEQ = 64, 32, 2, 4, 64, 16
FAMILIES = ("phi3", "neox", "falcon_mq", "falcon_new", "bloom", "mpt", "phi3_gqa8")


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The model ``name`` of :data:`FAMILIES`, its weights drawn from ``seed``."""
    import transformers as t

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS)
    falcon = dict(common, alibi=False, bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                  max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0)
    phi3 = dict(max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                embd_pdrop=0.0, attention_dropout=0.0)
    configs = {
        "phi3": lambda: t.Phi3ForCausalLM(t.Phi3Config(**common, num_key_value_heads=2, intermediate_size=FFN, **phi3)),
        "phi3_gqa8": lambda: t.Phi3ForCausalLM(t.Phi3Config(**dict(common, hidden_size=2 * HIDDEN, num_attention_heads=8),
                                                            num_key_value_heads=4, intermediate_size=2 * FFN, **phi3)),
        "neox": lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**common, intermediate_size=FFN, max_position_embeddings=SEQ,
                                                             hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                                                             eos_token_id=0)),
        "falcon_mq": lambda: t.FalconForCausalLM(t.FalconConfig(**falcon, multi_query=True,
                                                                new_decoder_architecture=False)),
        "falcon_new": lambda: t.FalconForCausalLM(t.FalconConfig(**falcon, num_kv_heads=2,
                                                                 new_decoder_architecture=True)),
        "bloom": lambda: t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS,
                                                          n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                                          bos_token_id=0, eos_token_id=0)),
        "mpt": lambda: t.MptForCausalLM(t.MptConfig(vocab_size=VOCAB, d_model=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                                                    max_seq_len=SEQ, expansion_ratio=2, resid_pdrop=0.0, emb_pdrop=0.0)),
    }
    torch.manual_seed(seed)
    return configs[name]()


def assert_split_as_planned(shapes: dict, name: str, tp: int) -> None:
    """Every column and row layer of the plan of ``build(name)`` at ``tp`` (attention and MLP of every block) is
    parallel, its weight on this rank of the planned shape: a column's outputs, a row's inputs divided by ``tp``; a
    fused ``[q | k | v]`` with its key/value heads replicated: the query rows divided (``<path>.q``), the key/value
    rows whole (``<path>.kv_weight``). ``shapes``: {layer path (its ``.kv_weight`` too): a rank's weight shape}."""
    from lightning_amp.parallel.plan import build_plan

    model = build(name)
    for unit in build_plan(model, "auto", tp).units:
        for path in unit.columns + unit.rows:
            out, inp = model.get_submodule(path).weight.shape
            heads = unit.qkv_heads.get(path)
            if heads is not None and heads.replicated(tp):
                assert list(shapes[f"{path}.q"]) == [heads.blocks[0] // tp, inp], (name, path)
                assert list(shapes[f"{path}.kv_weight"]) == [out - heads.blocks[0], inp], (name, path)
            else:
                want = [out // tp, inp] if path in unit.columns else [out, inp // tp]
                assert list(shapes[path]) == want, (name, path, shapes.get(path), want)
