"""lightning_amp.amp.half_params: O2's fp32 Parameters seen as half copies inside forward, no Lightning."""
import pytest
import torch
from torch import nn

from lightning_amp.amp.half_params import HalfParams, prepare_o2_module_
from lightning_amp.amp.module_cast import cast_module_

HALVES = [torch.float16, torch.bfloat16]


class _Tied(nn.Module):
    """Embedding and a head that reads the embedding's weight from the parent's forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.BatchNorm1d(6)
        self.mix = nn.Linear(6, 6)

    def forward(self, idx):
        hidden = self.norm(self.embed(idx))
        return self.mix(hidden) @ self.embed.weight.t()


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    model = _Tied()
    model.register_buffer("offset", torch.randn(6))
    return prepare_o2_module_(model, dtype, keep_batchnorm_fp32=True), HalfParams(model, dtype, True)


@pytest.mark.parametrize("dtype", HALVES)
def test_params_stay_fp32_parameters_buffers_become_half_batchnorm_fp32(dtype):
    torch.manual_seed(0)
    model = _Tied().to(dtype)  # half params are upcast in place, the Parameter objects survive
    ids = [id(p) for p in model.parameters()]
    model.register_buffer("offset", torch.randn(6))
    prepare_o2_module_(model, dtype, keep_batchnorm_fp32=True)
    assert [id(p) for p in model.parameters()] == ids
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.offset.dtype == dtype and model.norm.running_mean.dtype == torch.float32
    assert len(model.norm._forward_pre_hooks) == 1


@pytest.mark.parametrize("dtype", HALVES)
def test_forward_sees_half_copies_and_grads_land_on_the_fp32_params(dtype):
    """Inside the block every non-BatchNorm weight (the tied one read by the parent included) is the
    param rounded to ``dtype``; outside it is the Parameter again. The fp32 grads equal the grads of
    the same half computation done by hand (one shared copy: the tied weight's two uses are summed)."""
    model, half = _model(dtype)
    idx = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1)).reshape(-1)
    with half:
        assert model.embed.weight.dtype == dtype and torch.equal(model.embed.weight, model.embed._parameters["weight"].to(dtype))
        assert model.norm.weight.dtype == torch.float32 and isinstance(model.norm.weight, nn.Parameter)
        assert model.mix.weight.requires_grad and not isinstance(model.mix.weight, nn.Parameter)
        out = model(idx)
    assert out.dtype == dtype and isinstance(model.embed.weight, nn.Parameter)
    (out.float() ** 2).mean().backward()

    ref = _Tied()  # the same model cast to half by hand (BatchNorm fp32)
    ref.load_state_dict(model.state_dict(), strict=False)
    cast_module_(ref, dtype, keep_batchnorm_fp32=True)
    (ref(idx).float() ** 2).mean().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, r.grad.float()), name


def test_error_inside_the_block_removes_the_copies():
    model, half = _model(torch.bfloat16)
    with pytest.raises(RuntimeError, match="boom"):
        with half:
            raise RuntimeError("boom")
    assert isinstance(model.mix.weight, nn.Parameter) and "weight" not in model.mix.__dict__
    assert not half._installed and half._hook is None


def test_writes_and_requires_grad_changes_inside_the_block_reach_the_next_forward():
    """A write to the Parameter (as an optimizer step or a callback does) and toggling requires_grad
    (``toggle_optimizer``) inside the block are seen by the next module forward in that block."""
    model, half = _model(torch.bfloat16)
    x = torch.randn(3, 6).bfloat16()
    with half:
        with torch.no_grad():
            model.mix._parameters["weight"].mul_(2.0)
        assert torch.equal(model.mix(x), nn.functional.linear(x, (model.mix._parameters["weight"]).bfloat16(),
                                                              model.mix._parameters["bias"].bfloat16()))
        model.mix._parameters["weight"].requires_grad_(False)
        out = model.mix(x)
        assert not model.mix.weight.requires_grad
        model.mix._parameters["weight"].requires_grad_(True)
        out = model.mix(x)
    out.sum().backward()
    assert model.mix._parameters["weight"].grad is not None


def test_a_module_added_after_the_first_forward_gets_copies():
    """The plan is cached between forwards; registering a module anywhere makes the next entry rebuild it."""
    model, half = _model(torch.bfloat16)
    with half:
        model(torch.tensor([1, 2]))
    model.extra = nn.Linear(6, 6)  # after the plan was built
    prepare_o2_module_(model, torch.bfloat16, keep_batchnorm_fp32=True)
    with half:
        assert model.extra.weight.dtype == torch.bfloat16 and model.mix.weight.dtype == torch.bfloat16
    assert isinstance(model.extra.weight, nn.Parameter)


def test_a_param_replaced_in_parameters_directly_is_the_one_copied():
    """Writing ``module._parameters[name]`` bypasses the registration hooks: the slot check finds it."""
    model, half = _model(torch.bfloat16)
    with half:
        model(torch.tensor([1, 2]))
    new = nn.Parameter(torch.randn(6, 6))
    model.mix._parameters["weight"] = new
    with half:
        assert torch.equal(model.mix.weight, new.detach().bfloat16())
        model(torch.tensor([1, 2])).float().sum().backward()
    assert new.grad is not None and new.grad.dtype == torch.float32
    assert "weight" not in model.mix.__dict__


def test_without_watching_writes_no_hook_runs_inside_the_block():
    """``watch_writes=False`` (automatic optimization): no global hook, copies made once per entry."""
    model, half = _model(torch.bfloat16)
    half.watch_writes = False
    with half:
        assert half._hook is None
        before = model.mix.weight
        with torch.no_grad():
            model.mix._parameters["weight"].mul_(2.0)
        model(torch.tensor([1, 2]))
        assert model.mix.weight is before
    half.watch_writes = True
    with half:
        assert half._hook is not None


def _bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"  # CPU's flash attention has no double backward
    model = transformers.BertForSequenceClassification(config)
    model.bert.pooler.dense.weight.requires_grad_(False)  # frozen: its copy must not ask for a grad
    return prepare_o2_module_(model, torch.bfloat16, keep_batchnorm_fp32=True)


def _bert_loss(model):
    generator = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 64, (4, 8), generator=generator), torch.randint(0, 3, (4,), generator=generator)
    with HalfParams(model, torch.bfloat16, True, watch_writes=False):
        assert not model.bert.pooler.dense.weight.requires_grad
        return model(input_ids=ids).logits.float().log_softmax(-1).gather(1, labels[:, None]).mean().neg()


def test_the_graph_reaches_the_fp32_parameters():
    """What a design with half copies as autograd leaves (grads folded into ``p.grad`` after backward)
    would break: ``torch.autograd.grad`` w.r.t. a Parameter (and its double backward), and each
    Parameter's tensor hook, which fires once with the fp32 grad that ``backward`` accumulates."""
    model = _bert()
    params = [p for p in model.parameters() if p.requires_grad]
    calls = []
    for i, param in enumerate(params):
        param.register_hook(lambda grad, i=i: calls.append((i, grad.dtype)))
    _bert_loss(model).backward()
    assert sorted(calls) == [(i, torch.float32) for i in range(len(params))]
    accumulated = [p.grad for p in params]
    grads = torch.autograd.grad(_bert_loss(model), params, create_graph=True)
    assert all(torch.equal(g, a) for g, a in zip(grads, accumulated))
    penalty = sum(g.square().sum() for g in grads)
    second = torch.autograd.grad(penalty, params[-1])[0]  # through the casts' double backward
    assert second.dtype == torch.float32 and torch.isfinite(second).all() and second.abs().sum() > 0
