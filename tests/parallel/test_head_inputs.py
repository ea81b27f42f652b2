"""Per-head inputs of an attention (an ALiBi bias built for all heads outside it) cut to each rank's heads
(lightning_amp/parallel/reading/head_inputs.py finds them, lightning_amp/parallel/head_input_slicer.py cuts them): along the third-to-last dimension, the heads alone ``[heads, 1, keys]`` (MPT)
or the batch and the heads folded batch first ``[batch * heads, 1, keys]`` (BLOOM); a dimension of 1 (a mask shared by
all heads) passes; any other size is an error naming the input; a fold the reading cannot order is refused at plan
time, before anything changes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_amp.parallel.head_input_slicer import HeadInputSlicer
from lightning_amp.parallel.reading.head_inputs import HeadInput
from lightning_amp.parallel.plan import build_plan
from support.optional_deps import require


class Takes(nn.Module):
    def forward(self, x, bias, mask=None):
        return x


def _slicer(folded: bool, rank: int, tp: int = 4, heads: int = 8) -> HeadInputSlicer:
    return HeadInputSlicer(Takes(), (HeadInput("bias", folded), HeadInput("mask", folded)), heads, rank, tp)


def test_heads_alone_are_cut_to_the_ranks_heads_by_position_and_by_name():
    bias = torch.arange(8.0).view(8, 1, 1).expand(8, 1, 5)  # head h holds h
    for rank in range(4):
        args, kwargs = _slicer(False, rank)(Takes(), (torch.zeros(2), bias), {"mask": bias})
        want = torch.tensor([2.0 * rank, 2.0 * rank + 1]).view(2, 1, 1).expand(2, 1, 5)
        assert torch.equal(args[1], want) and torch.equal(kwargs["mask"], want)


def test_batch_and_heads_folded_batch_first_are_cut_per_batch_entry():
    bias = (10 * torch.arange(3.0).view(3, 1) + torch.arange(8.0)).reshape(24, 1, 1)  # batch b, head h: 10 b + h
    (_, cut), _ = _slicer(True, 1)(Takes(), (None, bias), {})
    assert cut.flatten().tolist() == [2.0, 3.0, 12.0, 13.0, 22.0, 23.0]


def test_a_dimension_shared_by_all_heads_passes_and_any_other_size_is_refused_naming_the_input():
    shared = torch.randn(2, 1, 5, 5)
    assert _slicer(False, 0).cut(HeadInput("mask", False), shared) is shared
    with pytest.raises(RuntimeError, match="Takes gets bias of shape \\(6, 1, 5\\), whose dimension -3 holds 6: not "
                                           "its 8 heads"):
        _slicer(False, 0)(Takes(), (None, torch.randn(6, 1, 5)), {})
    with pytest.raises(RuntimeError, match="not its 8 heads times the batch"):
        _slicer(True, 0)(Takes(), (None, torch.randn(12, 1, 5)), {})


def test_a_fold_whose_order_the_reading_cannot_tell_is_refused_before_anything_changes():
    """BLOOM with 2 heads: the reading's batch is 2 too, so [batch, heads] and [heads, batch] look alike."""
    require("transformers")
    import transformers as t

    torch.manual_seed(0)
    model = t.BloomForCausalLM(t.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="its input 'alibi' meets scores whose heads are folded into the batch, but "
                                         "the reading cannot tell that the batch comes first"):
        build_plan(model, "auto", 2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.transformer.h[0].self_attention.num_heads == 2
