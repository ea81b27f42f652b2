"""Per-family layouts, the fast path of ``plan="auto"``: which layers of a known model family form a unit.

A :class:`Unit` is a set of layers converted together: column-parallel layers whose split outputs
feed only the unit's row-parallel layers (Megatron's column -> row pairing), the module whose
head-count attributes must be divided by the TP size, and the sizes that must divide. Families:

=========================================  ===============================================  =====================
family                                      column (output split)                            row (input split)
=========================================  ===============================================  =====================
``nn.MultiheadAttention``                   its own q/k/v (:class:`ParallelMultiheadAttention`, heads split)
``nn.Transformer{Encoder,Decoder}Layer``    ``linear1``                                      ``linear2``
BERT/RoBERTa attention (``transformers``)   ``self.query``, ``self.key``, ``self.value``     ``output.dense``
BERT/RoBERTa MLP                            ``intermediate.dense``                           ``output.dense``
GPT-2 attention (``Conv1D``)                ``c_attn`` (fused QKV: q, k, v each split)       ``c_proj``
GPT-2 MLP (``Conv1D``)                      ``c_fc``                                         ``c_proj``
Llama/Mistral-style attention [*]           ``q_proj``/``query``, ``k_proj``, ``v_proj``     ``o_proj``
litgpt ``CausalSelfAttention``              ``qkv`` (fused ``[q | k | v]``, GQA/MQA heads)   ``proj``
named MLPs (Llama, Falcon, OPT, litgpt...)  ``gate_proj``/``up_proj``/``fc1``/``fc_1``/...   ``down_proj``/``fc2``/``proj``/...
``nn.Sequential``                           ``Linear``, elementwise modules, ``Linear``: first -> column, last -> row
=========================================  ===============================================  =====================

[*] :data:`FALLBACK_MATCHERS`: used only where torch.fx cannot read the module's forward; elsewhere
:mod:`~lightning_amp.parallel.reading.structure` finds these attentions (and any other) by what their forward computes.

Attention heads are split whole: the query heads and the key/value heads (GQA) must both divide by
the TP size, else :func:`lightning_amp.parallel.plan.build_plan` raises naming the module; litgpt's
key/value heads may instead be fewer than the ranks and divide the TP size: they are then replicated
(:mod:`~lightning_amp.parallel.fused_qkv`), and its attention gets a per-rank copy of its ``config``
with the local ``n_head``/``n_query_groups`` (the model's own ``Config`` is not changed); its per-head
``norm_q``/``norm_k`` have their gradients summed over the TP group. Matching is on child names and types,
not class names, so copies of these blocks under other class names (RoBERTa, ELECTRA, ...) are found too;
renamed layers are left to the structure.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import nn

from lightning_amp.parallel.reading.qkv_heads import QKVHeads
from lightning_amp.parallel.reading.dataflow import ELEMENTWISE
from lightning_amp.parallel.reading.projections import is_conv1d

#: head-count attributes divided by the TP size on a split attention module (when present as ints)
HEAD_ATTRS = ("num_heads", "n_heads", "num_attention_heads", "n_head", "num_key_value_heads", "n_kv_heads",
              "all_head_size", "split_size")
MLP_COLUMNS = ("gate_proj", "up_proj", "fc1", "dense_h_to_4h", "w1", "w3", "c_fc", "fc", "fc_1", "fc_2")
MLP_ROWS = ("down_proj", "fc2", "dense_4h_to_h", "w2", "c_proj", "proj")


@dataclass
class Unit:
    """Layers converted together (module paths relative to the planned module).

    ``attention``: an ``nn.MultiheadAttention`` replaced as a whole. ``chunks``/``transposed``: per
    column/row path, see :class:`~lightning_amp.parallel.layers.ShardLayout`. ``qkv_heads``: per fused
    ``[q | k | v]`` column path, its head layout (split by heads, see :mod:`~lightning_amp.parallel.fused_qkv`).
    ``head_config``: the module whose ``config`` (litgpt's ``Config``, shared with the whole model) gets a
    per-rank copy holding the local head counts of ``qkv_heads``. ``divisible``: (what, value) pairs that
    must divide by the TP size. ``problem``: why this unit cannot be split at all.

    Units found by structure (:mod:`~lightning_amp.parallel.reading.structure`, ``found_by="structure"``) also carry
    ``replicated_heads`` (per key or value projection kept whole on every rank: its head count and size, see
    :mod:`~lightning_amp.parallel.fused_qkv`), ``head_values`` (per attribute key, the per-rank value its
    forward needs, see :mod:`~lightning_amp.parallel.reading.heads`) and ``attention_shape`` (the heads it found).
    ``head_inputs``: per attention module path, the inputs of its forward cut to each rank's heads (an ALiBi bias, see
    :mod:`~lightning_amp.parallel.reading.head_inputs`). ``partial_grads``: modules or params used between the unit's
    columns and rows (a norm over each head's features): every rank sees only its heads, so their gradients are summed
    over the TP group.
    """

    family: str
    columns: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    attention: Optional[str] = None
    heads: Optional[str] = None
    chunks: dict[str, int] = field(default_factory=dict)
    transposed: set[str] = field(default_factory=set)
    qkv_heads: dict[str, QKVHeads] = field(default_factory=dict)
    head_config: Optional[str] = None
    divisible: list[tuple[str, int]] = field(default_factory=list)
    problem: Optional[str] = None
    found_by: str = "names"
    partial_grads: list[str] = field(default_factory=list)
    replicated_heads: dict[str, tuple[int, int]] = field(default_factory=dict)
    head_values: dict[tuple[str, tuple[str, ...]], int] = field(default_factory=dict)
    attention_shape: Optional[object] = None
    head_inputs: dict[str, tuple] = field(default_factory=dict)  # attention path -> its per-head inputs (ALiBi)

    @property
    def members(self) -> list[str]:
        return ([self.attention] if self.attention else []) + self.columns + self.rows


def _linear(parent: nn.Module, name: str) -> Optional[nn.Module]:
    child = getattr(parent, name, None)
    return child if isinstance(child, nn.Linear) else None


def _join(prefix: str, *names: str) -> str:
    return ".".join(n for n in (prefix, *names) if n)


def _int_attr(module: nn.Module, *names: str) -> Optional[int]:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


# ---------------------------------------------------------------------------------- matchers
# each takes (path, module) and returns the units rooted at that module (or none)


def multihead_attention_unit(path: str, m: nn.Module) -> list[Unit]:
    if not isinstance(m, nn.MultiheadAttention):
        return []
    problem = "add_bias_kv/add_zero_attn are not supported" if (m.bias_k is not None or m.add_zero_attn) else None
    return [Unit("nn.MultiheadAttention", attention=path, divisible=[(f"{path}.num_heads", m.num_heads)], problem=problem)]


def _torch_transformer_layer(path: str, m: nn.Module) -> list[Unit]:
    if not isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return []
    return [Unit("nn.Transformer layer MLP", [_join(path, "linear1")], [_join(path, "linear2")],
                 divisible=[(f"{path}.linear1.out_features", m.linear1.out_features)])]


def _bert_attention(path: str, m: nn.Module) -> list[Unit]:
    attn, out = getattr(m, "self", None), getattr(m, "output", None)
    if not (isinstance(attn, nn.Module) and isinstance(out, nn.Module)):
        return []
    qkv = [_linear(attn, n) for n in ("query", "key", "value")]
    dense = _linear(out, "dense")
    heads = _int_attr(attn, "num_attention_heads")
    if None in qkv or dense is None or heads is None:
        return []
    own = _join(path, "self")
    return [Unit("BERT attention", [_join(own, n) for n in ("query", "key", "value")], [_join(path, "output.dense")],
                 heads=own, divisible=[(f"{own}.num_attention_heads", heads)])]


def _bert_mlp(path: str, m: nn.Module) -> list[Unit]:
    inter, out = getattr(m, "intermediate", None), getattr(m, "output", None)
    if not (isinstance(inter, nn.Module) and isinstance(out, nn.Module)):
        return []
    up, down = _linear(inter, "dense"), _linear(out, "dense")
    if up is None or down is None or up.out_features != down.in_features:
        return []
    return [Unit("BERT MLP", [_join(path, "intermediate.dense")], [_join(path, "output.dense")],
                 divisible=[(f"{path}.intermediate.dense.out_features", up.out_features)])]


def _gpt2_attention(path: str, m: nn.Module) -> list[Unit]:
    c_attn, c_proj = getattr(m, "c_attn", None), getattr(m, "c_proj", None)
    if not (is_conv1d(c_attn) and is_conv1d(c_proj)) or _int_attr(m, "split_size") is None:
        return []
    heads = _int_attr(m, "num_heads")
    unit = Unit("GPT-2 attention", [_join(path, "c_attn")], [_join(path, "c_proj")], heads=path,
                chunks={_join(path, "c_attn"): 3}, transposed={_join(path, "c_attn"), _join(path, "c_proj")},
                divisible=[(f"{path}.num_heads", heads or 0)])
    if getattr(m, "is_cross_attention", False) or hasattr(m, "q_attn"):
        unit.problem = "GPT-2 cross-attention (q_attn) is not supported"
    elif heads is None or c_attn.nf != 3 * m.split_size:
        unit.problem = "expected a fused [q; k; v] c_attn of 3 x split_size outputs and a num_heads attribute"
    return [unit]


def _gpt2_mlp(path: str, m: nn.Module) -> list[Unit]:
    c_fc, c_proj = getattr(m, "c_fc", None), getattr(m, "c_proj", None)
    if not (is_conv1d(c_fc) and is_conv1d(c_proj)) or c_fc.nf != c_proj.nx:
        return []
    names = [_join(path, "c_fc"), _join(path, "c_proj")]
    return [Unit("GPT-2 MLP", names[:1], names[1:], transposed=set(names), divisible=[(f"{names[0]}.nf", c_fc.nf)])]


def _named_attention(path: str, m: nn.Module) -> list[Unit]:
    """Llama/Mistral/Qwen/OPT-style: ``q_proj``, ``k_proj``, ``v_proj`` (or ``query``, ``key``, ``value``) -> column,
    ``o_proj``/``out_proj`` -> row, all children of one attention module."""
    for names in (("q_proj", "k_proj", "v_proj"), ("query", "key", "value")):
        if all(_linear(m, n) is not None for n in names):
            break
    q, k, v = (_linear(m, n) for n in names)
    o_name = "o_proj" if _linear(m, "o_proj") is not None else "out_proj"
    o = _linear(m, o_name)
    if None in (q, k, v, o):
        return []
    unit = Unit("q/k/v/o attention", [_join(path, n) for n in names], [_join(path, o_name)], heads=path)
    head_dim = _int_attr(m, "head_dim", "head_size", "attention_head_size")
    heads = _int_attr(m, "num_heads", "num_attention_heads", "n_heads", "n_head")
    if head_dim is None and heads:
        head_dim = q.out_features // heads
    if not head_dim or q.out_features % head_dim or k.out_features % head_dim or q.out_features != o.in_features:
        unit.problem = "cannot tell the head size (expected a head_dim or num_heads attribute)"
        return [unit]
    unit.divisible = [(f"{path} query heads", q.out_features // head_dim),
                      (f"{path} key/value heads (GQA: fewer key/value heads than tensor-parallel ranks "
                       "cannot be split; use a smaller tensor_parallel_size)", k.out_features // head_dim)]
    return [unit]


def _litgpt_attention(path: str, m: nn.Module) -> list[Unit]:
    """litgpt's ``CausalSelfAttention``: one ``qkv`` Linear laid out ``[q | k | v]`` and ``proj``; the head
    counts in ``m.config`` (read by its forward and its KV cache)."""
    qkv, proj, config = _linear(m, "qkv"), _linear(m, "proj"), getattr(m, "config", None)
    counts = [_int_attr(config, n) for n in ("n_head", "n_query_groups", "head_size")] if config is not None else [None]
    if qkv is None or proj is None or None in counts:
        return []
    heads = QKVHeads(*counts)
    qkv_path = _join(path, "qkv")
    unit = Unit("litgpt attention", [qkv_path], [_join(path, "proj")], qkv_heads={qkv_path: heads}, head_config=path,
                partial_grads=[_join(path, n) for n in ("norm_q", "norm_k") if isinstance(getattr(m, n, None), nn.Module)])
    if qkv.out_features != sum(heads.blocks) or proj.in_features != heads.blocks[0]:
        unit.problem = (f"qkv.out_features={qkv.out_features}, proj.in_features={proj.in_features} do not match "
                        f"the [q | k | v] layout of config n_head={heads.n_head}, n_query_groups={heads.n_query_groups}, "
                        f"head_size={heads.head_size} (a legacy per-group interleaved qkv is not supported)")
    elif getattr(config, "norm_qk", False) and getattr(config, "norm_qk_type", "default") != "default":
        unit.problem = (f"norm_qk_type={config.norm_qk_type!r} normalises q and k across all heads; "
                        "their split would normalise a shard")
    return [unit]


def _named_mlp(path: str, m: nn.Module) -> list[Unit]:
    cols = [n for n in MLP_COLUMNS if _linear(m, n) is not None]
    rows = [n for n in MLP_ROWS if _linear(m, n) is not None]
    if not cols or len(rows) != 1:
        return []
    width = _linear(m, rows[0]).in_features
    if any(_linear(m, n).out_features != width for n in cols):
        return []
    return [Unit("named MLP", [_join(path, n) for n in cols], [_join(path, rows[0])],
                 divisible=[(f"{_join(path, cols[0])}.out_features", width)])]


def _sequential_mlp(path: str, m: nn.Module) -> list[Unit]:
    """In an ``nn.Sequential`` the order is the data flow: Linear, elementwise..., Linear."""
    if not isinstance(m, nn.Sequential):
        return []
    units, pending = [], None
    for name, child in m.named_children():
        if isinstance(child, nn.Linear):
            if pending is not None and pending[1].out_features == child.in_features:
                units.append(Unit("nn.Sequential MLP", [_join(path, pending[0])], [_join(path, name)],
                                  divisible=[(f"{_join(path, pending[0])}.out_features", child.in_features)]))
                pending = None
            else:
                pending = (name, child)
        elif not isinstance(child, ELEMENTWISE):
            pending = None
    return units


#: the fast path: layouts known by their modules' types and child names
MATCHERS: tuple[Callable[[str, nn.Module], list[Unit]], ...] = (
    multihead_attention_unit, _torch_transformer_layer, _bert_attention, _bert_mlp, _gpt2_attention, _gpt2_mlp,
    _litgpt_attention, _named_mlp, _sequential_mlp,
)
#: used only for modules whose forward torch.fx cannot read (the structure finds these attentions otherwise)
FALLBACK_MATCHERS: tuple[Callable[[str, nn.Module], list[Unit]], ...] = (_named_attention,)


def find_units(module: nn.Module, matchers=MATCHERS, claimed: Optional[set] = None) -> list[Unit]:
    """Every unit of ``matchers`` (default: the known families) in ``module`` whose layers are not in ``claimed``
    (a layer belongs to at most one unit)."""
    units: list[Unit] = []
    claimed = set() if claimed is None else set(claimed)
    inside_mha: list[str] = []
    for path, sub in module.named_modules():
        if any(path.startswith(p + ".") for p in inside_mha):
            continue
        if isinstance(sub, nn.MultiheadAttention):
            inside_mha.append(path)
        for matcher in matchers:
            for unit in matcher(path, sub):
                if not claimed.intersection(unit.members):
                    claimed.update(unit.members)
                    units.append(unit)
    return units
